"""Simulated serving over several replicas of different speeds (JITServe §6.4, Fig. 18).

One workload (``make_workload``) arrives at a front end that routes every job, in arrival order, to a
replica (``scheduler/routing.py``); each replica is then simulated on its own jobs by the single-engine
simulator (``run_sim_one``) with its own step model (the preset's, every step ``1 / speed`` times as
long) and its own scheduling policy. Token and request goodput are summed over the replicas (one
summary of all records over the workload's arrival window).

What the router knows (never the truth): each replica's speed (output tokens per second at a full
batch and prompt tokens per second, from its step model, as a live router would measure them), the
work it routed there (:class:`~jitflow_server.scheduler.routing.Backlog`), and per request its prompt
tokens, its SLO and an output estimate: the mean output of its kind over the workload (the length
predictor's role; a compound task counts all its calls). A compound task is routed as a whole (its
stages share context, so all of them go where its first went; per-call routing of stages is not
simulated). Routing decisions are timed (µs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jitflow_server.bench.metrics import summarize
from jitflow_server.bench.runner import RunSettings, run_sim_one
from jitflow_server.bench.workload import DataSources
from jitflow_server.engine.jobs import Job
from jitflow_server.engine.step_model import StepModel
from jitflow_server.scheduler.routing import Backlog, ReplicaSpeed, RouteRequest, make_router


@dataclass
class ReplicaRun:
    """One routed run: per-replica job counts, the combined summary and routing decision times."""

    router: str
    policy: str
    jobs_per_replica: list[int]
    summary: dict[str, Any]
    route_us: list[float] = field(default_factory=list)


def replica_speed(model: StepModel, batch_size: int) -> ReplicaSpeed:
    """The speed a router measures on a replica with step model ``model``: output tokens per second at a
    full batch of ``batch_size`` and prompt tokens per second."""
    return ReplicaSpeed(output_tok_s=batch_size / model.decode_token_time(batch_size),
                        prefill_tok_s=1.0 / model.per_prefill_token_s)


def output_estimates(jobs: list[Job]) -> dict[str, float]:
    """Mean output tokens per job kind over ``jobs`` (all calls of a compound task summed)."""
    by_kind: dict[str, list[int]] = {}
    for j in jobs:
        by_kind.setdefault(j.kind, []).append(j.total_tokens[1])
    return {k: float(np.mean(v)) for k, v in by_kind.items()}


def route_request(job: Job, estimates: dict[str, float]) -> RouteRequest:
    """What the front end knows of ``job`` at its arrival (module docstring)."""
    out = estimates.get(job.kind, 1.0)
    if job.deadline is not None:
        slo = job.deadline
    elif job.ttft is not None and job.tbt is not None:
        slo = job.ttft + job.tbt * out
    else:
        slo = None
    key = job.job_id if job.kind == "compound" else None
    return RouteRequest(now=job.arrival, input_tokens=job.total_tokens[0], output_tokens=out, slo_s=slo, key=key,
                        urgent=job.kind == "latency")


def route_jobs(jobs: list[Job], speeds: list[ReplicaSpeed], router_name: str, seed: int = 0
               ) -> tuple[list[list[Job]], list[float]]:
    """Jobs per replica in arrival order, and each decision's time (µs). Raises ``ValueError`` for an
    unknown router."""
    router = make_router(router_name, seed=seed)
    backlog = Backlog(speeds)
    est = output_estimates(jobs)
    out: list[list[Job]] = [[] for _ in speeds]
    times: list[float] = []
    for job in jobs:
        req = route_request(job, est)
        t0 = time.perf_counter()
        i = router.route(req, backlog)
        times.append((time.perf_counter() - t0) * 1e6)
        out[i].append(job)
    return out, times


def run_replicas(jobs: list[Job], model: StepModel, speeds: list[float], router: str, policy: str,
                 st: RunSettings, data: DataSources, analyzers: dict | None = None) -> ReplicaRun:
    """Route ``jobs`` over replicas of relative ``speeds`` (1 = the preset) with ``router`` and simulate
    each replica under ``policy``; the combined summary over the workload's arrival window."""
    if not speeds or any(not s > 0 for s in speeds):
        raise ValueError(f"replica speeds must be positive, got {speeds}")
    models = [model.scaled(1.0 / s) for s in speeds]
    b = st.batch_size or model.batch_size
    parts, route_us = route_jobs(jobs, [replica_speed(m, b) for m in models], router, seed=st.seed)
    records: list[dict] = []
    frames: list[float] = []
    end = jobs[0].arrival if jobs else 0.0
    for m, part in zip(models, parts):
        if not part:
            continue
        res = run_sim_one(part, m, policy, st, data, analyzers, keep_records=True)
        records += res["records"]
        frames += res["frame_ms_all"]
        end = max(end, res["makespan_at"])
    span = (jobs[-1].arrival - jobs[0].arrival) if len(jobs) > 1 else 1.0
    summary = summarize(records, span, end - (jobs[0].arrival if jobs else 0.0), frames)
    return ReplicaRun(router, policy, [len(p) for p in parts], summary, route_us)


def decision_time_us(n_replicas: int, n_requests: int = 2000, router: str = "goodput", rps: float = 50.0,
                     seed: int = 0) -> dict[str, float]:
    """P50/P99 µs of one routing decision over ``n_replicas`` replicas of mixed speeds under a synthetic
    stream of ``n_requests`` requests (about ``rps`` per second, half of them with SLOs)."""
    rng = np.random.default_rng(seed)
    speeds = [ReplicaSpeed(output_tok_s=float(rng.choice([1500.0, 3000.0])), prefill_tok_s=9000.0)
              for _ in range(n_replicas)]
    backlog, r = Backlog(speeds), make_router(router, seed=seed)
    times = []
    t = 0.0
    for i in range(n_requests):
        t += float(rng.exponential(1.0 / rps))
        req = RouteRequest(now=t, input_tokens=int(rng.integers(100, 2000)), output_tokens=float(rng.integers(50, 500)),
                           slo_s=float(rng.uniform(5, 60)) if i % 2 else None,
                           key=f"task-{i // 4}" if i % 3 == 0 else None)
        t0 = time.perf_counter()
        r.route(req, backlog)
        times.append((time.perf_counter() - t0) * 1e6)
    return {"p50_us": float(np.percentile(times, 50)), "p99_us": float(np.percentile(times, 99))}
