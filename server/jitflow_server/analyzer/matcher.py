"""Incremental pattern-graph matching (JITServe §4.1; Tempo §4.1).

Given the *partial* graph of a running compound task (the stages seen so far, the last
one possibly still running), the matcher

1. restricts the history to the same app,
2. **prunes** candidates whose prefix structure diverges: fewer stages than seen, or a
   different stage identity (stage name + set of model/tool ids) at any seen stage,
3. **scores** the rest with Gaussian-kernel similarity on the super-node chain, comparing
   the (shorter) partial graph to the prefix of the (longer) candidate:

   * node similarity of stage j: ``k(out_p[j], out_c[j])`` on aggregate output tokens
     (only stages whose outputs are known),
   * edge similarity of stage j: ``k(in_p[j], in_c[j])`` on aggregate input tokens
     (known as soon as a stage's calls are issued),
   * ``k(a, b) = exp(-(ln(1+a) - ln(1+b))^2 / (2 σ^2))`` (log space, so the kernel is
     scale-free across 13-token and 5,000-token stages; default σ = 0.5 for both),
   * ``score = w_node·mean(node) + (1 - w_node)·mean(edge)`` (default ``w_node = 0.5``;
     edges only when no output is known yet), in ``[0, 1]``, 1 for an identical prefix,
4. returns the best candidate (:class:`Match`) and bumps its reuse weight in the store.

The history of an app is held in memory as padded numpy arrays (one row per graph, one
column per stage), rebuilt when the store changes, so a match is a handful of vectorised
operations. When the store has been clustered (K-medoids, :func:`~jitflow_server.analyzer.clustering.cluster_history`),
the ``"cluster"`` strategy scores the medoids first and searches only the members of the
``cluster_top`` best clusters (plus graphs inserted after clustering), falling back to a
full scan when they are all pruned.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jitflow_server.store.graph import PatternGraph

if TYPE_CHECKING:  # pragma: no cover
    from jitflow_server.analyzer.subdeadline import CallTimeModel
    from jitflow_server.store.history import HistoryStore

__all__ = ["Match", "Matcher", "KernelParams", "PackedGraphs", "pack_graphs", "pairwise_distances", "similarity"]

STRATEGIES = ("exhaustive", "cluster", "auto")


@dataclass(frozen=True)
class KernelParams:
    """Gaussian-kernel parameters (log-token space).

    Attributes:
        sigma_node: bandwidth on ``ln(1+output tokens)`` of a stage (> 0).
        sigma_edge: bandwidth on ``ln(1+input tokens)`` of a stage (> 0).
        w_node: weight of node similarity (``1 - w_node`` for edges), in [0, 1].

    Raises:
        ValueError: out-of-range values.
    """

    sigma_node: float = 0.5
    sigma_edge: float = 0.5
    w_node: float = 0.5

    def __post_init__(self) -> None:
        if not (self.sigma_node > 0 and self.sigma_edge > 0):
            raise ValueError("kernel bandwidths must be > 0")
        if not 0.0 <= self.w_node <= 1.0:
            raise ValueError("w_node must be in [0, 1]")


@dataclass
class Match:
    """Result of :meth:`Matcher.match`.

    Attributes:
        graph: the matched historical :class:`PatternGraph` (complete).
        graph_id: its id in the history store (row index for :meth:`Matcher.from_graphs`).
        score: similarity in [0, 1] (1 = identical observed prefix).
        n_candidates: candidates left after prefix pruning (among those searched).
        n_searched: graphs considered before pruning (all of the app for a full scan).
        neighbours: the ``top_k`` best ``(graph, graph_id, score)``, best first (just the best
            match when ``top_k == 1``).
    """

    graph: PatternGraph
    graph_id: int
    score: float
    n_candidates: int = 0
    n_searched: int = 0
    neighbours: list[tuple[PatternGraph, int, float]] = field(default_factory=list)

    def shares(self, time_model: CallTimeModel | None = None) -> list[float]:
        """φ(0..S-1) estimated from this match.

        With one neighbour: φ of the matched graph (JITServe §4.1,
        :func:`~jitflow_server.analyzer.subdeadline.stage_shares`). With ``top_k > 1``
        neighbours (our extension): the score-weighted mean of the neighbours' φ, each taken
        as 1 beyond its last stage; length = the longest neighbour; still non-decreasing in
        [0, 1] and 1 at the end.
        """
        from jitflow_server.analyzer.subdeadline import DEFAULT_TIME_MODEL, stage_shares

        tm = time_model or DEFAULT_TIME_MODEL
        if len(self.neighbours) <= 1:
            return stage_shares(self.graph, tm)
        s_max = max(g.n_stages for g, _, _ in self.neighbours)
        acc = np.zeros(s_max)
        wsum = 0.0
        for g, _, sc in self.neighbours:
            w = max(sc, 1e-12)
            phi = np.ones(s_max)
            phi[: g.n_stages] = stage_shares(g, tm)
            acc += w * phi
            wsum += w
        out = np.minimum(acc / wsum, 1.0)
        out = np.maximum.accumulate(out)
        out[-1] = 1.0
        return [float(x) for x in out]


@dataclass
class PackedGraphs:
    """Padded array form of many graphs (rows) x stages (columns).

    Attributes:
        ident: ``(N, Smax)`` int32 interned stage identities, ``-1`` beyond a graph's stages.
        lo: ``(N, Smax)`` float64 ``ln(1+aggregate output)``; ``nan`` for open stages / padding.
        li: ``(N, Smax)`` float64 ``ln(1+aggregate input)``; 0 for padding.
        ns: ``(N,)`` int32 stage counts.
    """

    ident: np.ndarray
    lo: np.ndarray
    li: np.ndarray
    ns: np.ndarray

    def __len__(self) -> int:
        return len(self.ns)

    def take(self, rows: np.ndarray) -> PackedGraphs:
        """Subset of rows."""
        return PackedGraphs(self.ident[rows], self.lo[rows], self.li[rows], self.ns[rows])


def pack_graphs(graphs: Sequence[PatternGraph], codes: dict[str, int], smax: int | None = None) -> PackedGraphs:
    """Pack graphs into :class:`PackedGraphs`, interning identities into ``codes`` (mutated)."""
    n = len(graphs)
    smax = max([g.n_stages for g in graphs] + [1]) if smax is None else smax
    ident = np.full((n, smax), -1, dtype=np.int32)
    lo = np.full((n, smax), np.nan)
    li = np.zeros((n, smax))
    ns = np.zeros(n, dtype=np.int32)
    for r, g in enumerate(graphs):
        a = g.arrays
        s = a.n_stages
        ns[r] = s
        for j, idt in enumerate(a.identity):
            c = codes.get(idt)
            if c is None:
                c = codes[idt] = len(codes)
            ident[r, j] = c
        lo[r, :s] = np.log1p(a.out)
        li[r, :s] = np.log1p(a.inp)
    return PackedGraphs(ident, lo, li, ns)


def _stage_sims(a: PackedGraphs, b: PackedGraphs, kp: KernelParams) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage similarity of every (row of a) x (row of b) pair on the common columns.

    Returns ``(sim, valid)`` of shape ``(Na, Nb, S)`` where ``S = min(Smax_a, Smax_b)``; a stage's
    similarity is 0 when identities differ, else the node/edge kernel mix (edge only if an
    output is unknown).
    """
    s = min(a.ident.shape[1], b.ident.shape[1])
    ia, ib = a.ident[:, None, :s], b.ident[None, :, :s]
    valid = (ia >= 0) & (ib >= 0)
    same = valid & (ia == ib)
    de = a.li[:, None, :s] - b.li[None, :, :s]
    edge = np.exp(-(de * de) / (2 * kp.sigma_edge**2))
    dn = a.lo[:, None, :s] - b.lo[None, :, :s]
    with np.errstate(invalid="ignore"):
        node = np.exp(-(dn * dn) / (2 * kp.sigma_node**2))
    known = ~np.isnan(node)
    mix = np.where(known, kp.w_node * np.where(known, node, 0.0) + (1 - kp.w_node) * edge, edge)
    return np.where(same, mix, 0.0), valid


