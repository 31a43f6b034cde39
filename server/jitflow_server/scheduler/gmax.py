"""GMAX: Grouped Margin Goodput Maximization (JITServe §4.2, Algorithm 1).

One frame, for N queued/running requests and batch size B:

1. per request (compound: per stage group) estimate the remaining length ``len_rem``, the
   generation time ``t_gen = len_rem·v_token (+ prefill)``, the time left ``t_rem``, the achievable
   goodput (0 if the SLO cannot be met even alone: App. C's filter ``t_rem − t_gen ≥ 0``), and
   ``priority = (goodput + δ·frames_waited·R) / t_gen`` (§4.2 "margin goodput per unit bandwidth");
2. optional fairness blend ``(1−f)·priority + f·Fair(r)`` (§4.3);
3. cutoff filter ``priority ≥ p·priority(B-th)``, sort by input length, slide a window of B, keep
   the window with the largest summed priority (Alg. 1 lines 16-26);
4. cost-aware preemption: a running request displaced by a waiting one is preempted only when the
   projected gain exceeds ``stall_duration × token_generation_speed`` (§4.2 "Preemption to correct
   scheduling errors"), else it keeps its slot;
5. admission by the KV cache (ours, ``kv_fit``): a waiting request whose whole prompt the KV cache
   cannot hold beside the running requests waits (:func:`~jitflow_server.scheduler.kv_fit.fit_kv`).

Step 1 lives in :mod:`~jitflow_server.scheduler.gmax_estimates` (:func:`estimate`), the parameters in
:mod:`~jitflow_server.scheduler.gmax_params` (:class:`GMAXParams`); this module holds the priority
(:meth:`GMAXPolicy.score`), the window (:func:`select_window`), the preemption pricing
(:func:`recompute_tokens`, ``GMAXPolicy._preemption``) and the frame itself (:meth:`GMAXPolicy.schedule`).

Everything is numpy-vectorised; the only Python loops are over the snapshot (column extraction)
and over the ≤ B displaced requests. Complexity O(N log N).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from jitflow_server.scheduler.adapt import CutoffAdapter
from jitflow_server.scheduler.gmax_estimates import Estimates, estimate_speeds, fill_nan
from jitflow_server.scheduler.gmax_params import GMAXParams
from jitflow_server.scheduler.kv_fit import fit_kv, kv_demand
from jitflow_server.scheduler.snapshot import (
    LATENCY,
    Snapshot,
    SnapshotCache,
    build_snapshot,
    validate_context,
)
from jitflow_server.scheduler.types import Decision, RequestView, SchedContext, TokenTimeModel

#: Batch sizes GMAX's ``batch_sizing`` tries besides B (when N > B), as fractions of B; with N ≤ B
#: (``"slo"`` only), N and the same fractions of N.
BATCH_FRACTIONS = (0.875, 0.75, 0.625, 0.5, 0.375, 0.25)


def latency_slo_broken(snap: Snapshot, model: TokenTimeModel) -> bool:
    """True when running all ``snap.n`` requests together would put a latency request past its TBT SLO:
    ``model.token_time(N)`` (s per token at batch N) above the smallest ``tbt`` (s) of the snapshot's
    latency requests. GMAX's ``batch_sizing="slo"`` sizes a frame of N ≤ B requests only then."""
    lat = snap.kind == LATENCY
    return bool(lat.any()) and model.token_time(snap.n) > float(np.nanmin(snap.tbt[lat]))


def default_fair(snap: Snapshot, ctx: SchedContext) -> np.ndarray:
    """Fair(r) in [0, 1]: ``1 − attained/max(attained)`` (least attained service first; VTC-like, §4.3)."""
    m = float(snap.attained.max()) if snap.n else 0.0
    return np.ones(snap.n) if m <= 0 else 1.0 - snap.attained / m


