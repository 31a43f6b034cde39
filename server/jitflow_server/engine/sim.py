"""Discrete-event simulator of a continuously batched LLM engine running the jitflow policy core
(JITServe §6 evaluates on one; this one mirrors the vLLM plug-in).

It mirrors what the vLLM plug-in (``engine/plugin.py``) does, in virtual time:

- every engine step, ``policy.needs_recompute(step, arrivals_or_finishes)`` decides whether a new
  frame is computed (every Δ decode steps, and on arrivals/finishes); a frame builds
  :class:`~jitflow_server.scheduler.RequestView` s of all live calls (running first, then waiting)
  and a :class:`~jitflow_server.scheduler.SchedContext` whose ``token_time`` and ``prefill_rate``
  come from a :class:`~jitflow_server.tracker.steps.StepTimeTracker` fed with the simulated step
  times (as the plug-in's tracker is fed with measured ones), and applies the
  :class:`~jitflow_server.scheduler.Decision`: ``preempt`` frees KV (recompute, or swap when the
  preset has a ``swap_rate``); chosen running calls run in plan order; chosen waiting calls are
  admitted in plan order while the token budget, B and KV blocks allow; running calls outside the
  plan are *paused* (keep KV); beyond 2·B running+chosen the excess paused calls are preempted;
- vLLM semantics inside a step: chunked prefill with a per-step token budget (``max_batched_tokens``;
  ``sarathi_chunk`` for the ``sarathi`` baseline); when a running call needs a KV block and none is
  free, the last running call in plan order is preempted by recompute (vLLM's ``_preempt_request``);
  no waiting call is admitted in a step that preempted; a call emits its first token at the end of
  the step that completes its prefill; a preempted call recomputes ``input + generated`` tokens,
  less what vLLM's automatic prefix caching still holds (``StepModel.prefix_caching``, default on):
  its freed blocks go to the tail of a FIFO free queue and are reused by later allocations, so a
  call re-admitted before the queue turns over gets its full blocks back (the miss that made the
  simulator thrash under LAS and overstate recompute costs: docs/benchmarks-history.md);
  preemptions are counted by reason (``policy``, ``slots``, ``kv``, ``blocked``);
- cross-request prefix caching (only for calls whose :class:`~jitflow_server.engine.jobs.CallSpec` has
  ``prefix_ids``, e.g. a replayed Mooncake trace's ``hash_ids``; only with ``StepModel.prefix_caching``):
  a global cache of 512-token prefix blocks, keyed by the chain of ids up to each block (so a block hits
  only after the same preceding blocks, like vLLM's block hashes). A call starting its prefill with the
  leading ``k`` blocks cached skips ``min(512·k, input − 1)`` tokens, rounded down to ``block_size``
  (for a preempted call, the larger of this and its own-blocks hit above); a call's blocks are inserted
  (and touched) when its prefill completes. The cache is an LRU of at most ``kv_capacity_tokens // 512``
  blocks: vLLM keeps a cached block hit-able while any running request shares it and, once freed, until
  the free queue reuses it, so the cache can reach the whole KV cache and evicts the least recently used
  content first. This is optimistic under KV pressure (running calls' private blocks shrink the real
  cache), and hits do not reduce the hitting call's KV block count (shared blocks are counted once per
  call, conservatively). Calls without ``prefix_ids`` never touch the cache, so their runs are unchanged;
- admission control (JITServe §5): a call never scheduled within ``waiting_time`` is rejected (with
  ``compound_waiting="sub_deadline"``, an option, a compound call may wait until its stage's sub-deadline
  when that is later, as on the real server with ``ServerSettings.compound_waiting``);
- step time from the preset (:class:`~jitflow_server.bench.presets.StepModel`), with the
  heterogeneity penalty; stretches of pure decode steps with an unchanged plan are advanced in one
  vectorised *macro-step* (same result as stepping one by one, up to the heterogeneity factor being
  taken from the macro-step's first step).

Goodput is judged with :func:`jitflow_server.tracker.goodput.evaluate`, as on the real server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from jitflow_server.engine.jobs import GIVE_UP_AFTER_S, Job
from jitflow_server.engine.step_model import StepModel
from jitflow_server.scheduler import Kind, Policy, RequestView
from jitflow_server.scheduler.admission import (
    DEFAULT_WAITING_TIME_S,
    check_compound_waiting,
    compound_waiting_time,
)
from jitflow_server.scheduler.lifecycle import Lifecycle
from jitflow_server.scheduler.prefill_budget import Timeline
from jitflow_server.scheduler.types import SLOSpec
from jitflow_server.tracker.goodput import evaluate
from jitflow_server.tracker.steps import StepTimeTracker

_KIND = {"latency": Kind.LATENCY, "deadline": Kind.DEADLINE, "compound": Kind.COMPOUND,
         "best_effort": Kind.BEST_EFFORT}


class LengthBounds(Protocol):
    """The simulator's length bounds (tokens): it knows each call's true length, and the source decides how
    much of it the policy sees. ``cls`` is ``(kind, app, stage)``; ``z`` the call's persistent noise
    draw; ``rid`` the call's id (``"<job_id>.<stage>.<index>"``, for sources that keep per-call state, e.g.
    the attached prompt of the real predictor); bounds are refreshed every ``refine_every`` generated tokens."""

    refine_every: int

    def bound(self, true_len: int, generated: int, z: float, cls: tuple, rid: str) -> int: ...


class StageAdvisor(Protocol):
    """The compound advisor as the simulator uses it: advice for stage ``s`` of ``job`` started at ``t0``
    (an object with ``sub_deadline``, ``task_rem_gen_time``, ``task_tokens_est``); ``match_ms`` lists the
    match times."""

    match_ms: list[float]

    def stage_info(self, job: Job, s: int, t0: float) -> Any: ...


def prefix_keys(ids: tuple[int, ...]) -> tuple[int, ...]:
    """Cache keys of a prompt's prefix blocks: key ``i`` hashes ``ids[0..i]`` (chained), so a block is
    found only after the same preceding blocks (equal ids at the same positions)."""
    keys, h = [], 0
    for x in ids:
        h = hash((h, x))
        keys.append(h)
    return tuple(keys)


class SimulationError(RuntimeError):
    """The simulation cannot proceed (e.g. a call larger than the whole KV cache)."""


@dataclass(slots=True)
class _JobState:
    job: Job
    t0: float
    stage: int = 0
    open_calls: int = 0
    failed: bool = False
    done: bool = False
    end: float | None = None
    first_token: float | None = None
    attained: int = 0
    out_tokens: int = 0
    out_tokens_window: int = 0  # generated before the last arrival (steady-state throughput)
    served_in: int = 0  # prompt tokens of calls that produced a token
    served_in_window: int = 0  # ... whose first token came before the last arrival
    n_preempt: int = 0
    call_recs: list = field(default_factory=list)
    calls: list = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Call:
    rid: str
    js: _JobState
    stage: int
    input_len: int
    true_len: int
    arrival: float
    view: RequestView
    z: float
    cls: tuple
    waiting_time: float | None
    computed: int = 0
    generated: int = 0
    blocks: int = 0
    running: bool = False
    swapped: int = 0
    cache_evict_at: int = 0  # prefix cache: allocation count at which its first freed block is reused
    cache_blocks: int = 0  # ... how many blocks it freed (0: nothing cached)
    cache_full: int = 0  # ... of which full blocks (reusable)
    prefix_keys: tuple | None = None  # chained keys of CallSpec.prefix_ids (cross-request prefix cache)
    bound_at: int = -1
    life: Lifecycle | None = None  # the request state machine shared with the vLLM plug-in
    token_times: list = field(default_factory=list)

    def decoding(self) -> bool:
        """True once the prompt (or its recomputation after a preemption) is in the KV cache."""
        return self.generated > 0 and self.computed >= self.input_len + self.generated - 1

    def timeline(self) -> Timeline | None:
        """The SLO timeline of a latency call (``scheduler/prefill_budget.Timeline``), else ``None``."""
        v = self.view
        if v.kind is not Kind.LATENCY or v.ttft is None or v.tbt is None:
            return None
        return v.arrival, v.ttft, v.tbt, self.generated


@dataclass
class SimConfig:
    """Simulator settings: ``batch_size`` B (default: the preset's); ``waiting_time`` s (admission
    control, ``None`` = off); ``chunk`` per-step token budget override; ``max_drain_s`` virtual
    seconds after the last arrival before unfinished calls are cut off (counted as missed);
    ``give_up_after`` s after its deadline the client of a deadline request or of a compound task stops
    waiting and the call (the whole task) is aborted (``None``: clients wait forever);
    ``compound_waiting``: ``"waiting_time"`` (default) holds every call to ``waiting_time``;
    ``"sub_deadline"`` lets a compound call wait for its start until its stage's sub-deadline (the
    analyzer's) when that is later."""

    batch_size: int | None = None
    waiting_time: float | None = DEFAULT_WAITING_TIME_S
    chunk: int | None = None
    max_drain_s: float = 1800.0
    seed: int = 0
    give_up_after: float | None = GIVE_UP_AFTER_S
    compound_waiting: str = "waiting_time"

    def __post_init__(self) -> None:
        check_compound_waiting(self.compound_waiting)