def pairwise_distances(
    a: PackedGraphs, b: PackedGraphs | None = None, kp: KernelParams | None = None, chunk: int = 256
) -> np.ndarray:
    """Graph distance matrix ``(Na, Nb)`` float32 for K-medoids clustering.

    ``d(x, y) = 1 - Σ_{j < min(Sx,Sy)} sim_j(x, y) / max(Sx, Sy)``: per-stage kernel similarity
    on the common prefix (0 where identities diverge), normalised by the longer graph so
    different depths are far apart. Symmetric, 0 on identical graphs, in [0, 1].
    """
    kp = kp or KernelParams()
    b = a if b is None else b
    out = np.empty((len(a), len(b)), dtype=np.float32)
    for i in range(0, len(a), chunk):
        sub = a.take(np.arange(i, min(i + chunk, len(a))))
        sim, _ = _stage_sims(sub, b, kp)
        denom = np.maximum(sub.ns[:, None], b.ns[None, :]).astype(np.float64)
        out[i : i + len(sub)] = 1.0 - sim.sum(axis=2) / np.maximum(denom, 1.0)
    return out


def similarity(partial: PatternGraph, other: PatternGraph, kp: KernelParams | None = None) -> float:
    """Prefix similarity in [0, 1] of two graphs: the shorter compared to the prefix of the longer.

    Returns 0.0 if their identities diverge on the common prefix. Same kernel and mixing as
    :meth:`Matcher.match`.
    """
    kp = kp or KernelParams()
    codes: dict[str, int] = {}
    pa = pack_graphs([partial], codes)
    pb = pack_graphs([other], codes)
    m = int(min(pa.ns[0], pb.ns[0]))
    if m == 0:
        return 0.0
    if not np.array_equal(pa.ident[0, :m], pb.ident[0, :m]):
        return 0.0
    return float(_prefix_scores(pa.ident[0, :m], pa.lo[0, :m], pa.li[0, :m], pb.lo[:, :m], pb.li[:, :m], kp)[0])


