"""Simulated serving over several replicas of different speeds (JITServe §6.4, Fig. 18).

One workload (``make_workload``) arrives at a front end that routes every job, in arrival order, to a
replica (``scheduler/routing.py``). The replicas are simulated side by side, each by the single-engine
simulator (:class:`~jitflow_server.engine.sim_run.SimRun`) with its own step model (the preset's, every
step ``1 / speed`` times as long) and its own scheduling policy: before each routing decision every
replica is advanced to the job's arrival, so the router sees the replicas as they are then. Token and
request goodput are summed over the replicas (one summary of all records over the workload's arrival
window).

What the router knows (never the truth), as the live front end (``engine/remote.py``) knows it: each
replica's speed (output tokens per second at a full batch and prompt tokens per second, from its step
model, as a live router would measure them) and, per job it routed there and that has not ended, the
prompt tokens (until its first token), an output estimate (the mean output of its kind over the
workload, the length predictor's role; a compound task counts all its calls) less the tokens it has
generated, and the time by which it must finish (:func:`front_end_backlog`). A job that was rejected,
abandoned or finished leaves the backlog when it ends on its replica, not when a fluid estimate of the
queue would have drained it. A compound task is routed as a whole (its stages share context, so all of
them go where its first went; per-call routing of stages is not simulated). Routing decisions are timed
(µs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jitflow_server.bench.metrics import summarize
from jitflow_server.bench.runner import RunSettings, build_sim
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


@dataclass
class _Routed:
    """A job routed to ``replica``, as the front end tracks it until it ends there (an
    :class:`~jitflow_server.scheduler.routing.InFlight`)."""

    job: Job
    req: RouteRequest
    state: Any  # the replica's per-job state (engine/sim.py ``_JobState``)
    replica: int

    @property
    def prompt_tokens(self) -> int:
        return self.req.input_tokens

    @property
    def est_output(self) -> float:
        return self.req.output_tokens

    @property
    def generated(self) -> int:
        """Output tokens the job has generated so far (finished calls and the ones in flight)."""
        js = self.state
        return js.out_tokens + sum(c.generated for c in js.calls if not c.life.done)

    @property
    def urgent(self) -> bool:
        return self.req.urgent

    @property
    def deadline(self) -> float | None:
        return None if self.req.slo_s is None else self.req.now + self.req.slo_s


def front_end_backlog(now: float, speeds: list[ReplicaSpeed], routed: list[list[_Routed]]) -> Backlog:
    """Each replica's work in flight at ``now`` as the front end knows it (module docstring), built as
    ``RemoteEngine`` builds it (:meth:`~jitflow_server.scheduler.routing.Backlog.in_flight`). Ended jobs are
    dropped from ``routed`` in place."""
    for jobs in routed:
        jobs[:] = [r for r in jobs if not r.state.done]
    return Backlog.in_flight(now, speeds, (r for jobs in routed for r in jobs))


def run_replicas(jobs: list[Job], model: StepModel, speeds: list[float], router: str, policy: str,
                 st: RunSettings, data: DataSources, analyzers: dict | None = None) -> ReplicaRun:
    """Route ``jobs`` over replicas of relative ``speeds`` (1 = the preset) with ``router`` while the replicas
    serve them under ``policy`` (module docstring); the combined summary over the workload's arrival window.
    Raises ``ValueError`` for non-positive speeds, an unknown router or policy."""
    from jitflow_server.engine.sim_run import SimRun

    if not speeds or any(not s > 0 for s in speeds):
        raise ValueError(f"replica speeds must be positive, got {speeds}")
    models = [model.scaled(1.0 / s) for s in speeds]
    b = st.batch_size or model.batch_size
    rspeeds = [replica_speed(m, b) for m in models]
    rt = make_router(router, seed=st.seed)
    setups = [build_sim(jobs, m, policy, st, data, analyzers) for m in models]
    work = setups[0].jobs  # the jobs as the engines see them (held-out prompts attached under the predictor)
    last = max((j.arrival for j in work), default=0.0)
    runs = [SimRun(s.engine, [], last_arrival=last) for s in setups]
    est = output_estimates(work)
    routed: list[list[_Routed]] = [[] for _ in models]
    counts = [0] * len(models)
    route_us: list[float] = []
    for job in work:
        for r in runs:
            r.run_until(job.arrival)
        req = route_request(job, est)
        t0 = time.perf_counter()
        i = rt.route(req, front_end_backlog(job.arrival, rspeeds, routed))
        route_us.append((time.perf_counter() - t0) * 1e6)
        runs[i].add_job(job)
        routed[i].append(_Routed(job, req, runs[i].states[-1], i))
        counts[i] += 1
    records: list[dict] = []
    frames: list[float] = []
    end = work[0].arrival if work else 0.0
    for r in runs:
        out = r.run()
        records += out["jobs"]
        frames += out["frame_ms"]
        if out["jobs"]:
            end = max(end, out["makespan"])
    span = (work[-1].arrival - work[0].arrival) if len(work) > 1 else 1.0
    summary = summarize(records, span, end - (work[0].arrival if work else 0.0), frames)
    return ReplicaRun(router, policy, counts, summary, route_us)


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
