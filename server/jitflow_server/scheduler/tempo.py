"""``tempo``: Tempo's Largest Service Density First scheduling (Tempo, "Application-aware LLM Serving
with Mixed SLO Requirements", §3.1, §4.2, §4.3).

Per frame, for every request (times s, lengths tokens, gains weighted tokens):

- *Length upper bound* (§4.1): the remaining output is ``R = max(len_bound - generated, 1)``;
  ``len_bound`` is the analyzer's quantile upper bound (Tempo's QRF), refined as tokens are
  generated, so the schedule starts conservative and relaxes (§4.1).
- *Remaining execution time* (§4.2, "token processing speed"): ``T = P + R_eff · token_time`` with
  ``P = (input_len + generated - kv_tokens) / prefill_rate`` for a request that must (re)fill its
  KV and ``R_eff = R``, except for compound calls, where ``R_eff`` is the largest ``R`` of the stage
  group (§4.2 "uses the maximum remaining length to estimate the stage's potential completion
  time": a shorter call of the stage gains nothing by finishing early, so its density is lowered).
- *Service gain* (§3.1 Eq. 1): ``SG = w_in · input_len + w_out · (generated + R)`` (default weights
  1 : 2, the pricing ratio the paper uses).
- *Degradation* (§3.1): divisive decay ``f(x) = 1 / (1 + alpha · x)`` of the relative violation
  ``x >= 0``; ``f = 1`` when the SLO is met (no extra gain for finishing early), ``alpha -> inf``
  turns the gain into SLO goodput.
- *Expected service gain* (§3.1 Eq. 2, 3): deadline, compound and best-effort requests:
  ``ESG = SG · f(max(now + T - due, 0) / (due - arrival))`` with ``due`` the deadline (compound:
  ``sub_deadline`` else the task deadline; best-effort ``arrival + best_effort_deadline``);
  latency requests along the token timeline: token ``j`` is due at ``arrival + ttft + (j-1) · tbt``
  and, served from now on, arrives ``now + P + (j - generated) · token_time``; the remaining tokens
  that would be late lose ``f(mean lag / ttft)`` of their ``w_out`` (closed form over the linear lag).
- *Service density* (§4.2, Algorithm 1 LSDF): ``rho = ESG / T``; larger first.

Allocation (§4.3, "just enough bandwidth"): an SLO request whose slack ``due - now - T`` (latency:
the next token's due time minus its arrival time; a request never scheduled yet: also at most
``admit_by - now - P``, since the engine's admission control rejects a request not started by
``admit_by``, a rule Tempo does not have) exceeds ``defer_slack`` plus one frame is ahead of its
conservative schedule and is *deferred* behind the requests that need service now; a share
``reserve`` of the B slots goes to best-effort requests in FCFS order (the paper's reserved
bandwidth for SLO-insensitive requests), backfilled by SLO requests when unused. Plan order:
reserved best-effort, then urgent SLO requests by density, then everything else by density.
The deferral is this module's reading of §4.3 ("throttles SLO-aware requests ... using
conservative serving rates"; the paper gives no rule) and is off by default (``defer_slack = inf``:
every SLO request is urgent, plain LSDF plus the reserve), see :class:`TempoPolicy`.

Cost-aware preemption (§4.2): displaced running requests are paused when the KV cache has room.
Otherwise each admitted request is paired with a displaced one (lowest-ranked admitted with the
highest-density displaced) and the switch is made only if the admitted request is in a more urgent
tier, or its density gain over one frame exceeds the service lost during the victim's stall:
``(rho_w - rho_d) · frame > rho_d · stall_d``, ``frame = delta_steps · token_time``,
``stall_d = kv_tokens / prefill_rate`` (recompute) or ``2 · kv_tokens / swap_rate`` (swap out and
in); otherwise the running request keeps its slot. Preemptions happen only at frame boundaries,
the paper's time quanta (default ``delta_steps = 20`` decode steps, §4.2).

Simplified: the QRF predictor and the dependency-graph matching of §4.1 are the analyzer's job
(``len_bound``, ``sub_deadline``); the violation is normalised by the SLO's own time scale (the
paper leaves the metric's scale open); the latency timeline's late tokens are priced at their mean
lag (Jensen approximation of the per-token sum); the fairness blend of §4.3 is not implemented.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

import numpy as np

from jitflow_server.scheduler.frames import frame_order
from jitflow_server.scheduler.peer_common import (
    COMMON_PARAMS,
    PeerPolicy,
    check_fraction,
    check_positive,
)
from jitflow_server.scheduler.snapshot import BEST_EFFORT, LATENCY, Snapshot
from jitflow_server.scheduler.types import Decision, RequestView, SchedContext


class TempoPolicy(PeerPolicy):
    """Tempo LSDF (see the module docstring for the formulas and the paper sections).

    Parameters (``ValueError`` on a bad value), besides the common ones of
    :class:`~jitflow_server.scheduler.peer_common.PeerPolicy` (``delta_steps`` default 20, Tempo's
    preemption quantum):

    - ``w_in`` (1.0), ``w_out`` (2.0): service-gain weights of input and output tokens (> 0);
    - ``alpha`` (1.0, > 0): decay of the degradation ``f(x) = 1/(1 + alpha·x)``;
    - ``reserve`` (0.1, in [0, 1]): share of the B slots reserved for best-effort requests (FCFS);
    - ``defer_slack`` (``inf`` s, >= 0): an SLO request with more slack than this plus one frame is
      deferred behind the urgent ones; the default ``inf`` defers nothing (pure LSDF): in the
      ``a100-llama8b`` simulation every finite value tried (1-10 s) lowered token goodput and did not
      raise SLO attainment (docs/scheduling.md).
    """

    name = "tempo"
    need_admit_by = True
    PARAMS = (*COMMON_PARAMS, "w_in", "w_out", "alpha", "reserve", "defer_slack")

    def __init__(self, w_in: float = 1.0, w_out: float = 2.0, alpha: float = 1.0, reserve: float = 0.1,
                 defer_slack: float = math.inf, delta_steps: int = 20, **kw) -> None:
        super().__init__(delta_steps=delta_steps, **kw)
        self.w_in = check_positive("w_in", w_in)
        self.w_out = check_positive("w_out", w_out)
        self.alpha = check_positive("alpha", alpha)
        self.reserve = check_fraction("reserve", reserve)
        if isinstance(defer_slack, bool) or not isinstance(defer_slack, Real) or not defer_slack >= 0:
            raise ValueError(f"defer_slack must be a number >= 0 s (inf: no deferral), got {defer_slack!r}")
        self.defer_slack = float(defer_slack)

    def degrade(self, x: np.ndarray) -> np.ndarray:
        """``f(x) = 1 / (1 + alpha · max(x, 0))`` (dimensionless)."""
        return 1.0 / (1.0 + self.alpha * np.maximum(x, 0.0))

    def estimates(self, snap: Snapshot, ctx: SchedContext) -> dict[str, np.ndarray]:
        """Per-request ``density`` (weighted tokens / s), ``slack`` (s), ``exec`` (s), ``esg``."""
        tt, now = ctx.token_time, ctx.now
        g = snap.generated
        rem = np.maximum(snap.len_bound - g, 1.0)
        prefill = np.maximum(snap.input_len + g - snap.kv_tokens, 0.0) / ctx.prefill_rate
        own = prefill + rem * tt
        t_exec = own
        groups = snap.stage_groups
        if groups is not None:  # a stage group runs as long as its slowest member
            t_exec = own.copy()
            t_exec[groups.members] = groups.max(own[groups.members])[groups.group]
        due = self.completion_due(snap)
        span = np.maximum(due - snap.arrival, tt)
        sg = self.w_in * snap.input_len + self.w_out * (g + rem)
        esg = sg * self.degrade((now + t_exec - due) / span)
        slack = due - now - own
        lat = np.flatnonzero(snap.kind == LATENCY)
        if lat.size:
            ttft, tbt = self.slo_columns(snap)
            a, tf, tb, gl, rl, pl = snap.arrival[lat], ttft[lat], tbt[lat], g[lat], rem[lat], prefill[lat]
            c0 = now + pl + tt - a - tf - gl * tb  # lag (s) of the next token if served from now
            s = tt - tb  # lag change per further token (s)
            late, mean_lag = _late_tokens(c0, s, rl)
            on_time = rl - late
            esg[lat] = self.w_in * snap.input_len[lat] + self.w_out * (
                gl + on_time + late * self.degrade(mean_lag / tf))
            slack[lat] = -c0
        if snap.admit_by is not None:  # a never-scheduled request must start by admit_by or be rejected
            slack = np.fmin(slack, snap.admit_by - now - prefill)
        return {"density": esg / np.maximum(t_exec, 1e-9), "slack": slack, "exec": t_exec, "esg": esg}

    def schedule(self, views: Sequence[RequestView], ctx: SchedContext) -> Decision:
        """LSDF with deferral, best-effort reserve and cost-aware preemption (module docstring)."""
        snap = self.begin_frame(views, ctx)
        if snap is None:
            return Decision([], [], {}, self.frame_id)
        n, B = snap.n, ctx.batch_size
        est = self.estimates(snap, ctx)
        rho = est["density"]
        frame = self.delta_steps * ctx.token_time
        be = snap.kind == BEST_EFFORT
        urgent = ~be & (est["slack"] <= self.defer_slack + frame)
        tier = np.where(urgent, 1, 2)
        n_res = min(math.ceil(self.reserve * B), int(be.sum()))
        if n_res:
            be_idx = np.flatnonzero(be)
            first = be_idx[frame_order(be_idx.size, snap.arrival[be_idx])[:n_res]]
            tier[first] = 0
        order = frame_order(n, tier, np.where(tier == 0, snap.arrival, -rho), snap.arrival)
        in_batch = np.zeros(n, bool)
        in_batch[order[:B]] = True
        displaced = np.flatnonzero(snap.running & ~in_batch)
        preempt: list[int] = []
        if displaced.size and not self.kv_fits(snap, in_batch, ctx):
            preempt = self._cost_aware(snap, ctx, order, in_batch, displaced, rho, tier, frame)
        pos = np.empty(n, np.int64)
        pos[order] = np.arange(n)
        batch_idx = np.flatnonzero(in_batch)
        batch_idx = batch_idx[np.argsort(pos[batch_idx], kind="stable")]
        ids = snap.ids
        shown = self.shown(order, snap, ctx)
        pr = dict(zip([ids[i] for i in shown], rho[shown].tolist(), strict=True))
        info = {"n": n, "urgent": int(urgent.sum()), "reserved": n_res}
        return Decision([ids[i] for i in batch_idx.tolist()], [ids[i] for i in preempt], pr, self.frame_id, info)

    @staticmethod
    def _cost_aware(snap: Snapshot, ctx: SchedContext, order: np.ndarray, in_batch: np.ndarray,
                    displaced: np.ndarray, rho: np.ndarray, tier: np.ndarray, frame: float) -> list[int]:
        """Pair the lowest-ranked admitted waiting requests with the highest-density displaced running
        ones; undo the switches that do not pay for the victim's stall. Edits ``in_batch``; returns the
        displaced requests to preempt."""
        pos = np.empty(snap.n, np.int64)
        pos[order] = np.arange(snap.n)
        adm = np.flatnonzero(in_batch & ~snap.running)
        adm = adm[np.argsort(-pos[adm], kind="stable")]  # worst-ranked first
        dis = displaced[frame_order(displaced.size, -rho[displaced], pos[displaced])]
        k = min(adm.size, dis.size)
        w, d = adm[:k], dis[:k]
        kv = snap.kv_tokens[d]
        stall = 2.0 * kv / ctx.swap_rate if ctx.swap_rate else kv / ctx.prefill_rate
        worth = (tier[w] < tier[d]) | ((rho[w] - rho[d]) * frame > rho[d] * stall)
        keep = d[~worth]
        in_batch[w[~worth]] = False
        in_batch[keep] = True
        return sorted(set(displaced.tolist()) - set(keep.tolist()), key=lambda i: pos[i])


def _late_tokens(c0: np.ndarray, s: np.ndarray, rem: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of ``rem`` tokens with lags ``c0 + k·s`` (k = 0..rem-1, s), how many are late (lag > 0) and
    their mean lag (s). Vectorised closed form."""
    dec = s < 0
    with np.errstate(divide="ignore", invalid="ignore"):
        # decreasing lags: tokens k < c0/(-s) are late
        n_dec = np.where(c0 > 0, np.minimum(np.ceil(c0 / np.where(dec, -s, 1.0)), rem), 0.0)
        # non-decreasing lags: all late when c0 > 0, else those with k > -c0/s
        k0 = np.where(c0 > 0, 0.0, np.where(s > 0, np.floor(-c0 / np.where(s > 0, s, 1.0)) + 1.0, rem))
        n_inc = np.maximum(rem - k0, 0.0)
    late = np.where(dec, n_dec, n_inc)
    first = np.where(dec, 0.0, np.minimum(k0, rem))  # index of the first late token
    mean_lag = np.where(late > 0, c0 + s * (first + (late - 1.0) / 2.0), 0.0)
    return late, np.maximum(mean_lag, 0.0)
