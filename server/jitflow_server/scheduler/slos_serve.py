"""``slos-serve``: SLOs-Serve's soft admission control and DP token planning, at frame granularity
(SLOs-Serve, "Optimized Serving of Multi-SLO LLMs", §3.1-§3.2, §4.1, Appendix C).

What SLOs-Serve does (one replica): every invocation it takes the running and the new requests, and
a dynamic program over the requests sorted by *prefill deadline* ``pDDL`` picks the subset of new
requests to admit so that, at every ``pDDL_i``, the prefill token budget left over after the decode
SLOs of the admitted requests covers the cumulative prefill demand (Fig. 5: every request is a line
that needs ``p_i`` prefill tokens by ``pDDL_i``, then decode tokens at its TPOT). The objective is
the number (value) of admitted requests (``pb[i, m, n]``, Appendix C: the maximal prefill budget by
``pDDL_i`` with ``n`` requests accepted); running requests are force-admitted. Declined requests go
to a best-effort tier served with the surplus (§4.1), or are refused.

How this module maps it onto one frame (``delta_steps`` decode steps, ≤ B requests):

*Performance model.* ``d = ctx.token_time`` s per decode step and ``1/ctx.prefill_rate`` s per
prefill token, serialised. A request decoding at one token per ``tpot`` s needs a decode step every
``tpot`` s and one of the B slots of that step, so it uses the engine-time share ``c = d / (B·tpot)``
(the paper's partial batch: decode tokens first, the rest of the batch is prefill budget). With
decode share ``C`` in use, the prefill budget accrues at ``(1 − C)·prefill_rate`` tokens/s
(Eq. 2-3's ``PB*(Δt, n)``).

*The SLO lines of our request kinds* (``p`` = tokens to (re)compute ``input + generated − kv``,
``m`` = remaining output ``max(len_bound − generated, 1)``):

- ``latency``: ``pDDL`` = due time of its next token ``arrival + ttft + generated·tbt`` (the TTFT
  for a new request), ``tpot = tbt``;
- ``deadline`` / ``compound`` (due = ``deadline``; compound calls their ``sub_deadline``, else the
  task deadline): an end-to-end deadline is turned into a TTFT/TPOT pair by splitting its slack
  ``σ = due − now − p/prefill_rate − m·d``: ``pDDL = now + p/prefill_rate + prefill_slack_share·σ``
  and ``tpot = (due − pDDL)/m`` (≥ d). A decoding request (``p = 0``) gets ``tpot = (due − now)/m``;
- ``best_effort``: no SLO; always in the best-effort tier.

*Attainability* (checked alone, every frame, O(N)): a deadline-like request is lost when
``now + p/prefill_rate + m·d > due``; a latency request without a token when its first token cannot
come by ``arrival + ttft``, or (not yet admitted) when ``tbt < d`` (it cannot keep pace).

*DP (admission).* Items: the admitted requests that still need prefill (forced) and up to
``max_candidates`` undecided waiting SLO requests (earliest ``pDDL`` first), sorted by ``pDDL``.
State ``dp[n, u]`` = maximal prefill slack (tokens) at the current ``pDDL`` with ``n`` new requests
accepted whose decode share is ``u`` units of ``1/load_levels`` (shares rounded up, so the DP never
over-admits). Moving from one ``pDDL`` to the next adds ``Δt·prefill_rate·(1 − C0 − Cf − u/U)``
(``C0``: exact share of the admitted decoding requests, ``Cf``: of the forced items passed so far);
accepting a new item needs slack ≥ 0 after paying its ``p``; a forced item is always paid, and
states it pushes below the no-new-admission path (or below 0) are dropped, so new requests never
make an admitted one miss. The answer is the largest ``n`` (ties: most slack), backtracked. A run
of consecutive forced items is applied in one vectorised step, so the Python loop runs over the
≤ ``max_candidates`` new items only; the numpy work is O(K·(K_new + 1)·U) for K items.

*Waiting-time SLO* (``waiting_slo``, not in the paper): the engine rejects a request not started by
``admit_by`` (JITServe §5); that time caps the request's ``pDDL`` (``admit_by + p/prefill_rate``) and
its batch key, as ``qlm`` does, so admitted requests are not lost to the engine's admission control.

*Memory.* SLOs-Serve's memory dimension ``m`` is a post-filter here (``kv_admission``): newly
accepted requests are kept in ``pDDL`` order while the admitted set's
``Σ (input_len + len_bound)`` fits ``kv_capacity_tokens``.

*Soft admission.* Each undecided request is decided once, in the first frame it is a DP candidate
(SLOs-Serve decides on arrival): accepted requests are *admitted* (force-admitted from then on);
declined or unattainable ones are demoted to the best-effort tier (``on_decline="best_effort"``,
the paper's single-replica fallback) or, if never scheduled, refused through ``Decision.reject``
(``on_decline="reject"``; the multi-replica "decline" backup). An admitted request that becomes
unattainable (its deadline can no longer be met, or its first token can no longer be on time) is
demoted the same way; an admitted latency request that already emitted tokens is kept (its later
on-time tokens still count).

*Batch (Algorithm 2 at frame granularity).* Admitted requests by least laxity (latest start
``pDDL − p/prefill_rate − d`` for latency, ``due − m·d − p/prefill_rate`` for deadline-like: the
EDF queue of per-token deadlines), then the best-effort tier by deadline (best-effort kind:
``arrival + best_effort_deadline``; both keys capped by ``admit_by``); the first B run. Undecided requests beyond the candidate window
wait for a later frame. Displaced running requests are paused; when the KV cache cannot hold the
frame, displaced best-effort-tier requests are preempted (§4.1: best effort yields to SLO requests).

Simplified or left out, and why: no speculative decoding (SLO-adaptive speculation, §3.2.3; the
engine has no draft model); no multi-replica routing (§4.2; one engine per policy); no dynamic
batch-size tuning (Algorithm 2 picks the largest batch whose step time meets the tightest TPOT: the
policy sees only ``token_time`` at the current batch, no per-batch-size step model, and the engine
sets chunk sizes from its own token budget); per-TPOT tiers of the DP state are replaced by one
quantised decode share; decode shares last for the whole horizon (finishing requests are not
credited back: conservative); lengths are the analyzer's bound ``len_bound``, not known lengths as
in the paper's evaluation; compound calls are admitted one by one (no stage-group admission).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import repeat

import numpy as np

from jitflow_server.scheduler.frames import frame_order
from jitflow_server.scheduler.peer_common import (
    COMMON_PARAMS,
    PeerPolicy,
    check_bool,
    check_fraction,
    check_int,
)
from jitflow_server.scheduler.snapshot import BEST_EFFORT, LATENCY
from jitflow_server.scheduler.types import Decision, RequestView, SchedContext

ON_DECLINE = ("best_effort", "reject")
_UNDECIDED, _ADMITTED, _BEST_EFFORT = 0, 1, 2  # tier of a request in the policy's memory
_NEG = -math.inf


class SLOsServePolicy(PeerPolicy):
    """SLOs-Serve's DP admission and soft admission control (module docstring).

    Parameters (``ValueError`` on a bad value), besides the common ones of
    :class:`~jitflow_server.scheduler.peer_common.PeerPolicy` (``best_effort_deadline``,
    ``delta_steps``, ``default_ttft``, ``default_tbt``, ``full_priorities``):

    - ``max_candidates`` (64, >= 1): undecided requests offered to the DP per frame (bounds its size);
    - ``load_levels`` (64, >= 1): U, quantisation of the decode share in the DP state;
    - ``prefill_slack_share`` (0.5, in [0, 1]): share of a deadline request's slack given to its
      prefill window (the rest relaxes its TPOT);
    - ``on_decline`` ("best_effort" or "reject"): fate of declined/unattainable requests;
    - ``kv_admission`` (True): admit only while ``Σ (input_len + len_bound)`` of the admitted set fits
      ``kv_capacity_tokens`` (when the context gives it);
    - ``waiting_slo`` (True): treat the engine's admission deadline ``admit_by`` of a never-scheduled
      request as one more SLO: its prefill deadline becomes at most ``admit_by + p/prefill_rate`` and
      its batch key at most ``admit_by`` (as ``qlm`` does; SLOs-Serve has no such deadline).

    Diagnostics: ``admitted``, ``declined`` (demoted or refused), ``rejected`` (refused) counts.
    """

    name = "slos-serve"
    need_admit_by = True
    PARAMS = (*COMMON_PARAMS, "max_candidates", "load_levels", "prefill_slack_share", "on_decline",
              "kv_admission", "waiting_slo")

    def __init__(self, max_candidates: int = 64, load_levels: int = 64, prefill_slack_share: float = 0.5,
                 on_decline: str = "best_effort", kv_admission: bool = True, waiting_slo: bool = True,
                 **kw) -> None:
        super().__init__(**kw)
        self.waiting_slo = check_bool("waiting_slo", waiting_slo)
        self.max_candidates = check_int("max_candidates", max_candidates, 1)
        self.load_levels = check_int("load_levels", load_levels, 1)
        self.prefill_slack_share = check_fraction("prefill_slack_share", prefill_slack_share)
        if on_decline not in ON_DECLINE:
            raise ValueError(f"on_decline must be one of {ON_DECLINE}, got {on_decline!r}")
        self.on_decline = on_decline
        self.kv_admission = check_bool("kv_admission", kv_admission)
        self._tier: dict[str, int] = {}
        self.admitted = self.declined = self.rejected = 0

    # ------------------------------------------------------------------ Policy protocol
    def on_finished(self, req_id: str, goodput: float, now: float) -> None:
        """Forget the request's tier."""
        self._tier.pop(req_id, None)

    def invalidate(self, req_id: str) -> None:
        """Re-read ``req_id``'s static fields and decide its admission again at the next frame."""
        super().invalidate(req_id)
        self._tier.pop(req_id, None)

    def schedule(self, views: Sequence[RequestView], ctx: SchedContext) -> Decision:
        """Admission DP, soft admission control and the frame's batch; see the module docstring."""
        snap = self.begin_frame(views, ctx)
        if snap is None:
            return Decision([], [], {}, self.frame_id)
        n, B = snap.n, ctx.batch_size
        ids, now, d, rate = snap.ids, ctx.now, ctx.token_time, ctx.prefill_rate
        tier = np.fromiter(map(self._tier.get, ids, repeat(_UNDECIDED)), np.int8, n)
        kind = snap.kind
        be_kind = kind == BEST_EFFORT
        tier[be_kind] = _BEST_EFFORT
        lat = kind == LATENCY
        ttft, tbt = self.slo_columns(snap)
        gen = snap.generated
        m = np.maximum(snap.len_bound - gen, 1.0)
        p = np.maximum(snap.input_len + gen - snap.kv_tokens, 0.0)
        p[snap.running & (gen > 0) & (p <= 1)] = 0.0  # decoding: the pending token is the next step's
        pf = p / rate  # s of (re)prefill
        due = self.completion_due(snap)  # deadline-like completion due (s)
        next_due = snap.arrival + ttft + gen * tbt  # latency: due time of the next token (s)
        slack = due - now - pf - m * d
        lost = np.where(lat, (gen == 0) & (now + pf + d > next_due + 1e-9), slack < -1e-9) & ~be_kind
        pace = ~lat | (tbt >= d)  # a latency request slower than its TBT cannot keep its timeline
        pddl = np.where(lat, next_due, np.where(p > 0, now + pf + self.prefill_slack_share * np.maximum(slack, 0.0),
                                                now))
        tpot = np.where(lat, tbt, np.maximum((due - pddl) / m, d))
        start_by = np.full(n, np.inf)  # the engine's admission deadline of never-scheduled requests (s)
        if self.waiting_slo and snap.admit_by is not None:
            start_by = np.where(np.isnan(snap.admit_by), np.inf, snap.admit_by)
            pddl = np.minimum(pddl, start_by + pf)  # tpot keeps the later pDDL: conservative for the share
        share = d / (B * tpot)
        waiting_new = ~snap.running & (gen == 0) & (snap.kv_tokens == 0)  # never scheduled (as far as visible)

        # soft admission: drop requests whose SLO is lost (admitted ones too, except latency with tokens)
        lost_now = lost & ((tier == _UNDECIDED) | ((tier == _ADMITTED) & ~(lat & (gen > 0))))
        lost_now |= (tier == _UNDECIDED) & ~be_kind & ~pace
        reject = np.zeros(n, bool)
        self._decline(np.flatnonzero(lost_now), tier, waiting_new, reject, ids)
        # requests already scheduled that the policy has not decided (e.g. it started mid-run) are
        # force-admitted, as SLOs-Serve does with running requests
        started = np.flatnonzero((tier == _UNDECIDED) & ~waiting_new)
        if started.size:
            tier[started] = _ADMITTED
            for i in started.tolist():
                self._tier[ids[i]] = _ADMITTED

        # DP over the forced items (admitted, needing prefill) and the undecided candidates
        adm = tier == _ADMITTED
        forced = np.flatnonzero(adm & (p > 0))
        und = np.flatnonzero((tier == _UNDECIDED) & ~be_kind)
        if und.size > self.max_candidates:
            und = und[np.argpartition(pddl[und], self.max_candidates - 1)[: self.max_candidates]]
        c0 = float(share[adm & (p == 0)].sum())
        accepted = np.zeros(0, np.int64)
        if und.size:
            items = np.concatenate([forced, und])
            is_new = np.concatenate([np.zeros(forced.size, bool), np.ones(und.size, bool)])
            o = frame_order(items.size, pddl[items], snap.arrival[items])
            items, is_new = items[o], is_new[o]
            take = self._dp(np.maximum(pddl[items] - now, 0.0), p[items], share[items], is_new, c0, rate)
            accepted = items[take & is_new]
            if self.kv_admission and ctx.kv_capacity_tokens is not None and accepted.size:
                mem = snap.input_len + snap.len_bound
                used = float(mem[adm].sum())
                cum = used + np.cumsum(mem[accepted])  # accepted is in pDDL order
                accepted = accepted[cum <= ctx.kv_capacity_tokens]
            tier[accepted] = _ADMITTED
            for i in accepted.tolist():
                self._tier[ids[i]] = _ADMITTED
            self.admitted += accepted.size
            declined = np.setdiff1d(und, accepted, assume_unique=True)
            self._decline(declined, tier, waiting_new, reject, ids)

        # batch: admitted by least laxity, then the best-effort tier by deadline
        laxity = np.minimum(np.where(lat, next_due - pf - d, due - m * d - pf), start_by)
        be_due = np.minimum(np.where(be_kind, snap.arrival + self.best_effort_deadline, np.where(lat, next_due, due)),
                            start_by)
        key = np.where(tier == _ADMITTED, laxity, be_due)
        rank = np.where(tier == _ADMITTED, 0, np.where(tier == _BEST_EFFORT, 1, 2))
        rank[reject] = 3
        order = frame_order(n, rank, key, snap.arrival)
        order = order[: int((rank <= 1).sum())]
        chosen = order[:B]
        in_batch = np.zeros(n, bool)
        in_batch[chosen] = True
        displaced = np.flatnonzero(snap.running & ~in_batch & (tier == _BEST_EFFORT))
        preempt = [] if not displaced.size or self.kv_fits(snap, in_batch, ctx) else displaced.tolist()
        if len(self._tier) > 2 * n + 1024:  # forget departed ids the engine never reported
            self._tier = {i: t for i, t in zip(ids, tier.tolist(), strict=True) if t != _UNDECIDED}
        pr = self.rank_priorities(order, snap, ctx)
        rej = np.flatnonzero(reject)
        self.rejected += rej.size
        info = {"n": n, "admitted": int((tier == _ADMITTED).sum()), "dp_items": int(forced.size + und.size),
                "accepted": int(accepted.size), "decode_share": c0}
        return Decision([ids[i] for i in chosen.tolist()], [ids[i] for i in preempt], pr, self.frame_id, info,
                        [ids[i] for i in rej.tolist()])

    # ------------------------------------------------------------------ helpers
    def _decline(self, idx: np.ndarray, tier: np.ndarray, waiting_new: np.ndarray, reject: np.ndarray,
                 ids: list[str]) -> None:
        """Demote ``idx`` to the best-effort tier, or refuse the never-scheduled ones (``on_decline``)."""
        if not idx.size:
            return
        self.declined += idx.size
        if self.on_decline == "reject":
            ref = idx[waiting_new[idx]]
            reject[ref] = True
            for i in ref.tolist():
                self._tier.pop(ids[i], None)
            idx = idx[~waiting_new[idx]]
        tier[idx] = _BEST_EFFORT
        for i in idx.tolist():
            self._tier[ids[i]] = _BEST_EFFORT

    def _dp(self, t: np.ndarray, p: np.ndarray, share: np.ndarray, is_new: np.ndarray, c0: float,
            rate: float) -> np.ndarray:
        """Which items to take (bool per item; forced items always True).

        ``t``: prefill deadlines (s from now, non-decreasing); ``p``: prefill tokens; ``share``: decode
        share once prefilled; ``is_new``: optional (undecided) vs forced; ``c0``: decode share in use
        now; ``rate``: prefill tokens/s. ``dp[k, u]`` = maximal prefill slack (tokens) at the current
        deadline with k new items accepted using u share units (see the module docstring)."""
        U = self.load_levels
        K = int(is_new.sum())
        units = np.ceil(share * U - 1e-9).astype(np.int64)
        dp = np.full((K + 1, U + 1), _NEG)
        dp[0, 0] = 0.0
        ulev = np.arange(U + 1) / U
        cf = 0.0  # exact share of the forced items passed
        dts = np.diff(t, prepend=0.0).clip(min=0.0)
        k_max = 0
        choices: list[np.ndarray | None] = [None] * t.size
        j = 0
        while j < t.size:
            if not is_new[j]:  # a run of forced items, in one vectorised step
                e = j + 1
                while e < t.size and not is_new[e]:
                    e += 1
                cf = self._forced_run(dp[: k_max + 1], dts[j:e], p[j:e], share[j:e], c0, cf, rate, ulev)
                j = e
                continue
            if dts[j] > 0:
                dp[: k_max + 1] += dts[j] * rate * np.maximum(1.0 - c0 - cf - ulev, 0.0)
            w = int(units[j])
            acc = np.full((k_max + 2, U + 1), _NEG)
            if w <= U:
                acc[1:, w:] = dp[: k_max + 1, : U + 1 - w] - p[j]
                acc[acc < -1e-9] = _NEG
                over = 1.0 - c0 - cf - ulev < -1e-12  # the new share must fit the engine
                acc[:, over] = _NEG
            old = dp[: k_max + 2]
            take = acc > old
            dp[: k_max + 2] = np.where(take, acc, old)
            choices[j] = take
            if np.isfinite(dp[k_max + 1]).any():
                k_max += 1
            j += 1
        # best: most new items, then most slack
        k = k_max
        while k > 0 and not np.isfinite(dp[k]).any():
            k -= 1
        u = int(np.argmax(dp[k]))
        out = ~is_new.copy()
        for j in range(t.size - 1, -1, -1):
            ch = choices[j]
            if ch is None or k == 0:
                continue
            if ch[k, u]:
                out[j] = True
                k -= 1
                u -= int(units[j])
        return out

    @staticmethod
    def _forced_run(dp: np.ndarray, dt: np.ndarray, p: np.ndarray, share: np.ndarray, c0: float, cf: float,
                    rate: float, ulev: np.ndarray) -> float:
        """Apply a run of forced items to ``dp`` (rows in use, in place); returns the new forced share.

        Item l of the run first accrues ``dt_l·rate·max(1 − c0 − cf_l − u/U, 0)`` tokens of prefill budget
        (``cf_l``: forced share before it), then pays ``p_l``. A state survives only if after every item
        its slack stays at least ``min(0, slack of the no-new-admission path dp[0, 0]) − 1e-6``, so new
        admissions never make a forced item miss (or miss more); the run's decode share must fit."""
        cf_before = cf + np.concatenate(([0.0], np.cumsum(share)[:-1]))
        gain = np.cumsum(dt[:, None] * rate * np.maximum(1.0 - c0 - cf_before[:, None] - ulev[None, :], 0.0), axis=0)
        paid = np.cumsum(p)
        base = dp[0, 0] + gain[:, 0] - paid
        floor = np.minimum(base, 0.0) - 1e-6
        need = np.max(floor[:, None] - gain + paid[:, None], axis=0)  # least starting slack per u
        dp[dp < need[None, :]] = _NEG  # dp[0, 0] >= need[0] by construction
        dp += gain[-1] - paid[-1]
        cf += float(share.sum())
        over = 1.0 - c0 - cf - ulev < -1e-12
        over[0] = False
        dp[:, over] = _NEG
        return cf