def _prefix_scores(
    pid: np.ndarray, plo: np.ndarray, pli: np.ndarray, clo: np.ndarray, cli: np.ndarray, kp: KernelParams
) -> np.ndarray:
    """Scores of pruned candidates (``clo``/``cli``: their first ``len(pid)`` stage columns)
    against a partial prefix; shape ``(N,)``."""
    s = len(pid)
    de = cli - pli
    edge = np.exp(-(de * de) * (0.5 / kp.sigma_edge**2)).sum(axis=1) / s
    known = ~np.isnan(plo)
    nk = int(known.sum())
    if nk == 0:
        return edge
    dn = (clo[:, known] if nk < s else clo) - plo[known]
    node = np.exp(-(dn * dn) * (0.5 / kp.sigma_node**2)).sum(axis=1) / nk
    return kp.w_node * node + (1 - kp.w_node) * edge


@dataclass
class _AppIndex:
    ids: np.ndarray
    graphs: list[PatternGraph]
    packed: PackedGraphs
    labels: np.ndarray  # cluster label per row, -1 = unclustered
    medoid_rows: np.ndarray  # row index of each cluster's medoid
    medoid_labels: np.ndarray
    unclustered: np.ndarray
    members: dict[int, np.ndarray] = field(default_factory=dict)
    #: sorted LLM output lengths per stage index over ``graphs`` (built on first use)
    stage_pools: dict[int, tuple[int, ...]] | None = None


