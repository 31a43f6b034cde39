"""Baseline policies behind the same interface as GMAX (JITServe §6.1 baselines).

Each baseline ranks the requests by one key (smaller = served first, ties by arrival then
position in ``views``) and runs the first B:

- ``fcfs``: vLLM's default: running requests keep their slots (non-preemptive), then waiting
  requests in arrival order.
- ``sarathi``: the same order as fcfs; the engine runs it with chunked prefill (Sarathi-Serve).
- ``edf``: earliest effective deadline first (preemptive).
- ``sjf``: shortest predicted remaining output ``len_bound − generated`` first (LTR-like, preemptive).
- ``las``: least attained service first at program level (Autellix §4.2 PLAS): the service of all
  calls of a task is summed and discretised into geometric multi-level feedback queues, FCFS within
  a queue, with anti-starvation promotion (preemptive; ``mlfq=False``: the continuous key).

Preemptive baselines preempt every running request pushed out of the batch unless the context
says the KV cache has room for it (then it is only paused). ``Decision.priorities`` holds
``−key`` so that larger is more urgent, as for GMAX (for the first 2B in order and the running
requests; every request with ``full_priorities=True``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jitflow_server.scheduler.frames import FramedPolicy, frame_order
from jitflow_server.scheduler.snapshot import (
    BEST_EFFORT,
    COMPOUND,
    DEADLINE,
    LATENCY,
    Snapshot,
    SnapshotCache,
)
from jitflow_server.scheduler.types import Decision, RequestView, SchedContext


class OrderPolicy(FramedPolicy):
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

    def schedule(self, views: Sequence[RequestView], ctx: SchedContext) -> Decision:
        """Rank by :meth:`keys`, run the first ``ctx.batch_size``; see the module docstring."""
        snap = self.begin_frame(views, ctx)
        if snap is None:
            return Decision([], [], {}, self.frame_id)
        key = np.asarray(self.keys(snap, ctx), float)
        primary = key if self.preemptive else np.where(snap.running, -np.inf, key)
        order = frame_order(snap.n, primary, snap.arrival)
        chosen = order[: ctx.batch_size]
        in_batch = np.zeros(snap.n, bool)
        in_batch[chosen] = True
        displaced = np.flatnonzero(snap.running & ~in_batch)
        preempt: list[str] = []
        if self.preemptive and displaced.size and not self.kv_fits(snap, in_batch, ctx):
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
    """Program-level least attained service as a multi-level feedback queue (Autellix §4.2 PLAS).

    *Program service* ``S`` (tokens) of a request: the tokens served to its task so far,
    ``max(max_task attained_service, Σ_task generated)`` over the live calls of the task (a request
    without task: ``max(attained_service, generated)``).

    With ``mlfq=True`` (default) ``S`` is discretised into ``levels`` = K queues Q_1..Q_K with
    geometric ranges ``[lo_i, hi_i)``: ``hi_1 = quantum``, ``hi_{i+1} = ratio · hi_i``, ``lo_1 = 0``,
    ``lo_{i+1} = hi_i``, Q_K unbounded (defaults: 256, 512, …, 16 384 tokens, then Q_8 = [16 384, ∞)).
    The key is the queue index (0 = Q_1); within a queue calls are served FCFS by arrival (then
    position in ``views``).
    So a running call is preempted only when its program crosses a threshold into a queue behind a
    waiting call, or a call enters a queue ahead of it, not on every token of difference (the
    continuous key re-ranks every step and churns).

    Anti-starvation (Autellix: a call whose waiting-to-service ratio exceeds β moves to Q_1): a call
    in Q_2..Q_K is promoted to Q_1 when ``W ≥ β · T`` with, in seconds,

    - ``W = max(now − t0 − (generated − g0) · token_time, 0)``: the call's time since ``t0`` not
      spent decoding (``ctx.token_time`` s per token per step); ``(t0, g0) = (arrival, 0)``, or the
      time and ``generated`` at which its last promotion ended;
    - ``T = token_time · max(S, quantum)``: its program's service as decode time, at least one Q_1
      quantum (so a call of a program with little service still waits ``β · quantum · token_time``).

    A promotion lasts until the call has generated ``quantum`` more tokens (one Q_1 quantum, like
    an MLFQ priority boost) or leaves; the call then returns to its service queue with its waiting
    clock restarted, so it needs another ``β · T`` of waiting before the next promotion. Promoted
    calls keep their arrival order, so they run ahead of newer Q_1 calls. ``promotions`` counts
    promotions (for diagnostics).

    Deviations from Autellix: the Snapshot carries no per-call waiting/served clocks, so ``W`` and
    ``T`` are derived from token counts × the current ``token_time`` (prefill and queueing before
    the first token count as waiting). The bounded boost is this module's choice of hysteresis:
    promoting while ``W/T ≥ β`` only would demote the call as soon as it runs (``W/T`` falls) and
    preempt it at every crossing; keeping it in Q_1 until it finishes lets one long call block Q_1.

    Parameters (all settable through ``make_policy("las", ...)``; ``ValueError`` on bad values):

    - ``quantum`` (256 tokens, > 0): upper bound of Q_1, about one typical chat reply, so single
      short calls finish in Q_1 FCFS without any preemption;
    - ``levels`` (8, ≥ 1): K; with the defaults the last threshold is 16 384 tokens, beyond which
      long programs are FCFS among themselves (``levels=1``: preemptive FCFS);
    - ``ratio`` (2.0, > 1): geometric growth of the ranges (each queue doubles, as in classic MLFQ);
    - ``starvation_ratio`` β (16.0, > 0; ``inf`` disables): a fresh program's call waits at least
      ``16 · 256 · token_time`` (≈ 60-100 s at 15-25 ms/step) before promotion, beyond the
      seconds-to-tens-of-seconds SLOs of latency and deadline requests: the promotion rescues
      starving programs without overriding the MLFQ order in ordinary queueing (where it would only
      trade one missed SLO for another: in the ``a100-llama8b`` simulation at 4-8 req/s, β = 8 cost
      10-34 % of token goodput against β = ∞ and β = 16 0-15 %, see docs/scheduling.md);
    - ``mlfq`` (True): False restores the continuous key ``S`` (the pre-MLFQ ``las``: preempts on
      every difference in service; ``levels``, ``quantum``, ``ratio``, β unused).

    Other keyword arguments are :class:`OrderPolicy`'s (``delta_steps``, …).
    """

    name = "las"

    def __init__(self, quantum: float = 256.0, levels: int = 8, ratio: float = 2.0,
                 starvation_ratio: float = 16.0, mlfq: bool = True, **kw) -> None:
        super().__init__(**kw)
        if not quantum > 0 or not math.isfinite(quantum):
            raise ValueError(f"quantum must be a finite number of tokens > 0, got {quantum!r}")
        if isinstance(levels, bool) or int(levels) != levels or levels < 1:
            raise ValueError(f"levels must be an integer >= 1, got {levels!r}")
        if not ratio > 1 or not math.isfinite(ratio):
            raise ValueError(f"ratio must be a finite number > 1, got {ratio!r}")
        if not starvation_ratio > 0:
            raise ValueError(f"starvation_ratio must be > 0 (inf: off), got {starvation_ratio!r}")
        self.quantum, self.levels, self.ratio = float(quantum), int(levels), float(ratio)
        self.starvation_ratio, self.mlfq = float(starvation_ratio), bool(mlfq)
        self.bounds = self.quantum * self.ratio ** np.arange(self.levels - 1)  # hi_1..hi_{K-1} (tokens)
        self.promotions = 0
        self._boost: dict[str, float] = {}  # promoted call -> its generated tokens at promotion
        self._clock: dict[str, tuple[float, float]] = {}  # call demoted after a boost -> (s, tokens) then

    @staticmethod
    def program_service(snap: Snapshot) -> np.ndarray:
        """Attained service ``S`` (tokens) of each request's program (array of N floats)."""
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

    def queue_index(self, service: np.ndarray) -> np.ndarray:
        """Queue index (0 = Q_1 … K−1 = Q_K) of program services ``service`` (tokens), ints."""
        return np.searchsorted(self.bounds, service, side="right")

    def keys(self, snap: Snapshot, ctx: SchedContext) -> np.ndarray:
        """Queue index after anti-starvation promotion (``mlfq``), else ``S`` (tokens)."""
        service = self.program_service(snap)
        if not self.mlfq:
            return service
        level = self.queue_index(service)
        n, ids, gen, tt = snap.n, snap.ids, snap.generated, ctx.token_time
        boosted = np.zeros(n, bool)
        t0, g0 = snap.arrival.copy(), np.zeros(n)  # origin of each call's waiting clock (s, tokens)
        boost: dict[str, float] = {}
        clock: dict[str, tuple[float, float]] = {}
        if self._boost or self._clock:  # O(N) only while some call is or was promoted
            pos = dict(zip(ids, range(n), strict=True))
            for rid, (t, g) in self._clock.items():
                k = pos.get(rid)
                if k is not None:
                    clock[rid] = (t, g)
            for rid, g in self._boost.items():
                k = pos.get(rid)
                if k is None:
                    continue
                if gen[k] - g < self.quantum:
                    boost[rid] = g
                    boosted[k] = True
                else:  # its Q_1 quantum is used up: back to its queue, the waiting clock restarts now
                    clock[rid] = (ctx.now, float(gen[k]))
            for rid, (t, g) in clock.items():
                k = pos[rid]
                t0[k], g0[k] = t, g
        wait = np.maximum(ctx.now - t0 - (gen - g0) * tt, 0.0)
        new = (level > 0) & ~boosted & (wait >= self.starvation_ratio * tt * np.maximum(service, self.quantum))
        for k in np.flatnonzero(new).tolist():
            boost[ids[k]] = float(gen[k])
            clock.pop(ids[k], None)
        self.promotions += int(new.sum())
        self._boost, self._clock = boost, clock
        return np.where(boosted | new, 0, level).astype(float)
