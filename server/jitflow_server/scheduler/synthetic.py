"""Synthetic request snapshots for scheduler micro-benchmarks (``jitflow bench frame``).

Not a workload model for goodput experiments: only a plausible mix of kinds, lengths and states
so that every code path of a frame is exercised at scale.
"""

from __future__ import annotations

import numpy as np

from jitflow_server.scheduler.types import Kind, RequestView


def synthetic_views(n: int, batch_size: int = 64, now: float = 1000.0, seed: int = 0,
                    best_effort_share: float = 0.1) -> list[RequestView]:
    """``n`` queued/running requests at time ``now`` (s): latency / deadline / compound 1:1:1 plus
    ``best_effort_share`` best-effort; compound calls come in stage groups of 1-6 calls; the first
    ``batch_size`` requests are running (prefilled, holding KV). Lengths in tokens are log-normal
    (input median ≈ 400, output bound median ≈ 300). SLOs follow JITServe §6.1 (TTFT 2 s, TBT 0.1 s,
    deadline 20 s, compound 20 s per stage). Raises ``ValueError`` for ``n < 0``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    inp = np.clip(rng.lognormal(6.0, 0.9, n), 8, 8000).astype(int)
    bound = np.clip(rng.lognormal(5.7, 0.8, n), 8, 4000).astype(int)
    true = np.maximum((bound * rng.uniform(0.3, 1.0, n)).astype(int), 1)
    arrival = now - rng.uniform(0.0, 30.0, n)
    kinds = rng.choice(4, n, p=[(1 - best_effort_share) / 3] * 3 + [best_effort_share])
    views: list[RequestView] = []
    task = 0
    left_in_group = 0
    for i in range(n):
        running = i < batch_size
        gen = int(rng.integers(1, max(int(true[i]), 2))) if running else 0
        k = int(kinds[i])
        v = RequestView(
            req_id=f"r{i}", kind=Kind.BEST_EFFORT, arrival=float(arrival[i]), input_len=int(inp[i]),
            generated=gen, len_bound=int(bound[i]), running=running,
            kv_tokens=int(inp[i]) + gen - 1 if running else 0, true_len=int(true[i]),
        )
        if k == 0:
            v.kind, v.ttft, v.tbt = Kind.LATENCY, 2.0, 0.1
        elif k == 1:
            v.kind, v.deadline = Kind.DEADLINE, v.arrival + 20.0
        elif k == 2:
            if left_in_group == 0:
                task += 1
                left_in_group = int(rng.integers(1, 7))
                stages = int(rng.integers(2, 5))
                stage = int(rng.integers(0, stages))
                t0 = v.arrival - 20.0 * stage * float(rng.uniform(0.2, 0.8))
                task_deadline = t0 + 20.0 * stages
                sub = t0 + 20.0 * stages * (stage + 1) / stages
            left_in_group -= 1
            v.kind, v.task_id, v.stage_index = Kind.COMPOUND, f"t{task}", stage
            v.deadline, v.sub_deadline = task_deadline, sub
            v.task_tokens_est = int(stages * 4 * 700)
            v.task_rem_gen_time = float((stages - stage - 1) * 4 * 300 * 0.02)
        views.append(v)
    return views
