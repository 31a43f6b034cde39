"""Baseline policies behind the same interface as GMAX (JITServe §6.1 baselines; DESIGN.md §5).

Each baseline ranks the requests by one key (smaller = served first, ties by arrival then id
order) and runs the first B:

- ``fcfs``: vLLM's default: running requests keep their slots (non-preemptive), then waiting
  requests in arrival order.
- ``sarathi``: the same order as fcfs; the engine runs it with chunked prefill (Sarathi-Serve).
- ``edf``: earliest effective deadline first (preemptive).
- ``sjf``: shortest predicted remaining output ``len_bound − generated`` first (LTR-like, preemptive).
- ``las``: least attained service first at program level (Autellix PLAS): the service of all calls
  of a task is summed (preemptive).

Preemptive baselines preempt every running request pushed out of the batch unless the context
says the KV cache has room for it (then it is only paused). ``Decision.priorities`` holds
``−key`` so that larger is more urgent, as for GMAX (for the first 2B in order and the running
requests; every request with ``full_priorities=True``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jitflow_server.scheduler.snapshot import (
    BEST_EFFORT,
    COMPOUND,
    DEADLINE,
    LATENCY,
    Snapshot,
    SnapshotCache,
    validate_context,
)
from jitflow_server.scheduler.types import Decision, RequestView, SchedContext


class OrderPolicy:
    """Base of the key-ordered baselines. Subclasses implement :meth:`keys`.

    ``preemptive=False`` keeps running requests ahead of all waiting ones (vLLM FCFS).
    ``best_effort_deadline`` (s after arrival) is the default deadline used by ``edf`` for requests
    without one. ``needs_recompute`` uses frames of ``delta_steps`` decode steps like GMAX.
    """

    name = "order"
    preemptive = True

    def __init__(self, best_effort_deadline: float = 60.0, delta_steps: int = 1, default_ttft: float = 2.0,
                 default_tbt: float = 0.1, full_priorities: bool = False) -> None:
        if best_effort_deadline <= 0 or delta_steps < 1:
            raise ValueError("best_effort_deadline must be > 0 s and delta_steps >= 1")
        self.best_effort_deadline = best_effort_deadline
        self.delta_steps = delta_steps
        self.default_ttft, self.default_tbt = default_ttft, default_tbt
        self.full_priorities = full_priorities
        self.frame_id = 0
        self._last_step: int | None = None
        self._cache = SnapshotCache(need_attained=self.name == "las")

    def keys(self, snap: Snapshot, ctx: SchedContext) -> np.ndarray:
        """Sort key per request (smaller = first). Array of N floats."""
        raise NotImplementedError

    def needs_recompute(self, step: int, arrivals_or_finishes: bool) -> bool:
        """True on arrivals/finishes or every ``delta_steps`` decode steps (default: every step)."""
        if arrivals_or_finishes or self._last_step is None or step - self._last_step >= self.delta_steps:
            self._last_step = step
            return True
        return False

    def on_finished(self, req_id: str, goodput: float, now: float) -> None:
        """Baselines ignore goodput feedback."""

    def invalidate(self, req_id: str) -> None:
        """Re-read ``req_id``'s static fields (kind, arrival, input_len, ttft, tbt, deadline, true_len,
        task/stage) at the next frame; call it when the engine changes one of them mid-request."""
        self._cache.invalidate(req_id)

    def schedule(self, views: Sequence[RequestView], ctx: SchedContext) -> Decision:
        """Rank by :meth:`keys`, run the first ``ctx.batch_size``; see the module docstring."""
        validate_context(ctx)
        self.frame_id += 1
        snap = self._cache.build(views)
        if snap.n == 0:
            return Decision([], [], {}, self.frame_id)
        key = np.asarray(self.keys(snap, ctx), float)
        primary = key if self.preemptive else np.where(snap.running, -np.inf, key)
        order = np.lexsort((np.arange(snap.n), snap.arrival, primary))
        chosen = order[: ctx.batch_size]
        in_batch = np.zeros(snap.n, bool)
        in_batch[chosen] = True
        displaced = np.flatnonzero(snap.running & ~in_batch)
        preempt: list[str] = []
        if self.preemptive and displaced.size:
            fits = False
            if ctx.kv_capacity_tokens is not None:
                held = float(snap.kv_tokens[snap.running].sum())
                new = float(np.maximum(snap.input_len + snap.generated - snap.kv_tokens, 0.0)[in_batch].sum())
                fits = held + new <= ctx.kv_capacity_tokens
            if not fits:
                preempt = [snap.ids[i] for i in displaced]
        ids = snap.ids
        shown = np.arange(snap.n) if self.full_priorities else np.union1d(order[: 2 * ctx.batch_size],
                                                                           np.flatnonzero(snap.running))
        pr = dict(zip([ids[i] for i in shown], (-key[shown]).tolist(), strict=True))
        return Decision([ids[i] for i in chosen], preempt, pr, self.frame_id, {"n": snap.n})


class FCFSPolicy(OrderPolicy):
    """First come, first served (vLLM default): key = arrival time (s); running requests keep their slots."""

    name = "fcfs"
    preemptive = False

    def keys(self, snap: Snapshot, ctx: SchedContext) -> np.ndarray:
        """Arrival time (s)."""
        return snap.arrival


class SarathiPolicy(FCFSPolicy):
    """Sarathi-Serve: FCFS order; the engine executes it with chunked prefill (stall-free batching)."""

    name = "sarathi"


class EDFPolicy(OrderPolicy):
    """Earliest deadline first. Effective deadline (absolute s): deadline requests: ``deadline``;
    compound calls: ``sub_deadline`` else the task ``deadline``; latency requests: the due time of
    the next token ``arrival + ttft + generated·tbt``; best-effort (or missing): ``arrival + best_effort_deadline``.
    """

    name = "edf"

    def keys(self, snap: Snapshot, ctx: SchedContext) -> np.ndarray:
        """Effective absolute deadline (s) per request."""
        default = snap.arrival + self.best_effort_deadline
        ttft = np.where(np.isnan(snap.ttft), self.default_ttft, snap.ttft)
        tbt = np.where(np.isnan(snap.tbt), self.default_tbt, snap.tbt)
        lat_due = snap.arrival + ttft + snap.generated * tbt
        comp_due = np.where(np.isnan(snap.sub_deadline), snap.deadline, snap.sub_deadline)
        k = snap.kind
        key = np.select(
            [k == LATENCY, k == DEADLINE, k == COMPOUND, k == BEST_EFFORT],
            [lat_due, snap.deadline, comp_due, snap.deadline],
            default,
        )
        return np.where(np.isnan(key), default, key)


class SJFPolicy(OrderPolicy):
    """Shortest job first on the *predicted* remaining output length ``max(len_bound − generated, 1)``
    tokens (LTR-like; the analyzer's bound is the prediction)."""

    name = "sjf"

    def keys(self, snap: Snapshot, ctx: SchedContext) -> np.ndarray:
        """Predicted remaining output tokens."""
        return np.maximum(snap.len_bound - snap.generated, 1.0)


class LASPolicy(OrderPolicy):
    """Program-level least attained service (Autellix PLAS): key = tokens served to the request's
    task so far, ``max(max_task attained_service, Σ_task generated)`` over the live calls of the task
    (a request without task: ``max(attained_service, generated)``)."""

    name = "las"

    def keys(self, snap: Snapshot, ctx: SchedContext) -> np.ndarray:
        """Attained service (tokens) of each request's program."""
        own = np.maximum(snap.attained, snap.generated)
        t = snap.task_index
        has = t >= 0
        if not has.any():
            return own
        nt = int(t.max()) + 1
        gen_sum = np.bincount(t[has], snap.generated[has], minlength=nt)
        att_max = np.zeros(nt)
        np.maximum.at(att_max, t[has], snap.attained[has])
        task_val = np.maximum(gen_sum, att_max)
        return np.where(has, task_val[np.where(has, t, 0)], own)
