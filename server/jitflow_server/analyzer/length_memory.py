"""Prompt memory of the length model: the output lengths of the most similar past prompts.

Prompt text alone carries little of a response's length (docs/analyzer.md, "Text representation"):
a 32-bucket hashed bag of words, TF-IDF projected to 32 or 64 SVD dimensions and keyword cues all
leave the median bound/true near 1.8 on unseen prompts. What does carry it is how long the responses
to the *same or nearly the same* prompt were: the same instruction answered by another model has a
log-length correlation of 0.78-0.83 with it on AlpacaEval. The memory makes that available to the
forest: TF-IDF vectors (word 1-2 grams, sublinear tf, fitted on the training prompts) of every
remembered prompt with its output length, and for a new prompt six features of its ``k`` nearest
remembered prompts by cosine similarity. The forest learns how much to trust them from the similarity
columns: on prompts no one has seen it falls back on the text features.

scikit-learn's ``TfidfVectorizer`` does the text side; the neighbour search is one sparse product.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: Columns of :meth:`PromptMemory.features`.
MEMORY_FEATURE_NAMES: tuple[str, ...] = (
    "nn_top_log_len", "nn_wmean_log_len", "nn_max_log_len", "nn_min_log_len", "nn_top_sim", "nn_mean_sim",
)


class PromptMemory:
    """Output lengths of remembered prompts, queried by TF-IDF cosine similarity (k nearest).

    Args:
        k: neighbours per query (default 8).
        max_items: remembered prompts kept (the most recent; default 50 000). Memory use is about
            the prompts' distinct 1-2 grams: ~1 MB for the 2 400 AlpacaEval training prompts.
    Raises ``ValueError`` for ``k < 1`` or ``max_items < k``.
    """

    def __init__(self, k: int = 8, max_items: int = 50_000) -> None:
        if k < 1:
            raise ValueError("k must be >= 1")
        if max_items < k:
            raise ValueError("max_items must be >= k")
        self.k = int(k)
        self.max_items = int(max_items)
        self.vectorizer: Any = None
        self.matrix: Any = None  # scipy.sparse CSR, (n_items, vocabulary), rows l2-normalised
        self.log_len = np.zeros(0)

    @property
    def n_items(self) -> int:
        """Remembered prompts."""
        return int(self.log_len.shape[0])

    def fit(self, prompts: Sequence[str], lengths: Sequence[int]) -> PromptMemory:
        """Fit the vocabulary on ``prompts`` and remember them with their output ``lengths`` (tokens).

        Raises ``ValueError`` on mismatched inputs or fewer than ``k + 1`` prompts.
        """
        from sklearn.feature_extraction.text import TfidfVectorizer

        if len(prompts) != len(lengths):
            raise ValueError(f"{len(prompts)} prompts but {len(lengths)} lengths")
        if len(prompts) <= self.k:
            raise ValueError(f"the prompt memory needs more than k={self.k} prompts, got {len(prompts)}")
        self.vectorizer = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, dtype=np.float32)
        self.matrix = self.vectorizer.fit_transform(list(prompts)).tocsr()
        self.log_len = np.log1p(np.asarray(lengths, dtype=np.float64))
        self._trim()
        return self

    def extend(self, prompts: Sequence[str], lengths: Sequence[int]) -> PromptMemory:
        """A copy that also remembers ``prompts`` (vocabulary unchanged: words never seen in fitting are
        ignored). Does not modify ``self``. Raises ``ValueError`` if unfitted or on mismatched inputs."""
        import scipy.sparse as sp

        if self.vectorizer is None:
            raise ValueError("extend needs a fitted memory")
        if len(prompts) != len(lengths):
            raise ValueError(f"{len(prompts)} prompts but {len(lengths)} lengths")
        new = PromptMemory(self.k, self.max_items)
        new.vectorizer = self.vectorizer
        if len(prompts):
            new.matrix = sp.vstack([self.matrix, self.vectorizer.transform(list(prompts))]).tocsr()
            new.log_len = np.concatenate([self.log_len, np.log1p(np.asarray(lengths, dtype=np.float64))])
        else:
            new.matrix, new.log_len = self.matrix, self.log_len
        new._trim()
        return new

    def state(self) -> dict[str, Any]:
        """Plain-data form for saving (no jitflow classes: saved models stay loadable across refactors)."""
        return {"k": self.k, "max_items": self.max_items, "vectorizer": self.vectorizer, "matrix": self.matrix,
                "log_len": self.log_len}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PromptMemory:
        """Inverse of :meth:`state`. Raises ``KeyError``/``ValueError`` on a malformed state."""
        m = cls(int(state["k"]), int(state["max_items"]))
        m.vectorizer, m.matrix = state["vectorizer"], state["matrix"]
        m.log_len = np.asarray(state["log_len"], dtype=np.float64)
        return m

    def _trim(self) -> None:
        if self.n_items > self.max_items:
            self.matrix = self.matrix[-self.max_items:]
            self.log_len = self.log_len[-self.max_items:]

    def features(self, prompts: Sequence[str], exclude: Sequence[int | Sequence[int]] | None = None) -> np.ndarray:
        """Shape ``(len(prompts), 6)`` float64, columns :data:`MEMORY_FEATURE_NAMES`: the mean
        ``log1p(length)`` of the most similar neighbours (similarity within 0.01 of the top), the
        similarity-weighted mean, max and min of the neighbours' ``log1p(length)``, the top and mean
        cosine similarity.

        ``exclude[i]`` (remembered row indices, one int or a sequence; ``-1`` for none) are left out of
        prompt ``i``'s neighbours: a training prompt must not find its own response. Unfitted memory:
        all zeros.
        """
        out = np.zeros((len(prompts), len(MEMORY_FEATURE_NAMES)))
        if self.vectorizer is None or not len(prompts):
            return out
        sims = (self.vectorizer.transform(list(prompts)) @ self.matrix.T).toarray()
        if exclude is not None:
            for i, ex in enumerate(exclude):
                rows = [ex] if isinstance(ex, (int, np.integer)) else list(ex)
                rows = [r for r in rows if r >= 0]
                if rows:
                    sims[i, rows] = -1.0
        k = min(self.k, sims.shape[1])
        idx = np.argpartition(-sims, k - 1, axis=1)[:, :k]
        w = np.clip(np.take_along_axis(sims, idx, axis=1), 0.0, None)
        ly = self.log_len[idx]
        wsum = w.sum(axis=1)
        top = w.max(axis=1, keepdims=True)
        best = w >= top - 0.01  # the most similar prompt(s): ties are the same prompt answered repeatedly
        out[:, 0] = (ly * best).sum(axis=1) / best.sum(axis=1)
        out[:, 1] = np.where(wsum > 0, (w * ly).sum(axis=1) / np.maximum(wsum, 1e-12), ly.mean(axis=1))
        out[:, 2] = ly.max(axis=1)
        out[:, 3] = ly.min(axis=1)
        out[:, 4] = top[:, 0]
        out[:, 5] = w.mean(axis=1)
        return out
