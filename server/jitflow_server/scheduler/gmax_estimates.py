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
    COMPOUND,
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
    """

    len_rem: np.ndarray
    t_gen: np.ndarray
    t_rem: np.ndarray
    goodput: np.ndarray
    base: np.ndarray
    feasible: np.ndarray
    marginal: np.ndarray | None = None


def on_time_tokens(
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


def group_max(values: np.ndarray, group: np.ndarray, n_groups: int, fill: float = -np.inf) -> np.ndarray:
    """Per-group maximum of ``values``: array of ``n_groups``, ``out[g] = max(values[group == g])``, ``fill``
    for groups without members. ``group`` holds group ids in ``[0, n_groups)``, one per value."""
    out = np.full(n_groups, fill)
    np.maximum.at(out, group, values)
    return out


def estimate(snap: Snapshot, ctx: SchedContext, prm: GMAXParams, horizon_s: float | None = None) -> Estimates:
    """Compute :class:`Estimates` for every request of ``snap`` at ``ctx.now`` (JITServe §4.2, App. C).

    ``horizon_s`` (JIT mode only) is how far ahead the marginal goodput looks, in seconds: the time
    until the policy decides again (default ``jit_horizon · Δ · v_token``).

    Per kind: latency goodput = remaining on-time output tokens at the measured
    speed (:func:`on_time_tokens`); deadline / best-effort goodput = ``ω_i·input + ω_o·output`` if
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
    # the value of meeting one request's SLO, in tokens: request_weight × the mean call's base goodput,
    # so that the objective counts SLO-meeting requests as well as tokens, in the workload's own units
    req_value = prm.request_weight * float(base.mean()) if prm.request_weight > 0 and base.size else 0.0
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
        cnt = on_time_tokens(now, *args)
        goodput[i] = prm.output_weight * cnt
        feasible[i] = cnt > 0
        t_rem[i] = snap.arrival[i] + ttft + (out_total[i] - 1.0) * tbt - now
        if marginal is not None:
            later = on_time_tokens(now + frame_s, *args)
            marginal[i] = prm.output_weight * (cnt - later)
        if req_value > 0:
            whole = cnt >= len_rem[i] - 1e-9  # every remaining token can still be on time
            goodput[i] += req_value * whole
            if marginal is not None:
                marginal[i] += req_value * (whole & (later < len_rem[i] - 1e-9))

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
        val = base[i] * weight + (0.0 if is_be else req_value)
        goodput[i] = np.where(ok, val, 0.0)
        if marginal is not None:
            urgent = t_gen[i] > tr - frame_s
            if prm.jit_commit and not is_be:
                urgent |= gen[i] > 0  # started: never deferred just in time (GMAXParams.jit_commit)
            marginal[i] = np.where(ok & urgent, val, 0.0)

    # compound stage groups: aggregate over members, share one priority
    if comp_i.size:
        i = comp_i
        g = snap.group[i]
        ng = snap.n_groups
        tg = t_gen[i]
        sum_tgen = np.bincount(g, tg, minlength=ng)
        max_tgen = group_max(tg, g, ng)
        rem_future = prm.future_margin * group_max(snap.task_rem_gen_time[i], g, ng, 0.0)
        tok_est = group_max(np.nan_to_num(snap.task_tokens_est[i], nan=-np.inf), g, ng)
        tok_sum = np.bincount(g, base[i], minlength=ng)
        if prm.compound_value == "stage":  # the stage's own tokens: see GMAXParams.compound_value
            g_tokens = tok_sum + req_value
        else:
            g_tokens = np.where(np.isfinite(tok_est) & (tok_est > 0), tok_est, tok_sum) + req_value
        task_dl = group_max(np.nan_to_num(snap.deadline[i], nan=-np.inf), g, ng)
        sub_dl = group_max(np.nan_to_num(snap.sub_deadline[i], nan=-np.inf), g, ng)
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
            pace = budget if prm.jit_pacing == "task" else np.minimum(budget, stage_rem)
            late_next = g_ok & (max_tgen > pace - frame_s)
            marginal[i] = np.where(late_next, g_tokens, 0.0)[g]
    if marginal is not None and snap.admit_by is not None:
        # admission control (JITServe §5) rejects a never-scheduled request at admit_by: deferring it
        # past that loses all of its goodput (a compound call: its whole task's).
        with np.errstate(invalid="ignore"):
            at_risk = snap.admit_by - now <= max(frame_s, prm.admit_horizon)
        if comp_i.size:
            g_risk = group_max(at_risk[comp_i].astype(float), snap.group[comp_i], snap.n_groups, 0.0) > 0
            at_risk[comp_i] = g_risk[snap.group[comp_i]]
        marginal = np.where(at_risk, goodput, marginal)
    return Estimates(len_rem, t_gen, t_rem, goodput, base, feasible, marginal)