def recompute_tokens(kv_tokens: float, evict_risk: float, block_size: int | None) -> float:
    """Tokens a displaced request is expected to recompute when it resumes (vLLM recompute
    preemption with automatic prefix caching).

    A prefix-cache hit covers only whole ``block_size`` blocks within the first ``kv_tokens − 1``
    tokens (vLLM's ``find_longest_cache_hit``), so the tail past them is always recomputed, and the
    cached part only with probability ``evict_risk``. ``block_size=None`` (unknown, or
    ``GMAXParams.block_pricing=False``) discounts all of it. Units: tokens.
    """
    if evict_risk >= 1.0 or not block_size:
        return kv_tokens * evict_risk
    whole = float(int(max(kv_tokens - 1.0, 0.0) // block_size) * block_size)
    return (kv_tokens - whole) + whole * evict_risk


def select_window(prio: np.ndarray, input_len: np.ndarray, batch_size: int, p: float,
                  protect: bool = False) -> tuple[np.ndarray, dict]:
    """GMAX batch composition (JITServe §4.2, Alg. 1 lines 16-26).

    ``bp`` = B-th highest priority; candidates = ``priority ≥ p·bp``; candidates sorted by input
    length (ties: higher priority first); the contiguous window of B candidates with the largest
    summed priority is returned (indices into ``prio``, in priority-descending order) with an info
    dict (``bp``, ``n_candidates``, ``window_score``, ``protected``). If N ≤ B all requests are returned.

    ``protect=True`` (our extension, ``GMAXParams.window="protected"``): the candidates with
    ``priority ≥ bp/p`` are kept outright (at most B, highest first) and the window of the remaining
    ``B − kept`` slots slides over the other candidates only. The published rule maximises the
    window's *sum*, so one very high priority with a long input can pull the window onto long inputs
    and leave out every urgent short request (seen on the real engine: waiting compound calls at
    40× the B-th priority rejected by admission control). With ``p = 1`` both rules are top-B.
    O(N) selection + O(M log M) sort of the M candidates.
    """
    n = prio.shape[0]
    b = batch_size
    if n <= b:
        idx = (-prio).argsort(kind="stable")
        return idx, {"bp": float(prio.min()) if n else 0.0, "n_candidates": n, "window_score": float(prio.sum()),
                     "protected": n}
    bp = float(np.partition(prio, n - b)[n - b])
    in_cand = prio >= p * bp
    cand = in_cand.nonzero()[0]
    n_cand = int(cand.size)
    kept = np.zeros(0, np.int64)
    if protect and bp > 0:
        kept = cand[prio[cand] >= bp / p]
        if kept.size > b:
            kept = kept[(-prio[kept]).argsort(kind="stable")[:b]]
        in_cand[kept] = False  # the other candidates, ascending (np.setdiff1d cost 60 µs a frame)
        cand = in_cand.nonzero()[0]
    n_protected = int(kept.size)
    w = b - kept.size
    score = float(prio[kept].sum())
    if w > 0 and cand.size:
        w = min(w, cand.size)
        order = cand[np.lexsort((-prio[cand], input_len[cand]))]
        cs = np.concatenate(([0.0], prio[order].cumsum()))
        sums = cs[w:] - cs[:-w]
        k = int(sums.argmax())
        kept = np.concatenate((kept, order[k : k + w]))
        score += float(sums[k])
    win = kept[(-prio[kept]).argsort(kind="stable")]
    return win, {"bp": bp, "n_candidates": n_cand, "window_score": score, "protected": n_protected}


class GMAXPolicy:
    """The GMAX policy (JITServe §4.2-4.3) behind the :class:`~jitflow_server.scheduler.types.Policy` interface.

    ``schedule(views, ctx)`` returns a :class:`Decision` with ≤ ``ctx.batch_size`` ids.
    Stateful: it remembers when each request was last served (for the δ boost), the frame
    boundary (``needs_recompute``), the cutoff adapter (``on_finished``), and a snapshot cache.
    Raises :class:`~jitflow_server.scheduler.snapshot.SchedulingInputError` (a ``ValueError``) on
    malformed views/contexts and ``ValueError`` on invalid parameters.
    """

    def __init__(self, params: GMAXParams | None = None, name: str = "gmax", **overrides: object) -> None:
        prm = params or GMAXParams()
        for k, val in overrides.items():
            if not hasattr(prm, k):
                valid = ", ".join(sorted(GMAXParams.__dataclass_fields__))
                raise ValueError(f"unknown GMAX parameter {k!r}; valid: {valid}")
            setattr(prm, k, val)
        prm.validate()
        self.params = prm
        self.name = name
        self.adapter = CutoffAdapter(
            prm.p, prm.p_step, min(prm.p_min, prm.p), max(prm.p_max, prm.p), prm.adapt_epoch, prm.adapt_p
        )
        self.frame_id = 0
        self._prev_batch: list[str] = []
        self._prev_now: float | None = None
        self._last_step: int | None = None
        self._cache = SnapshotCache(need_attained=prm.fairness > 0, need_admit_by=prm.jit)
        self.last_estimates: Estimates | None = None
        self._gaps: deque[float] = deque(maxlen=32)  # seconds between consecutive frames (JIT horizon)

    # ---- Policy protocol -------------------------------------------------------------------
    @property
    def reads_attained_service(self) -> bool:
        """True when frames read ``RequestView.attained_service`` (the fairness blend, ``fairness > 0``)."""
        return self._cache.need_attained

    @property
    def paces_prefill(self) -> bool:
        """True when engines should cap each step's prefill tokens by the slack of decoding latency requests
        (``prefill_budget="slack"``, :func:`~jitflow_server.scheduler.prefill_budget.prefill_token_budget`)."""
        return self.params.prefill_budget == "slack"

    @property
    def prefill_ttft_share(self) -> float:
        """Share of the smallest TTFT SLO (s) no paced engine step may exceed (0: no such cap;
        ``GMAXParams.prefill_ttft_share``)."""
        return self.params.prefill_ttft_share

    def needs_recompute(self, step: int, arrivals_or_finishes: bool) -> bool:
        """True on arrivals/finishes or once Δ decode steps passed since the last frame (§4.2).

        Calling it with a True result marks ``step`` as the start of the new frame.
        """
        if arrivals_or_finishes or self._last_step is None or step - self._last_step >= self.params.delta_steps:
            self._last_step = step
            return True
        return False

    def on_finished(self, req_id: str, goodput: float, now: float) -> None:
        """Record a finished request's measured goodput (tokens) at ``now`` (s) for the cutoff-p adaptation."""
        self.adapter.record(goodput, now)

    def invalidate(self, req_id: str) -> None:
        """Re-read ``req_id``'s static fields (kind, arrival, input_len, ttft, tbt, deadline, true_len,
        task/stage) at the next frame; call it when the engine changes one of them mid-request."""
        self._cache.invalidate(req_id)

    @property
    def p(self) -> float:
        """Cutoff p in use for the next frame."""
        return self.adapter.current

    # ---- scoring -----------------------------------------------------------------------------
    def score(
        self, snap: Snapshot, ctx: SchedContext, last_served: np.ndarray | None = None
    ) -> tuple[np.ndarray, Estimates]:
        """Priorities (array of N, goodput tokens per second of bandwidth) and the estimates.

        ``priority = (goodput + δ·w·R) / t_gen`` where w = frames waited since last served
        (``(now − last_served)/(Δ·v_token)``; ``last_served`` is an array of N times, NaN or
        ``None`` meaning never served, counted from arrival) and R the base goodput;
        stage-group members share the group's value (w = the group's longest wait). Infeasible
        requests have goodput 0 and keep only a tiny density term ``1e-6·R/t_gen`` plus the δ boost
        (demoted to the best-effort class). In JIT mode the goodput term is
        ``marginal + jit_fill·goodput``. Then the optional fairness blend (§4.3).
        """
        prio, est = self.score_speeds(snap, [ctx], last_served)
        return prio[0], est.row(0)

    def score_speeds(
        self, snap: Snapshot, ctxs: Sequence[SchedContext], last_served: np.ndarray | None = None
    ) -> tuple[np.ndarray, Estimates]:
        """:meth:`score` under K contexts at once (one per candidate batch size: the same ``now`` and
        prefill rate, each its own ``batch_size`` and ``token_time``): priorities (K, N) and (K, N)
        estimates (:func:`~jitflow_server.scheduler.gmax_estimates.estimate_speeds`). Row r equals
        ``score(snap, ctxs[r], last_served)``."""
        prm = self.params
        ctx = ctxs[0]
        v = np.array([c.token_time for c in ctxs], float)
        est = estimate_speeds(snap, ctx, prm, v, self.horizons_s(v) if prm.jit else None)
        n = snap.n
        frame_s = (prm.delta_steps * v)[:, None]
        last = snap.arrival if last_served is None else np.fmax(last_served, snap.arrival)
        wait_s = np.maximum(ctx.now - last, 0.0)
        sg = snap.stage_groups
        if sg is not None:  # the group's longest wait (max commutes with dividing by the frame length)
            wait_s[sg.members] = sg.max(wait_s[sg.members])[sg.group]
        waited = wait_s / frame_s
        gain = est.goodput if est.marginal is None else est.marginal + prm.jit_fill * est.goodput
        num = gain + (prm.starvation_delta * waited + 1e-6) * est.base
        prio = num / np.maximum(est.t_gen, 1e-9)
        if prm.fairness > 0 and n:
            for r, c in enumerate(ctxs):
                fair = (prm.fair_fn or default_fair)(snap, c)
                scale = float(prio[r].max()) or 1.0
                prio[r] = ((1.0 - prm.fairness) * prio[r] / scale + prm.fairness * np.asarray(fair, float)) * scale
        return prio, est

    def horizon_s(self, ctx: SchedContext) -> float:
        """JIT look-ahead in seconds: ``jit_horizon × min(Δ·v_token, longest of the last 32 gaps
        between frames)``. Frames are recomputed on arrivals and finishes too, so a deferred request
        is reconsidered long before Δ steps pass on a busy engine; looking a whole Δ ahead would make
        every request "urgent" when Δ·v_token exceeds the SLOs (e.g. 50 steps of 0.1 s on a CPU)."""
        return float(self.horizons_s(np.array([ctx.token_time], float))[0])

    def horizons_s(self, token_times: np.ndarray) -> np.ndarray:
        """:meth:`horizon_s` for each of the (K,) ``token_times`` (s per token): (K,) seconds."""
        frame_s = self.params.delta_steps * token_times
        gap = max(self._gaps) if self._gaps else None
        return self.params.jit_horizon * (frame_s if gap is None else np.minimum(frame_s, gap))

    def priorities(self, views: Sequence[RequestView], ctx: SchedContext) -> np.ndarray:
        """Priorities of ``views`` under ``ctx`` without deciding (no state change); used by power-of-K."""
        validate_context(ctx)
        return self.score(build_snapshot(views), ctx)[0]

    # ---- one frame ---------------------------------------------------------------------------
    def schedule(self, views: Sequence[RequestView], ctx: SchedContext) -> Decision:
        """Run one GMAX frame (JITServe Alg. 1 + cost-aware preemption); see the module docstring."""
        validate_context(ctx)
        self.frame_id += 1
        if self._prev_now is not None and ctx.now > self._prev_now:
            self._gaps.append(ctx.now - self._prev_now)
        snap = self._cache.build(views)
        n, b = snap.n, ctx.batch_size
        if n == 0:
            return Decision([], [], {}, self.frame_id, {"p": self.p})
        clock = self.params.starvation_clock
        if clock == "waiting":
            # cache.served holds, per request, the seconds it has been in a batch so far; δ's clock is
            # then the time spent *not* served: (now − arrival − served) / frame.
            acc = self._cache.served
            if self._prev_batch and self._prev_now is not None:
                rows = self._cache.rows_of(self._prev_batch)
                if rows.size:
                    acc[rows] = fill_nan(acc[rows], 0.0) + max(ctx.now - self._prev_now, 0.0)
            served = snap.arrival + fill_nan(acc[snap.rows], 0.0)
        else:
            served = self._cache.served[snap.rows] if clock == "served" else None
        ctx, prio, est = self._sized(snap, ctx, served)
        b = ctx.batch_size
        self.last_estimates = est
        p = self.p
        win, info = select_window(prio, snap.input_len, b, p, protect=self.params.window == "protected")
        in_batch = np.zeros(n, bool)
        in_batch[win] = True
        # each request's KV by the end of the frame, for the preemption test and the KV cache's admission
        demand = (kv_demand(snap, est.len_rem, self.params.delta_steps) if ctx.kv_capacity_tokens is not None
                  else None)
        preempt_idx, swapped = self._preemption(snap, ctx, prio, est, in_batch, demand)
        kv_left = (fit_kv(snap, demand, prio, in_batch, ctx.kv_capacity_tokens, preempt_idx)
                   if self.params.kv_fit and ctx.kv_capacity_tokens else [])
        batch_idx = in_batch.nonzero()[0]
        batch_idx = batch_idx[(-prio[batch_idx]).argsort(kind="stable")]
        ids = snap.ids
        batch = [ids[i] for i in batch_idx]
        if clock == "served":
            self._cache.served[snap.rows[batch_idx]] = ctx.now
        self._prev_batch, self._prev_now = batch, ctx.now
        info.update(
            p=p,
            n=n,
            demoted=int(n - est.feasible.sum()),
            swapped_back=swapped,
            frame_s=self.params.delta_steps * ctx.token_time,
            batch_size=b,
            kv_left=len(kv_left),
        )
        if self.params.full_priorities:
            pr = dict(zip(ids, prio.tolist(), strict=True))
        else:
            shown = ((prio >= p * info["bp"]) | snap.running | in_batch).nonzero()[0]
            pr = dict(zip([ids[i] for i in shown], prio[shown].tolist(), strict=True))
        return Decision(batch, [ids[i] for i in preempt_idx], pr, self.frame_id, info)

    def _sized(self, snap: Snapshot, ctx: SchedContext,
               served: np.ndarray | None) -> tuple[SchedContext, np.ndarray, Estimates]:
        """The batch size of this frame with its context, priorities and estimates (``batch_sizing``).

        ``"full"`` (JITServe as published): B. ``"goodput"`` (ours): each candidate size k (B and
        fractions of it, see :data:`BATCH_FRACTIONS`) is scored at its own token time
        ``ctx.token_time_model.token_time(k)``, and k is the size whose top-k requests (by priority
        at that speed) earn the most goodput per second, ``Σ goodput_i / t_gen_i``; a smaller k must
        beat the larger one by ``batch_margin``. A request whose SLO a bigger batch would break earns
        nothing at that size, so the batch shrinks only when the requests it keeps on time are worth
        more than the throughput it gives up (e.g. chat TBT SLOs under the full-batch step time of a
        CPU). Without a token-time model it is B, and with N ≤ B requests every one of them runs: the
        batch shrinks only when more requests want to run than B slots hold. (Sizing below N at moderate
        load left out the requests the estimates judged infeasible, started deadline requests included,
        and they waited until their clients gave up although stock vLLM served them on time: 4 of 9
        deadline requests missed at 0.7× capacity on the real engine.) ``"slo"``: as ``"goodput"``, and
        with N ≤ B the sizes are N and fractions of it, scored the same way, but only in a frame where
        running all N would put a latency request past its TBT SLO (:func:`latency_slo_broken`); at a
        load where the whole batch keeps every TBT, every request runs as with ``"goodput"``.
        """
        model, b, mode = ctx.token_time_model, ctx.batch_size, self.params.batch_sizing
        if (mode == "full" or model is None or model.per_request_s <= 0
                or (snap.n <= b and (mode == "goodput" or not latency_slo_broken(snap, model)))):
            prio, est = self.score(snap, ctx, served)
            return ctx, prio, est
        top = min(b, snap.n)  # with N <= B ("slo" only), the sizes are N and fractions of it
        sizes = sorted({top, *(k for f in BATCH_FRACTIONS if 1 <= (k := round(top * f)) < top)}, reverse=True)
        # every size scored in one vectorised pass: 3.5x less frame time than one pass per size, same result
        ctxs = [ctx.resized(k, model.token_time(k)) for k in sizes]
        prios, ests = self.score_speeds(snap, ctxs, served)
        rates = ests.goodput / np.maximum(ests.t_gen, 1e-9)
        best_r, best_rate = 0, -np.inf
        for r, k in enumerate(sizes):
            idx = (-prios[r]).argpartition(k - 1)[:k] if k < snap.n else np.arange(snap.n)
            rate = float(rates[r, idx].sum())
            if r == 0 or rate > best_rate * (1.0 + self.params.batch_margin):
                best_r, best_rate = r, rate
        if best_r == 0 and snap.n <= b:  # every request runs: the frame of the unsized path, unchanged
            prio, est = self.score(snap, ctx, served)
            return ctx, prio, est
        return ctxs[best_r], prios[best_r], ests.row(best_r)

    def _preemption(
        self, snap: Snapshot, ctx: SchedContext, prio: np.ndarray, est: Estimates, in_batch: np.ndarray,
        demand: np.ndarray | None,
    ) -> tuple[list[int], int]:
        """Cost-aware preemption (JITServe §4.2; App. E.2 eq. 9). Mutates ``in_batch``.

        Displaced = running requests outside the window; admitted = waiting requests inside it.
        Pair the strongest displaced with the weakest admitted: the swap stands only if
        ``(prio_new − prio_old)·frame_s > stall·speed`` and
        ``prio_new > (1+margin)·prio_old``, where ``stall = kv_tokens/(swap_rate or prefill_rate)``
        (times the eviction risk when the engine has a prefix cache, see ``GMAXParams.evict_frames``)
        (0 when the KV of all running requests plus the batch's frame demand fits
        ``kv_capacity_tokens``, because then the displaced request is only paused, unless it is one of
        the weakest displaced requests that do not fit ``ctx.max_running`` slots: those are preempted). Otherwise the
        displaced request takes the admitted one's slot back. ``speed`` is the goodput the rest of the
        batch earns per second (``Σ goodput/t_gen`` over the batch without the admitted request;
        ``stall_value="goodput"``) or, as the paper words it, the batch's token generation speed
        ``|batch|/v_token`` (``stall_value="tokens"``). ``demand``: each request's KV by the end of the frame
        (:func:`~jitflow_server.scheduler.kv_fit.kv_demand`; None when the KV cache's size is unknown).
        Returns (indices to preempt, swaps undone).
        """
        prm = self.params
        displaced = (snap.running & ~in_batch).nonzero()[0]
        if displaced.size == 0:
            return [], 0
        admitted = (~snap.running & in_batch).nonzero()[0]
        displaced = displaced[(-prio[displaced]).argsort(kind="stable")]
        admitted = admitted[prio[admitted].argsort(kind="stable")].tolist()
        frame_s = prm.delta_steps * ctx.token_time
        n_batch = int(in_batch.sum())
        speed = max(n_batch, 1) / ctx.token_time  # tokens/s the whole batch generates (lost during a stall)
        by_goodput = prm.stall_value == "goodput"
        if by_goodput:
            grate = est.goodput / np.maximum(est.t_gen, 1e-9)  # goodput tokens/s each request earns when served
            batch_rate = float(grate[in_batch].sum())
        rate = ctx.swap_rate or ctx.prefill_rate
        fits = False
        evict_risk = 1.0  # share of a displaced request's KV to recompute when it comes back
        if ctx.kv_capacity_tokens is not None:
            held = float(snap.kv_tokens[snap.running].sum())
            new = float(np.maximum(demand[in_batch] - snap.kv_tokens[in_batch], 0.0).sum())
            fits = held + new <= ctx.kv_capacity_tokens
            if fits and ctx.prefix_caching and not ctx.swap_rate:
                # freed blocks stay cached until the free queue turns over: with this frame's demand
                # `new` against `free` spare tokens, about new/free of them is reused per frame
                free = ctx.kv_capacity_tokens - held - new
                evict_risk = min(1.0, prm.evict_frames * new / max(free, 1.0))
        swapped = 0
        free_slots = ctx.batch_size - n_batch
        keep: list[int] = []
        n_running = int(snap.running.sum())
        # paused requests keep a slot: beyond max_running the weakest displaced ones must be freed
        overflow = 0 if ctx.max_running is None else max(0, n_running + len(admitted) - ctx.max_running)
        must_free = set(displaced[displaced.size - overflow:].tolist()) if overflow else set()
        # the pairing loop reads single values: Python floats (same IEEE arithmetic as numpy's scalars,
        # a tenth of the cost per read)
        prio_of, kv_of, kind_of = prio.tolist(), snap.kv_tokens.tolist(), snap.kind.tolist()
        grate_of = grate.tolist() if by_goodput else None
        block = ctx.kv_block_size if prm.block_pricing else None
        for d in displaced.tolist():
            if not prm.preemption:
                break
            if free_slots > 0:  # room left in the batch (N ≤ B corner): keep it running
                in_batch[d] = True
                free_slots -= 1
                keep.append(d)
                continue
            if not admitted:
                break
            a = admitted[0]
            # a pause keeps the displaced request's KV: free for all (free_pause) or for a latency request
            # that outranks it latency_pause_ratio times (GMAXParams.latency_pause_ratio)
            paused = fits and d not in must_free and (prm.free_pause or (
                prm.latency_pause_ratio > 0 and kind_of[a] == LATENCY
                and prio_of[a] >= prm.latency_pause_ratio * prio_of[d]))
            stall = 0.0 if paused else recompute_tokens(kv_of[d], evict_risk, block) / rate
            gain = (prio_of[a] - prio_of[d]) * frame_s
            loss = stall * (batch_rate - grate_of[a] if by_goodput else speed)
            if gain > loss and prio_of[a] > (1.0 + prm.preempt_margin) * prio_of[d]:
                continue  # swap stands
            admitted.pop(0)
            in_batch[a] = False
            in_batch[d] = True
            keep.append(d)
            swapped += 1
        kept = set(keep)
        if fits:
            if ctx.max_running is None:
                return [], swapped
            # free only the weakest paused requests that do not fit the engine's slots
            over = n_running + int((~snap.running & in_batch).sum()) - ctx.max_running
            if over <= 0:
                return [], swapped
            return [int(d) for d in displaced[::-1] if d not in kept][:over], swapped
        return [int(d) for d in displaced if d not in kept], swapped