class SimEngine:
    """Run one workload through one policy in virtual time (see module docstring).

    ``run(jobs)`` returns a dict with ``jobs`` (one record per job: kind, app, arrival, slo_met,
    goodput tokens, ttft/tbt_mean/e2el s, output tokens, rejected, preemptions), ``makespan`` s,
    ``frame_ms`` (wall ms of each ``policy.schedule`` call), ``steps``, ``preemptions``,
    ``prefill_tokens`` (prompt tokens computed, recomputation included), ``prefix_hit_tokens`` (prefill
    tokens skipped thanks to the cross-request prefix cache), ``kv_peak_blocks`` and ``wall_s``.
    ``on_step(t, step, n_scheduled, used_kv_blocks)`` is called after every (macro-)step. Raises :class:`SimulationError` if a call cannot fit the KV cache.
    """

    def __init__(self, model: StepModel, policy: Policy, bounder: LengthBounds,
                 analyzer: StageAdvisor | None, config: SimConfig | None = None,
                 on_step: Callable[[float, int, int, int], None] | None = None) -> None:
        self.m = model
        self.policy = policy
        self.bounder = bounder
        self.analyzer = analyzer
        self.cfg = config or SimConfig()
        self.B = int(self.cfg.batch_size or model.batch_size)
        chunk = self.cfg.chunk or (model.sarathi_chunk if getattr(policy, "name", "") == "sarathi"
                                   else model.max_batched_tokens)
        self.budget0 = int(chunk)
        self.cap_blocks = model.kv_capacity_tokens // model.block_size
        self.bs = model.block_size
        self.tracker = StepTimeTracker(default_token_time=model.decode_token_time(self.B),
                                       default_prefill_rate=1.0 / max(model.per_prefill_token_s, 1e-9))
        prm = getattr(policy, "params", None)
        self.delta = int(getattr(prm, "delta_steps", None) or getattr(policy, "delta_steps", 1) or 1)
        self.on_step = on_step
        self.rng = np.random.default_rng(self.cfg.seed)

    # ------------------------------------------------------------------ helpers
    def _new_call(self, js: _JobState, s: int, j: int, now: float) -> _Call:
        job = js.job
        c = job.stages[s][j]
        rid = f"{job.job_id}.{s}.{j}"
        kind = _KIND[job.kind]
        # no max_tokens: the workloads carry no client cap, and the true length (``true_len``, read by
        # the oracle only) must not reach the other policies through one
        v = RequestView(req_id=rid, kind=kind, arrival=now, input_len=c.input_len, generated=0, len_bound=1,
                        running=False, true_len=c.output_len, max_tokens=None)
        if job.kind == "latency":
            v.ttft, v.tbt = job.ttft, job.tbt
        elif job.kind == "deadline":
            v.deadline = now + float(job.deadline)
        elif job.kind == "compound":
            v.deadline = js.t0 + float(job.deadline)
            v.task_id, v.stage_index = job.job_id, s
        call = _Call(rid, js, s, c.input_len, c.output_len, now, v, float(self.rng.standard_normal()),
                     (job.kind, job.app, s), self.cfg.waiting_time, life=Lifecycle(now))
        v.len_bound = self.bounder.bound(c.output_len, 0, call.z, call.cls, rid)
        if c.prefix_ids:
            call.prefix_keys = prefix_keys(c.prefix_ids)
        return call

    def _start_stage(self, js: _JobState, now: float) -> list[_Call]:
        s = js.stage
        calls = [self._new_call(js, s, j, now) for j in range(len(js.job.stages[s]))]
        if js.job.kind == "compound" and self.analyzer is not None:
            info = self.analyzer.stage_info(js.job, s, js.t0)
            for c in calls:
                c.view.sub_deadline = info.sub_deadline
                c.view.task_rem_gen_time = info.task_rem_gen_time
                c.view.task_tokens_est = info.task_tokens_est
                c.waiting_time = compound_waiting_time(c.waiting_time, info.sub_deadline - now,
                                                       self.cfg.compound_waiting)
        js.open_calls = len(calls)
        js.calls.extend(calls)
        return calls

    # ------------------------------------------------------------------ main loop
    def run(self, jobs: list[Job]) -> dict:
        """Simulate ``jobs`` (sorted by arrival) to completion; see the class docstring."""
        from jitflow_server.engine.sim_run import SimRun

        return SimRun(self, jobs).run()

    @staticmethod
    def _job_record(js: _JobState) -> dict:
        job = js.job
        recs = js.call_recs
        in_tok = sum(r[1] for r in recs)
        rejected = any(r[7] is False and r[2] == 0 for r in recs)
        if job.kind in ("latency", "deadline"):
            arr, _, n_out, ft, lt, tbt, res, ok = recs[0] if recs else (job.arrival, 0, 0, None, None, None, None, False)
            met = bool(res.slo_met) if res is not None else False
            good = int(res.token_goodput) if res is not None else 0
            return {"id": job.job_id, "kind": job.kind, "app": job.app, "arrival": job.arrival,
                    "slo_met": met, "goodput": good, "output_tokens": n_out, "input_tokens": in_tok,
                    "ttft": (ft - arr) if ft is not None else None, "tbt_mean": tbt,
                    "e2el": (lt - arr) if lt is not None else None, "rejected": rejected,
                    "preemptions": js.n_preempt, "calls": 1, "output_tokens_window": js.out_tokens_window,
                    "served_input_tokens": js.served_in, "served_input_tokens_window": js.served_in_window}
        n_calls = job.n_calls
        complete = (not js.failed) and len(recs) == n_calls and all(r[7] for r in recs)
        end = max((r[4] for r in recs if r[4] is not None), default=None)
        met = False
        if complete and end is not None:
            met = bool(evaluate(SLOSpec("compound", deadline=job.deadline), js.t0, [end], 0).slo_met)
        total = in_tok + js.out_tokens
        return {"id": job.job_id, "kind": job.kind, "app": job.app, "arrival": job.arrival, "slo_met": met,
                "goodput": total if met else 0, "output_tokens": js.out_tokens, "input_tokens": in_tok,
                "ttft": (js.first_token - js.t0) if js.first_token is not None else None,
                "tbt_mean": None, "e2el": (end - js.t0) if (complete and end is not None) else None,
                "rejected": rejected, "preemptions": js.n_preempt, "calls": n_calls,
                "output_tokens_window": js.out_tokens_window, "served_input_tokens": js.served_in,
                "served_input_tokens_window": js.served_in_window}
