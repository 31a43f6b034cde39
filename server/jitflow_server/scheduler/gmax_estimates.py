"""GMAX's per-frame estimates (JITServe §4.2, App. C): remaining length and generation time, time left,
achievable goodput and, in JIT mode, the goodput lost by deferring, per request and stage group
(:func:`estimate`), with the latency kind's on-time token count (:func:`on_time_tokens`). The policy that
turns them into priorities, the batch window and preemptions is :mod:`jitflow_server.scheduler.gmax`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jitflow_server.scheduler.gmax_params import GMAXParams
from jitflow_server.scheduler.snapshot import (
    BEST_EFFORT,
    DEADLINE,
    LATENCY,
    Snapshot,
)
from jitflow_server.scheduler.types import SchedContext


@dataclass(slots=True)
class Estimates:
    """Per-request estimates of one frame (arrays of length N, JITServe §4.2).

    ``len_rem`` tokens; ``t_gen`` s (for stage-group members: the group's priority denominator);
    ``t_rem`` s to the (sub-)deadline (inf for none); ``goodput`` achievable goodput in tokens (0 when
    infeasible); ``base`` the request's (group's) base goodput R in tokens; ``feasible`` bool;
    ``marginal`` goodput lost by deferring one frame (only filled in JIT mode).

    From :func:`estimate_speeds` the speed-dependent fields (``t_gen``, ``goodput``, ``feasible``,
    ``marginal``) are (K, N), one row per token time; :meth:`row` picks one as a 1-D ``Estimates``.
    """

    len_rem: np.ndarray
    t_gen: np.ndarray
    t_rem: np.ndarray
    goodput: np.ndarray
    base: np.ndarray
    feasible: np.ndarray
    marginal: np.ndarray | None = None

    def row(self, r: int) -> Estimates:
        """The estimates at the ``r``-th token time of a (K, N) result (1-D arrays of N)."""
        return Estimates(self.len_rem, self.t_gen[r], self.t_rem, self.goodput[r], self.base, self.feasible[r],
                         None if self.marginal is None else self.marginal[r])


def on_time_tokens(
    now: float | np.ndarray,
    start_delay: np.ndarray,
    v_token: float | np.ndarray,
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
    catches up when ``v_token < tbt``). The arrays have one length N; ``now`` and ``v_token`` are
    scalars, or (K, 1) columns (then the result is (K, N), one row per speed).
    """
    a = now + start_delay - generated * v_token - arrival - ttft + tbt
    s = v_token - tbt
    hi = generated + len_rem
    eps = 1e-9
    pos = s > eps
    neg = s < -eps
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # the crossing point j* = −a/s, one division for both signs (a/(−s) = −a/s exactly in IEEE)
        cross = -a / np.where(pos | neg, s, 1.0)
        # s > 0: tokens up to floor(j*) are on time; s < 0: tokens from ceil(j*) on (at least generated+1)
        cnt_pos = np.minimum(np.maximum(np.minimum(np.floor(cross + eps), hi) - generated, 0.0), len_rem)
        cnt_neg = np.minimum(np.maximum(hi - np.maximum(np.ceil(cross - eps), generated + 1.0) + 1.0, 0.0), len_rem)
        cnt_zero = np.where(a <= eps, len_rem, 0.0)
    return np.where(pos, cnt_pos, np.where(neg, cnt_neg, cnt_zero))


def fill_nan(values: np.ndarray, value: float) -> np.ndarray:
    """``values`` with NaN replaced by ``value`` (a copy). ``np.nan_to_num`` would also turn ±inf into
    ±1.8e308 and costs 18 µs a call against 3 µs; an infinite deadline stays "none"."""
    return np.where(np.isnan(values), value, values)


def group_sum(values: np.ndarray, group: np.ndarray, n_groups: int) -> np.ndarray:
    """Per-group sum of the (K, M) ``values``, row by row: (K, n_groups) (``np.bincount`` per row)."""
    k = values.shape[0]
    if k == 1:
        return np.bincount(group, values[0], minlength=n_groups)[None, :]
    return np.bincount(_row_groups(group, n_groups, k), values.ravel(), minlength=k * n_groups).reshape(k, n_groups)


