"""Offline K-medoids clustering of the pattern-graph history (JITServe §4.1).

Per app, FasterPAM K-medoids (``kmedoids`` package; Schubert & Rousseeuw 2021) on the graph distance of
:func:`~jitflow_server.analyzer.matcher.pairwise_distances`; apps larger than ``max_sample`` graphs are
clustered on a random sample and the rest assigned to the nearest medoid. The result is stored with
:meth:`~jitflow_server.store.history.HistoryStore.set_clusters`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from jitflow_server.analyzer.matcher import KernelParams, pack_graphs, pairwise_distances
from jitflow_server.store.history import HistoryStore


@dataclass
class ClusterResult:
    """Outcome of clustering one app: ``k`` clusters, medoid ids, FasterPAM loss (sum of distances)."""

    app: str
    k: int
    medoid_ids: list[int]
    loss: float
    n_graphs: int
    seconds: float



def cluster_history(
    store: HistoryStore,
    app: str | None = None,
    k: int | None = None,
    *,
    seed: int = 0,
    max_sample: int = 2000,
) -> dict[str, ClusterResult]:
    """Offline K-medoids clustering (FasterPAM, ``kmedoids`` package) of each app's graphs.

    Args:
        app: one app, or all apps.
        k: clusters per app; default ``max(1, round(sqrt(n / 2)))``, capped at ``n``.
        seed: random seed (FasterPAM initialisation, sampling).
        max_sample: cluster at most this many graphs per app; the rest are assigned to the
            nearest medoid.

    Returns:
        ``{app: ClusterResult}``.

    Raises:
        ValueError: ``k < 1``. ImportError: the ``kmedoids`` package is missing.
    """
    import kmedoids

    if k is not None and k < 1:
        raise ValueError("k must be >= 1")
    apps = [app] if app is not None else store.apps()
    results: dict[str, ClusterResult] = {}
    rng = np.random.default_rng(seed)
    for a in apps:
        t_start = time.perf_counter()
        rows = store.candidates(a)
        n = len(rows)
        if n == 0:
            continue
        kk = min(n, k if k is not None else max(1, round(math.sqrt(n / 2))))
        codes: dict[str, int] = {}
        packed = pack_graphs([r.graph for r in rows], codes)
        sample = np.arange(n) if n <= max_sample else np.sort(rng.choice(n, size=max_sample, replace=False))
        ps = packed.take(sample)
        d = pairwise_distances(ps, ps, KernelParams()).astype(np.float64)
        np.fill_diagonal(d, 0.0)
        d = np.maximum(d, d.T)  # exact symmetry for FasterPAM
        if kk >= len(sample):
            med_local = np.arange(len(sample))
            loss = 0.0
        else:
            res = kmedoids.fasterpam(d, kk, random_state=seed)
            med_local = np.asarray(res.medoids, dtype=np.int64)
            loss = float(res.loss)
        med_rows = sample[med_local]
        dm = pairwise_distances(packed, packed.take(med_rows), KernelParams())
        labels = np.argmin(dm, axis=1)
        labels[med_rows] = np.arange(len(med_rows))  # a medoid belongs to its own cluster
        if n > max_sample:
            loss = float(dm[np.arange(n), labels].sum())
        store.set_clusters(a, {rows[i].id: int(labels[i]) for i in range(n)}, [rows[int(i)].id for i in med_rows])
        results[a] = ClusterResult(a, len(med_rows), [rows[int(i)].id for i in med_rows], loss, n,
                                   time.perf_counter() - t_start)
    return results