class Matcher:
    """Incremental pattern-graph matcher over a history store (JITServe §4.1).

    Args:
        store: a :class:`~jitflow_server.store.history.HistoryStore` (or ``None`` with
            :meth:`from_graphs`).
        kernel: Gaussian-kernel parameters (:class:`KernelParams`).
        strategy: ``"exhaustive"`` (score every unpruned graph), ``"cluster"`` (medoids first,
            needs :func:`~jitflow_server.analyzer.clustering.cluster_history`; full scan if not clustered) or ``"auto"``
            (cluster search when clusters exist and the app has more than ``auto_threshold``
            graphs).
        cluster_top: clusters searched by the cluster strategy.
        bump: bump the matched graph's reuse weight in the store on every match (default).
        top_k: neighbours kept in :attr:`Match.neighbours`; ``1`` (default) is the paper's
            single best match, ``> 1`` makes :meth:`Match.shares` a score-weighted ensemble.

    Thread-safe (one lock around the in-memory index). Raises ValueError on bad options.
    """

    def __init__(
        self,
        store: HistoryStore | None = None,
        *,
        kernel: KernelParams | None = None,
        strategy: str = "auto",
        cluster_top: int = 3,
        auto_threshold: int = 2000,
        bump: bool = True,
        top_k: int = 1,
    ) -> None:
        if top_k < 1:
            raise ValueError("top_k must be >= 1")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if cluster_top < 1:
            raise ValueError("cluster_top must be >= 1")
        self.store = store
        self.kernel = kernel or KernelParams()
        self.strategy = strategy
        self.cluster_top = cluster_top
        self.auto_threshold = auto_threshold
        self.bump = bump
        self.top_k = int(top_k)
        self._codes: dict[str, int] = {}
        self._index: dict[str, _AppIndex] = {}
        self._gen: int | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_graphs(cls, graphs: Sequence[PatternGraph], **kw: object) -> Matcher:
        """An in-memory matcher over ``graphs`` (ids = positions in the list); no store, no bumps."""
        m = cls(None, **kw)  # type: ignore[arg-type]
        by_app: dict[str, list[int]] = {}
        for i, g in enumerate(graphs):
            by_app.setdefault(g.app, []).append(i)
        for app, rows in by_app.items():
            m._index[app] = m._build([(i, graphs[i], -1, False) for i in rows])
        return m

    # ------------------------------------------------------------------ index
    def _build(self, rows: list[tuple[int, PatternGraph, int, bool]]) -> _AppIndex:
        graphs = [r[1] for r in rows]
        packed = pack_graphs(graphs, self._codes)
        labels = np.array([r[2] if r[2] is not None else -1 for r in rows], dtype=np.int64)
        medoid_rows = np.array([i for i, r in enumerate(rows) if r[3] and r[2] is not None and r[2] >= 0],
                               dtype=np.int64)
        idx = _AppIndex(
            ids=np.array([r[0] for r in rows], dtype=np.int64),
            graphs=graphs,
            packed=packed,
            labels=labels,
            medoid_rows=medoid_rows,
            medoid_labels=labels[medoid_rows] if len(medoid_rows) else np.zeros(0, dtype=np.int64),
            unclustered=np.flatnonzero(labels < 0),
        )
        for lab in np.unique(labels[labels >= 0]):
            idx.members[int(lab)] = np.flatnonzero(labels == lab)
        return idx

    def refresh(self) -> None:
        """Drop the in-memory index; it is rebuilt from the store on the next match."""
        with self._lock:
            if self.store is not None:
                self._index.clear()
                self._gen = None

    def _app_index(self, app: str) -> _AppIndex | None:
        if self.store is not None:
            gen = self.store.generation
            if gen != self._gen:
                self._index.clear()
                self._gen = gen
            if app not in self._index:
                rows = [(r.id, r.graph, r.cluster, r.is_medoid) for r in self.store.candidates(app)]
                if not rows:
                    return None
                self._index[app] = self._build(rows)
        return self._index.get(app)

    def stage_outputs(self, app: str, stage: int) -> tuple[int, ...]:
        """Sorted LLM output lengths (tokens) of stage index ``stage`` over ``app``'s history graphs
        (``()`` without history). Computed once per index build."""
        with self._lock:
            idx = self._app_index(app)
            if idx is None:
                return ()
            if idx.stage_pools is None:
                pools: dict[int, list[int]] = {}
                for g in idx.graphs:
                    for n in g.nodes:
                        if n.kind == "llm" and n.output_len:
                            pools.setdefault(n.stage, []).append(int(n.output_len))
                idx.stage_pools = {k: tuple(sorted(v)) for k, v in pools.items()}
            return idx.stage_pools.get(int(stage), ())

    # ------------------------------------------------------------------ matching
    def match(
        self,
        partial: PatternGraph,
        *,
        bump: bool | None = None,
        strategy: str | None = None,
        top_k: int | None = None,
    ) -> Match | None:
        """Best historical match for ``partial`` (same app), or ``None`` if every candidate is pruned.

        Args:
            partial: the running task's graph (stages seen so far; the last may be open).
            bump: override the matcher's ``bump`` setting for this call.
            strategy: override the matcher's strategy for this call.
            top_k: override the matcher's ``top_k`` for this call.

        Raises:
            ValueError: ``partial`` has no stage, or unknown strategy.
        """
        if partial.n_stages == 0:
            raise ValueError("partial graph has no stage yet")
        strategy = strategy or self.strategy
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        with self._lock:
            idx = self._app_index(partial.app)
            if idx is None:
                return None
            res = self._match_index(idx, partial, strategy)
        if res is None:
            return None
        cand, sc, n_searched = res
        kk = min(len(cand), top_k or self.top_k)
        if kk == 1:
            order = np.array([int(np.argmax(sc))])
        else:
            part = np.argpartition(-sc, kk - 1)[:kk]
            order = part[np.argsort(-sc[part], kind="stable")]
        nb = [(idx.graphs[int(cand[o])], int(idx.ids[cand[o]]), float(sc[o])) for o in order]
        m = Match(nb[0][0], nb[0][1], nb[0][2], len(cand), n_searched, nb)
        if (self.bump if bump is None else bump) and self.store is not None:
            self.store.bump(m.graph_id)
        return m

    def _partial_arrays(self, partial: PatternGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        a = partial.arrays
        pid = np.empty(a.n_stages, dtype=np.int32)
        for j, idt in enumerate(a.identity):
            c = self._codes.get(idt)
            if c is None:  # identity never seen in history: every candidate diverges
                return None
            pid[j] = c
        return pid, np.log1p(a.out), np.log1p(a.inp)

    def _match_index(
        self, idx: _AppIndex, partial: PatternGraph, strategy: str
    ) -> tuple[np.ndarray, np.ndarray, int] | None:
        pa = self._partial_arrays(partial)
        if pa is None:
            return None
        pid, plo, pli = pa
        s = len(pid)
        p = idx.packed
        if s > p.ident.shape[1]:
            return None
        use_cluster = len(idx.medoid_rows) > 0 and (
            strategy == "cluster" or (strategy == "auto" and len(p) > self.auto_threshold)
        )
        if use_cluster:
            rows = self._cluster_rows(idx, pid, plo, pli)
            res = self._score_rows(idx, rows, pid, plo, pli)
            if res is not None:
                return res
        return self._score_rows(idx, None, pid, plo, pli)

    def _score_rows(
        self, idx: _AppIndex, rows: np.ndarray | None, pid: np.ndarray, plo: np.ndarray, pli: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, int] | None:
        """Prune then score; returns ``(candidate rows, scores, n_searched)`` or None."""
        p = idx.packed
        s = len(pid)
        if rows is None:
            ok = (p.ns >= s) & (p.ident[:, :s] == pid).all(axis=1)
            cand = np.flatnonzero(ok)
            n_searched = len(p)
        else:
            sub_ok = (p.ns[rows] >= s) & (p.ident[rows, :s] == pid).all(axis=1)
            cand = rows[sub_ok]
            n_searched = len(rows)
        if len(cand) == 0:
            return None
        sc = _prefix_scores(pid, plo, pli, p.lo[cand, :s], p.li[cand, :s], self.kernel)
        return cand, sc, n_searched

    def _cluster_rows(self, idx: _AppIndex, pid: np.ndarray, plo: np.ndarray, pli: np.ndarray) -> np.ndarray:
        """Rows of the ``cluster_top`` clusters whose medoids best fit the prefix, plus unclustered rows."""
        p = idx.packed
        med = p.take(idx.medoid_rows)
        s = len(pid)
        q = PackedGraphs(pid[None, :], plo[None, :], pli[None, :], np.array([s], dtype=np.int32))
        sim, _ = _stage_sims(q, med, self.kernel)  # (1, M, min(s, Smax))
        score = sim[0].sum(axis=1) / s
        top = np.argsort(-score, kind="stable")[: self.cluster_top]
        parts = [idx.members[int(idx.medoid_labels[t])] for t in top] + [idx.unclustered]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def relative_error(est: float, truth: float) -> float:
    """``|est - truth| / |truth|`` (``0`` if both are 0, ``inf`` if only truth is 0)."""
    if truth == 0:
        return 0.0 if est == 0 else math.inf
    return abs(est - truth) / abs(truth)