def _row_groups(group: np.ndarray, n_groups: int, k: int) -> np.ndarray:
    """Group ids of a (K, M) array flattened row by row: row r's groups move to ``[r·n_groups, (r+1)·n_groups)``."""
    return (group[None, :] + n_groups * np.arange(k)[:, None]).ravel()


def estimate(snap: Snapshot, ctx: SchedContext, prm: GMAXParams, horizon_s: float | None = None) -> Estimates:
    """Compute :class:`Estimates` for every request of ``snap`` at ``ctx.now`` and ``ctx.token_time``
    (JITServe §4.2, App. C): :func:`estimate_speeds` at that one speed.

    ``horizon_s`` (JIT mode only) is how far ahead the marginal goodput looks, in seconds: the time
    until the policy decides again (default ``jit_horizon · Δ · v_token``).
    """
    hz = None if horizon_s is None else np.array([horizon_s], float)
    return estimate_speeds(snap, ctx, prm, np.array([ctx.token_time], float), hz).row(0)


def estimate_speeds(snap: Snapshot, ctx: SchedContext, prm: GMAXParams, token_times: np.ndarray,
                    horizons_s: np.ndarray | None = None) -> Estimates:
    """:class:`Estimates` of every request of ``snap`` at ``ctx.now`` for K decode speeds at once.

    ``token_times`` (K,) s per output token (e.g. one per candidate batch size); ``horizons_s`` (K,) the
    JIT look-ahead per speed in s (JIT mode; default ``jit_horizon · Δ · v_token``). The speed-dependent
    fields come back as (K, N) (:meth:`Estimates.row` picks one). One pass over K speeds costs about what
    one speed did: the frame's cost is numpy's per-call overhead on a few hundred rows, not arithmetic.

    The remaining length is ``max(bound_share · (len_bound − generated), 1)`` tokens (with
    ``use_true_len`` a known true length in place of the bound, whole), the generation time that length
    at each token time plus the pending prefill at ``ctx.prefill_rate``.
    Per kind: latency goodput = remaining on-time output tokens at the measured
    speed (:func:`on_time_tokens`); deadline / best-effort goodput = ``ω_i·input + ω_o·output`` if
    ``now + t_gen ≤ deadline`` (a deadline request: ``soft_feasibility`` of it if only with
    ``deadline_soft_share`` of the bound); compound goodput = the task's estimated tokens (else the stage
    group's tokens) if the group can finish in time (``soft_feasibility`` of them if only with the
    analyzer's estimate of the later stages, not ``future_margin`` times it), shared by all members of
    the stage group; with
    ``compound_admit="member"`` a waiting call of a begun stage that admission control rejects before
    the next decision is priced on its own generation time instead of the group's.
    """
    now = ctx.now
    v = np.asarray(token_times, float).reshape(-1, 1)  # (K, 1)
    n_speeds = v.shape[0]
    gen = snap.generated
    total = snap.len_bound
    share = prm.bound_share  # plan with a share of what the bound leaves (GMAXParams.bound_share)
    if prm.use_true_len:
        known = ~np.isnan(snap.true_len)
        total = np.where(known, snap.true_len, total)
        share = np.where(known, 1.0, share)  # a true length is planned whole
    len_rem = np.maximum(share * (total - gen), 1.0)
    if prm.overrun > 0 and not prm.use_true_len:
        # the bound was too low (the engine keeps generating): the remaining length is unknown
        over = total - gen <= 1.0
        len_rem[over] = np.maximum(prm.overrun * gen[over], 1.0)
    # tokens still to prefill (input + generated − KV held; 0 for a running request that decodes)
    pending = np.maximum(snap.input_len + gen - snap.kv_tokens, 0.0)
    run_i = snap.running.nonzero()[0]
    pending[run_i[gen[run_i] > 0]] = 0.0
    pre = pending / ctx.prefill_rate
    t_gen = len_rem * v + pre  # (K, N)
    out_total = gen + len_rem
    base = prm.input_weight * snap.input_len + prm.output_weight * out_total
    # the value of meeting one request's SLO, in tokens: request_weight × the mean call's base goodput,
    # so that the objective counts SLO-meeting requests as well as tokens, in the workload's own units
    # (sum / size is np.mean's arithmetic, bit for bit, without its 15 µs of dispatch)
    req_value = prm.request_weight * (float(base.sum()) / base.size) if prm.request_weight > 0 and base.size else 0.0
    kind = snap.kind
    n = snap.n
    goodput = np.zeros((n_speeds, n))
    t_rem = np.full(n, np.inf)
    feasible = np.zeros((n_speeds, n), bool)
    marginal = np.zeros((n_speeds, n)) if prm.jit else None
    if horizons_s is not None:
        frame_s = np.asarray(horizons_s, float).reshape(-1, 1)
    else:
        frame_s = prm.delta_steps * v * prm.jit_horizon
    # integer index arrays (random boolean masks are several times slower on 10^4 rows)
    lat_i, dl_i, be_i = ((kind == k).nonzero()[0] for k in (LATENCY, DEADLINE, BEST_EFFORT))
    comp_i = snap.stage_groups.members if snap.stage_groups is not None else np.zeros(0, np.int64)

    # latency-sensitive: on-time tokens of the remaining timeline
    if lat_i.size:
        i = lat_i
        ttft = fill_nan(snap.ttft[i], prm.default_ttft)
        tbt = fill_nan(snap.tbt[i], prm.default_tbt)
        args = (gen[i], len_rem[i], snap.arrival[i], ttft, tbt)
        if marginal is not None:  # now and one horizon later in one call: rows [0, K) and [K, 2K)
            both = on_time_tokens(np.concatenate((np.full_like(v, now), now + frame_s)), pre[i], np.concatenate((v, v)), *args)
            cnt, later = both[:n_speeds], both[n_speeds:]
        else:
            cnt = on_time_tokens(now, pre[i], v, *args)
        goodput[:, i] = prm.output_weight * cnt
        feasible[:, i] = cnt > 0
        t_rem[i] = snap.arrival[i] + ttft + (out_total[i] - 1.0) * tbt - now
        if marginal is not None:
            marginal[:, i] = prm.output_weight * (cnt - later)
        if req_value > 0:
            whole = cnt >= len_rem[i] - 1e-9  # every remaining token can still be on time
            goodput[:, i] += req_value * whole
            if marginal is not None:
                marginal[:, i] += req_value * (whole & (later < len_rem[i] - 1e-9))

    # deadline-sensitive and best-effort (default deadline after arrival)
    for i, weight, is_be in ((dl_i, 1.0, False), (be_i, prm.best_effort_weight, True)):
        if not i.size:
            continue
        dline = snap.deadline[i]
        if is_be:
            dline = np.where(np.isnan(dline), snap.arrival[i] + prm.best_effort_deadline, dline)
        tr = dline - now
        t_rem[i] = tr
        ok = t_gen[:, i] <= tr + 1e-9
        val = base[i] * weight + (0.0 if is_be else req_value)
        value = np.where(ok, val, 0.0)
        if not is_be and 0 < prm.deadline_soft_share < prm.bound_share and not prm.use_true_len:
            # feasible only if the answer is as short as deadline_soft_share of the bound: a share of its
            # value, ranked urgent (GMAXParams.deadline_soft_share)
            short = np.maximum(prm.deadline_soft_share * (total[i] - gen[i]), 1.0) * v + pre[i]
            doubtful = (short <= tr + 1e-9) & ~ok
            value = np.where(doubtful, prm.soft_feasibility * val, value)
            ok = ok | doubtful
        feasible[:, i] = ok
        goodput[:, i] = value
        if marginal is not None:
            urgent = t_gen[:, i] * (1.0 + prm.jit_slack) > tr - frame_s
            if prm.jit_commit and not is_be:
                urgent |= gen[i] > 0  # started: never deferred just in time (GMAXParams.jit_commit)
            marginal[:, i] = np.where(ok & urgent, value, 0.0)

    # compound stage groups: aggregate over members, share one priority
    if comp_i.size:
        i = comp_i
        sg = snap.stage_groups
        g = sg.group
        ng = snap.n_groups
        tg = t_gen[:, i]  # each member's own generation time (a copy: integer indexing)
        sum_tgen = group_sum(tg, g, ng)
        max_tgen = sg.max(tg)
        # the speed-free per-group maxima in one pass
        rem_future, tok_est, task_dl, sub_dl = sg.max(np.array((
            snap.task_rem_gen_time[i], fill_nan(snap.task_tokens_est[i], -np.inf),
            fill_nan(snap.deadline[i], -np.inf), fill_nan(snap.sub_deadline[i], -np.inf))))
        rem_later = rem_future  # the analyzer's estimate as is
        rem_future = prm.future_margin * rem_future
        tok_sum = np.bincount(g, base[i], minlength=ng)
        if prm.compound_value == "stage":  # the stage's own tokens: see GMAXParams.compound_value
            g_tokens = tok_sum + req_value
        else:
            g_tokens = np.where(np.isfinite(tok_est) & (tok_est > 0), tok_est, tok_sum) + req_value
        has_sub = np.isfinite(sub_dl)
        has_task = np.isfinite(task_dl)
        with np.errstate(invalid="ignore"):
            stage_rem = np.where(has_sub, sub_dl - now, np.where(has_task, task_dl - now - rem_future, np.inf))
            task_slack = np.where(has_task, task_dl - now - rem_future, stage_rem)
        budget = task_slack if prm.compound_feasibility == "task" else stage_rem
        g_ok = max_tgen <= budget + 1e-9  # (K, groups)
        g_value = np.where(g_ok, g_tokens, 0.0)
        if prm.soft_feasibility > 0 and prm.future_margin > 1 and prm.compound_feasibility == "task":
            # feasible only with the later stages as the analyzer estimates them (GMAXParams.soft_feasibility)
            with np.errstate(invalid="ignore"):
                optimistic = np.where(has_task, task_dl - now - rem_later, stage_rem)
            doubtful = (max_tgen <= optimistic + 1e-9) & ~g_ok
            g_value = np.where(doubtful, prm.soft_feasibility * g_tokens, g_value)
            g_ok = g_ok | doubtful
        rescue = prm.compound_admit == "member" and marginal is not None and snap.admit_by is not None
        if rescue or prm.compound_priority == "commit":
            begun = sg.max((gen[i] > 0) | snap.running[i])  # (groups,) a member is running or has generated
        if prm.compound_priority == "aggregate":
            span = sum_tgen
        elif prm.compound_priority == "slowest":
            span = max_tgen
        else:  # "commit": the members' summed bandwidth until one of them has started, then the slowest one
            span = np.where(begun, max_tgen, sum_tgen)
        den = span + rem_future
        t_gen[:, i] = den[:, g]
        if rescue:
            # "member" (GMAXParams.compound_admit): a waiting call of a stage that has begun, which
            # admission control rejects before the next decision, fails its task and wastes what its
            # siblings were served; saving it takes only its own start, so it is priced on its own
            # generation time
            with np.errstate(invalid="ignore"):
                imminent = (snap.admit_by[i] - now <= frame_s) & begun[g]  # (K, M)
            t_gen[:, i] = np.where(imminent, tg, t_gen[:, i])
        t_rem[i] = stage_rem[g]
        base[i] = g_tokens[g]
        feasible[:, i] = g_ok[:, g]
        goodput[:, i] = g_value[:, g]
        if marginal is not None:
            pace = budget if prm.jit_pacing == "task" else np.minimum(budget, stage_rem)
            late_next = g_ok & (max_tgen * (1.0 + prm.jit_slack) > pace - frame_s)  # doubtful: always
            marginal[:, i] = np.where(late_next, g_value, 0.0)[:, g]
    if marginal is not None and snap.admit_by is not None:
        # admission control (JITServe §5) rejects a never-scheduled request at admit_by: deferring it
        # past that loses all of its goodput (a compound call: its whole task's).
        with np.errstate(invalid="ignore"):
            at_risk = snap.admit_by - now <= np.maximum(frame_s, prm.admit_horizon)  # (K, N)
        if comp_i.size:
            at_risk[:, comp_i] = snap.stage_groups.max(at_risk[:, comp_i])[:, snap.stage_groups.group]
        marginal = np.where(at_risk, goodput, marginal)
    return Estimates(len_rem, t_gen, t_rem, goodput, base, feasible, marginal)
