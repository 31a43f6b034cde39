"""The compiled form of a fitted quantile regression forest: exact, fast prediction of several quantiles
at once (JITServe §4.1; Meinshausen 2006). Saved length models reference this class by its path
``jitflow_server.analyzer.length_forest.CompiledForest``; keep it here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class CompiledForest:
    """Fast exact prediction path for a fitted ``RandomForestQuantileRegressor`` (single output).

    quantile-forest's ``predict`` parallelises over trees with joblib and pools leaf samples in
    general-purpose code: about 10-15 ms for one request on this machine. This class walks each
    tree with ``tree_.apply`` and pools the stored leaf samples (ragged arrays, one sort per request),
    which reproduces quantile-forest's default estimator (``weighted_quantile=True,
    weighted_leaves=False``, linear interpolation; equal to ~1e-12) in ~1 ms. Verified against
    quantile-forest by ``tests/test_length_predictor.py``.

    The pooled samples are not sorted: every training target is stored as its rank among the distinct
    targets (a few hundred: lengths are integers), one ``bincount`` per batch counts each row's ranks
    and a cumulative sum locates the order statistics. For a batch of 256 rows this takes 5 ms where a
    sort of the 1.6 M pooled samples took 22 ms (measured side by side, same result bit for bit).
    """

    def __init__(self, forest: Any) -> None:
        qf = forest.forest_
        ytl = np.asarray(qf.y_train_leaves)  # (n_trees, max_nodes, n_outputs, max_samples_leaf), 1-based, 0 pad
        yt = np.asarray(qf.y_train, dtype=np.float64)
        yt = yt.reshape(-1) if yt.ndim == 1 else yt[0]
        self.trees = [e.tree_ for e in forest.estimators_]
        offs = np.cumsum([0] + [t.node_count for t in self.trees])
        self.node_off = offs[:-1].astype(np.int64)
        starts = np.zeros(offs[-1], dtype=np.int64)
        lens = np.zeros(offs[-1], dtype=np.int64)
        chunks = []
        pos = 0
        for ti, t in enumerate(self.trees):
            idx = ytl[ti, : t.node_count, 0, :]
            cnt = (idx > 0).sum(axis=1)
            nodes = np.nonzero(cnt)[0]
            for node in nodes:
                v = yt[idx[node, : cnt[node]] - 1]
                starts[offs[ti] + node] = pos
                lens[offs[ti] + node] = len(v)
                chunks.append(v)
                pos += len(v)
        self.starts, self.lens = starts, lens
        vals = np.concatenate(chunks) if chunks else np.zeros(0)
        self.uniq, rank = np.unique(vals, return_inverse=True)
        self.rank = rank.astype(np.int32)

    def leaves(self, X: np.ndarray) -> np.ndarray:
        """Global leaf ids, shape ``(n, n_trees)``, for float32 rows ``X``."""
        X = np.ascontiguousarray(X, dtype=np.float32)
        return np.stack([t.apply(X) + o for t, o in zip(self.trees, self.node_off, strict=True)], axis=1)

    def predict_quantiles(self, X: np.ndarray, quantiles: Sequence[float]) -> np.ndarray:
        """Quantiles of the pooled leaf samples for each row of ``X``; shape ``(n, len(quantiles))``."""
        L = self.leaves(X)
        n, T = L.shape
        st = self.starts[L].ravel()
        ln = self.lens[L].ravel()
        idx = np.arange(int(ln.sum())) + np.repeat(st - np.cumsum(ln) + ln, ln)
        seg = ln.reshape(n, T).sum(axis=1)
        U = len(self.uniq)
        key = np.repeat(np.arange(n, dtype=np.int64) * U, seg) + self.rank[idx]
        cum = np.bincount(key, minlength=n * U).reshape(n, U).cumsum(axis=1)
        out = np.empty((n, len(quantiles)))
        for j, q in enumerate(quantiles):
            pos = q * (seg - 1)
            lo = np.floor(pos).astype(np.int64)
            hi = np.minimum(lo + 1, seg - 1)
            fr = pos - lo
            # the i-th smallest pooled sample is the first distinct value whose cumulative count exceeds i
            v_lo = self.uniq[(cum <= lo[:, None]).sum(axis=1)]
            v_hi = self.uniq[(cum <= hi[:, None]).sum(axis=1)]
            out[:, j] = v_lo * (1 - fr) + v_hi * fr
        return out

    def predict(self, X: np.ndarray, quantile: float) -> np.ndarray:
        """q-quantile of the pooled leaf samples for each row of ``X``; shape ``(n,)``."""
        return self.predict_quantiles(X, [quantile])[:, 0]
