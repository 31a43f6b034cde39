"""``qlm``: QLM's queue management for one LLM serving instance (QLM, "One Queue Is All You Need:
Resolving Head-of-Line Blocking in Large Language Model Serving", §4-§7, Appendix A.3).

- *Request groups* (§4, Def. 4.1, Algorithm 1): requests with the same SLO class form groups, FCFS
  inside a group. The class of a request, fixed at its first frame, is ``(kind, SLO bucket, length
  bucket)``: the bucket of its relative end-to-end SLO (s) on a geometric grid of ratio
  ``slo_ratio`` and of its output-length bound (tokens) on a grid of ratio ``len_ratio`` (QLM
  clusters on model, SLO value and token distribution with k-means; one model here). A new request
  joins its class's open group until that group has received ``group_factor · B`` requests
  (QLM's size cap ``δ × avg_batch_size``, δ = 4), then a new group opens (the split of Algorithm 1).
- *Virtual queue* (§4, Def. 4.2): one instance, so one virtual queue: an order of the groups; new
  groups are appended at the tail. The plan runs requests in virtual-queue order (pulling, §5); a
  running request whose group falls behind is *evicted* (``Decision.preempt``, §5 request eviction)
  unless ``kv_capacity_tokens`` says everything fits, when it is only paused (as the other baselines).
- *RCT estimator* (§6, Eq. 1-5): the output length ``O`` of a request is ``N(mu, sigma)`` of its
  class, fitted online from the lengths of finished requests of the class (the paper fits it
  offline per group; before ``min_history`` finished requests, the analyzer's bound ``len_bound``
  with ``sigma = 0``); the remaining length is ``m = clip(mu, generated + 1, len_bound) - generated``.
  A request's execution time is ``exec = P + m · eps · d`` (Eq. 4; ``P`` its (re)prefill time from
  ``prefill_rate``, ``d = token_time``, ``eps = inefficiency``); the engine time it takes from the
  queue is ``work = P + m · eps · d / B`` (Eq. 2: tokens ahead / throughput ``Θ = B / d``). A group's
  completion time at position j is ``ct_j = now + Σ_{k<j} work_k + max_q exec_q`` (Eq. 5, 10) with
  standard deviation ``sqrt(Σ_{k<j} var_k + (eps · d · sigma)^2)``.
- *Plan generator* (§7, Eq. 6-13): invoked when the RCT estimator finds a group whose chance
  constraint ``P(ct_j <= slo_j) > attainment`` (Eq. 12, normal quantile) fails in the current
  order; with ``waiting_slo`` (default) a group must also start before the earliest admission
  deadline ``admit_by`` of its never-scheduled members (Appendix A.3 waiting-time SLOs: the
  engine's admission control rejects a request not started by then). It minimises ``Σ_j E[ct_j - slo_j]`` (Eq. 13) subject to the chance constraints. With one
  instance and one model (no model swaps, Eq. 9 vanishes) and each group's work inflated to its
  ``attainment`` quantile, this is ``1 | d̄_j | Σ C_j`` over the groups, solved exactly in
  O(G log G) by Smith's backward rule (among the groups that can finish last within their
  deadline, put last the one with the most work) instead of a stochastic-programming solver.
- *Unmeetable SLOs* (Appendix A.3): a group that misses its constraint even at the head of the
  queue has no feasible position; its constraint is relaxed (it still counts in the objective), as
  otherwise one late request would make every plan infeasible. When the remaining constraints
  still admit no order, the plan falls back to EDF over the groups (A.3 option b). With
  ``on_infeasible="drop"`` QLM also applies admission control (A.3 option c): waiting requests
  that were never scheduled and whose estimated completion in the plan misses their SLO (with
  probability >= ``1 - attainment``: members of hopeless groups, or of groups the EDF fallback
  cannot serve in time) are rejected (``Decision.reject``), their work leaving the queue ahead of
  the later groups. The default ``"edf"`` rejects nothing (the paper's evaluation scales up
  instead of dropping).

End-to-end SLO of a request (QLM has only end-to-end deadlines): deadline requests ``deadline``;
compound calls ``sub_deadline`` else the task deadline; latency requests the end of their token
timeline ``arrival + ttft + (generated + m - 1) · tbt``; best-effort ``arrival + best_effort_deadline``.

Not modelled: multiple instances/virtual queues, load balancing, model swapping and warm start
(one model per engine here), and the choice between eviction and GPU-CPU swap (the engine swaps
when it has a ``swap_rate``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

from jitflow_server.scheduler.frames import frame_order
from jitflow_server.scheduler.peer_common import (
    COMMON_PARAMS,
    PeerPolicy,
    check_bool,
    check_fraction,
    check_int,
    check_positive,
)
from jitflow_server.scheduler.snapshot import BEST_EFFORT, LATENCY, Snapshot
from jitflow_server.scheduler.types import Decision, RequestView, SchedContext

ON_INFEASIBLE = ("edf", "drop")


class QLMPolicy(PeerPolicy):
    """QLM request groups, virtual queue, RCT estimator and plan generator (module docstring).

    Parameters (``ValueError`` on a bad value), besides the common ones of
    :class:`~jitflow_server.scheduler.peer_common.PeerPolicy`:

    - ``group_factor`` (4, >= 1): δ, a group's size cap in batches;
    - ``attainment`` (0.95, in (0, 1)): Δ of the chance constraint (Eq. 12);
    - ``inefficiency`` (1.0, > 0): ε of Eq. 4;
    - ``slo_ratio`` (2.0, > 1), ``len_ratio`` (2.0, > 1): class grids of the SLO (s) and the length
      bound (tokens);
    - ``min_history`` (20, >= 1): finished requests of a class before its fitted length is used;
    - ``on_infeasible`` ("edf" or "drop"): Appendix A.3 handling of unmeetable SLOs (EDF fallback
      only; plus rejection of never-scheduled requests the plan cannot serve in time);
    - ``waiting_slo`` (True): also hold each group to the admission deadline ``admit_by`` of its
      never-scheduled members (a waiting-time SLO, Appendix A.3) on its start time.

    Diagnostics: ``replans`` (plan-generator calls), ``infeasible`` (of which without a feasible
    plan), ``rejected`` (requests refused).
    """

    name = "qlm"
    need_admit_by = True
    PARAMS = (*COMMON_PARAMS, "group_factor", "attainment", "inefficiency", "slo_ratio", "len_ratio",
              "min_history", "on_infeasible", "waiting_slo")

    def __init__(self, group_factor: int = 4, attainment: float = 0.95, inefficiency: float = 1.0,
                 slo_ratio: float = 2.0, len_ratio: float = 2.0, min_history: int = 20,
                 on_infeasible: str = "edf", waiting_slo: bool = True, **kw) -> None:
        super().__init__(**kw)
        self.group_factor = check_int("group_factor", group_factor, 1)
        self.attainment = check_fraction("attainment", attainment, low_open=True, high_open=True)
        self.inefficiency = check_positive("inefficiency", inefficiency)
        for nm, v in (("slo_ratio", slo_ratio), ("len_ratio", len_ratio)):
            if check_positive(nm, v) <= 1:
                raise ValueError(f"{nm} must be a finite number > 1, got {v!r}")
        self.slo_ratio, self.len_ratio = float(slo_ratio), float(len_ratio)
        self.min_history = check_int("min_history", min_history, 1)
        if on_infeasible not in ON_INFEASIBLE:
            raise ValueError(f"on_infeasible must be one of {ON_INFEASIBLE}, got {on_infeasible!r}")
        self.on_infeasible = on_infeasible
        self.waiting_slo = check_bool("waiting_slo", waiting_slo)
        self.z = NormalDist().inv_cdf(self.attainment)
        self._member: dict[str, int] = {}  # req_id -> group id
        self._classes: dict[tuple[int, int, int], int] = {}
        self._open: dict[int, tuple[int, int]] = {}  # class -> (open group, requests it received)
        self._grp_cls = np.zeros(64, np.int64)  # group -> class
        self._rank = np.zeros(64)  # group -> position key in the virtual queue
        self._n_groups = 0
        self._next_rank = 0.0
        self._stats = np.zeros((3, 16))  # per class: count, mean, M2 of finished output lengths (tokens)
        self._row_gen = np.zeros(1024)  # generated tokens per SnapshotCache row at the last frame
        self.replans = self.infeasible = self.rejected = 0

    # ------------------------------------------------------------------ groups and length statistics
    def on_finished(self, req_id: str, goodput: float, now: float) -> None:
        """Record the request's output length (tokens generated at its last frame) in its class."""
        gid = self._member.pop(req_id, None)
        rows = self._cache.rows_of([req_id])
        if gid is None or not rows.size or rows[0] >= self._row_gen.size:
            return
        length = float(self._row_gen[rows[0]])
        if length < 1:
            return
        c = int(self._grp_cls[gid])
        cnt, mean, m2 = self._stats[:, c]
        cnt += 1
        delta = length - mean
        mean += delta / cnt
        m2 += delta * (length - mean)
        self._stats[:, c] = (cnt, mean, m2)

    def _e2e_due(self, snap: Snapshot, remaining: np.ndarray) -> np.ndarray:
        """End-to-end SLO (absolute s) per request given its remaining output estimate (tokens)."""
        due = self.completion_due(snap)
        lat = snap.kind == LATENCY
        if lat.any():
            ttft, tbt = self.slo_columns(snap)
            tl = snap.arrival + ttft + np.maximum(snap.generated + remaining - 1.0, 0.0) * tbt
            due = np.where(lat, tl, due)
        return due

    def _assign(self, snap: Snapshot, new: np.ndarray, gid: np.ndarray, batch_size: int) -> None:
        """Classify new requests (in arrival order) into their class's open group (Algorithm 1)."""
        rel = self._e2e_due(snap, np.maximum(snap.len_bound - snap.generated, 1.0))[new] - snap.arrival[new]
        rel = np.where(snap.kind[new] == BEST_EFFORT, self.best_effort_deadline, rel)
        sb = np.floor(np.log(np.maximum(rel, 1e-3)) / math.log(self.slo_ratio)).astype(np.int64)
        lb = np.floor(np.log(np.maximum(snap.len_bound[new], 1.0)) / math.log(self.len_ratio)).astype(np.int64)
        cap = self.group_factor * batch_size
        for j in frame_order(new.size, snap.arrival[new]).tolist():
            i = int(new[j])
            key = (int(snap.kind[i]), int(sb[j]), int(lb[j]))
            c = self._classes.setdefault(key, len(self._classes))
            g, got = self._open.get(c, (-1, cap))
            if got >= cap:
                g, got = self._new_group(c), 0
            self._open[c] = (g, got + 1)
            gid[i] = g
            self._member[snap.ids[i]] = g
        if len(self._classes) > self._stats.shape[1]:
            grown = np.zeros((3, 2 * len(self._classes)))
            grown[:, : self._stats.shape[1]] = self._stats
            self._stats = grown

    def _new_group(self, cls: int) -> int:
        g = self._n_groups
        if g >= self._grp_cls.size:
            self._grp_cls = np.concatenate([self._grp_cls, np.zeros_like(self._grp_cls)])
            self._rank = np.concatenate([self._rank, np.zeros_like(self._rank)])
        self._grp_cls[g], self._rank[g] = cls, self._next_rank
        self._next_rank += 1.0
        self._n_groups += 1
        return g

    # ------------------------------------------------------------------ one frame
    def schedule(self, views: Sequence[RequestView], ctx: SchedContext) -> Decision:
        """Virtual-queue order of the groups (kept, or re-planned on a predicted SLO violation), FCFS
        inside a group; the first B run, displaced running requests are evicted; see the module docstring."""
        snap = self.begin_frame(views, ctx)
        if snap is None:
            return Decision([], [], {}, self.frame_id)
        n, B = snap.n, ctx.batch_size
        rows = snap.rows
        if rows.max() >= self._row_gen.size:
            self._row_gen = np.concatenate([self._row_gen, np.zeros(int(rows.max()) + 1)])
        self._row_gen[rows] = snap.generated
        member = self._member
        gid = np.fromiter((member.get(i, -1) for i in snap.ids), np.int64, n)
        new = np.flatnonzero(gid < 0)
        if new.size:
            self._assign(snap, new, gid, B)
        if len(member) > 2 * n + 1024:
            self._member = dict(zip(snap.ids, gid.tolist(), strict=True))
        est = self._estimates(snap, ctx, self._grp_cls[gid])
        uniq, inv = np.unique(gid, return_inverse=True)
        G = uniq.size
        work = np.bincount(inv, est["work"], G)
        var = np.bincount(inv, est["var"], G)
        C = np.zeros(G)
        np.maximum.at(C, inv, est["exec"])
        sC = np.zeros(G)
        np.maximum.at(sC, inv, est["exec_sd"])
        slo = np.full(G, np.inf)
        np.minimum.at(slo, inv, est["due"])
        start_by = np.full(G, np.inf)  # admission deadline of the group's never-scheduled members (s)
        if self.waiting_slo and snap.admit_by is not None:
            np.minimum.at(start_by, inv, np.where(np.isnan(snap.admit_by), np.inf, snap.admit_by))
        # a group that misses even at the head of the queue has no feasible position: its constraint is
        # relaxed (it still counts in the objective), otherwise one late request forces the fallback
        hopeless = np.minimum(slo - ctx.now - C - self.z * sC, start_by - ctx.now) < 0
        gorder = np.argsort(self._rank[uniq], kind="stable")
        ok = self._meets(gorder, work, var, C, sC, slo, start_by, ctx.now) | hopeless[gorder]
        if not ok.all():
            self.replans += 1
            plan = self._smith(work, var, C, sC, np.where(hopeless, np.inf, slo), ctx.now,
                               np.where(hopeless, np.inf, start_by))
            if plan is None:
                self.infeasible += 1
                plan = frame_order(G, slo, self._rank[uniq])
            gorder = plan
            self._rank[uniq[gorder]] = np.arange(G, dtype=float)
            self._next_rank = float(G)
        reject = np.zeros(n, bool)
        if self.on_infeasible == "drop":
            reject = self._drop(snap, est, inv, gorder, ctx.now)
        gpos = np.empty(G, np.int64)
        gpos[gorder] = np.arange(G)
        order = frame_order(n, reject, gpos[inv], snap.arrival)
        order = order[: n - int(reject.sum())]
        in_batch = np.zeros(n, bool)
        in_batch[order[:B]] = True
        displaced = np.flatnonzero(snap.running & ~in_batch)
        preempt = [] if not displaced.size or self.kv_fits(snap, in_batch, ctx) else displaced.tolist()
        ids = snap.ids
        pr = self.rank_priorities(order, snap, ctx)
        rej = np.flatnonzero(reject)
        self.rejected += rej.size
        return Decision([ids[i] for i in order[:B].tolist()], [ids[i] for i in preempt], pr, self.frame_id,
                        {"n": n, "groups": G, "replans": self.replans}, [ids[i] for i in rej.tolist()])

    def _estimates(self, snap: Snapshot, ctx: SchedContext, cls: np.ndarray) -> dict[str, np.ndarray]:
        """Per request: ``exec`` (s, Eq. 1 without waiting), ``exec_sd`` (s), ``work`` (engine s),
        ``var`` (s²) and ``due`` (absolute s); see the module docstring."""
        d, B, eps = ctx.token_time, ctx.batch_size, self.inefficiency
        g = snap.generated
        bound = np.maximum(snap.len_bound, g + 1.0)
        cnt, mean, m2 = self._stats[:, cls]
        hist = cnt >= self.min_history
        total = np.where(hist, np.clip(mean, g + 1.0, bound), bound)
        m = total - g
        sd = np.where(hist & (cnt > 1), np.sqrt(m2 / np.maximum(cnt - 1.0, 1.0)), 0.0)
        prefill = np.maximum(snap.input_len + g - snap.kv_tokens, 0.0) / ctx.prefill_rate
        return {
            "exec": prefill + m * eps * d,
            "exec_sd": sd * eps * d,
            "work": prefill + m * eps * d / B,
            "var": (sd * eps * d / B) ** 2,
            "due": self._e2e_due(snap, m),
        }

    def _meets(self, gorder: np.ndarray, work: np.ndarray, var: np.ndarray, C: np.ndarray, sC: np.ndarray,
               slo: np.ndarray, start_by: np.ndarray, now: float) -> np.ndarray:
        """Chance constraint (Eq. 12) and start deadline per group in the order ``gorder`` (bool array in
        that order)."""
        w, v = work[gorder], var[gorder]
        before = np.cumsum(w) - w
        vbefore = np.cumsum(v) - v
        ct = now + before + C[gorder]
        sd = np.sqrt(vbefore + sC[gorder] ** 2)
        return (ct + self.z * sd <= slo[gorder]) & (now + before <= start_by[gorder])

    def _smith(self, work: np.ndarray, var: np.ndarray, C: np.ndarray, sC: np.ndarray, slo: np.ndarray,
               now: float, start_by: np.ndarray | None = None) -> np.ndarray | None:
        """Order minimising Σ ct_j with every group within its deadline, or ``None`` if none exists.

        Group j must have ``Σ_{k<j} p_k <= D_j`` with ``p_k = work_k + z·sqrt(var_k)`` and
        ``D_j = min(slo_j - now - C_j - z·sC_j, start_by_j - now)``: ``1 | d̄ | Σ C`` with processing
        times ``p`` and deadlines ``D + p``; Smith's backward rule is exact for it (O(G log G))."""
        z = self.z
        p = work + z * np.sqrt(var)
        latest = slo - now - C - z * sC
        if start_by is not None:
            latest = np.minimum(latest, start_by - now)
        dl = latest + p
        G = p.size
        by_dl = np.argsort(-dl, kind="stable")
        T = float(p.sum())
        heap: list[tuple[float, float, int]] = []
        rev: list[int] = []
        k = 0
        tol = 1e-9 * max(T, 1.0)
        while len(rev) < G:
            while k < G and dl[by_dl[k]] >= T - tol:
                j = int(by_dl[k])
                heapq.heappush(heap, (-float(p[j]), -float(slo[j]), j))
                k += 1
            if not heap:
                return None
            j = heapq.heappop(heap)[2]
            rev.append(j)
            T -= float(p[j])
        return np.array(rev[::-1], np.int64)

    def _drop(self, snap: Snapshot, est: dict[str, np.ndarray], inv: np.ndarray, plan: np.ndarray,
              now: float) -> np.ndarray:
        """Admission control of Appendix A.3 (c) on the plan ``plan`` (group order): never-scheduled waiting
        requests whose completion misses their SLO are rejected; their work leaves the queue ahead of
        later groups. Members of groups that meet their constraint never miss (their completion is at
        most the group's)."""
        n = snap.n
        gpos = np.empty(plan.size, np.int64)
        gpos[plan] = np.arange(plan.size)
        order = frame_order(n, gpos[inv], snap.arrival)
        cand = ~snap.running & (snap.generated == 0) & (snap.kv_tokens == 0)
        reject = np.zeros(n, bool)
        gp = gpos[inv][order]
        bounds = np.flatnonzero(np.diff(gp)) + 1
        S = V = 0.0
        for seg in np.split(order, bounds):
            ct = now + S + est["exec"][seg]
            sd = np.sqrt(V + est["exec_sd"][seg] ** 2)
            miss = cand[seg] & (ct + self.z * sd > est["due"][seg])
            reject[seg[miss]] = True
            keep = seg[~miss]
            S += float(est["work"][keep].sum())
            V += float(est["var"][keep].sum())
        return reject
