"""Output-length upper bound: a quantile regression forest with online refinement and calibration.

JITServe §4.1 "Estimating Response Length Upper-bound" (thesis §4.1): a quantile
regression forest (QRF, Meinshausen 2006; the ``quantile-forest`` package) predicts a high quantile
``q`` (default 0.9) of a request's *total* output length (tokens) from features of its prompt and of
its serving context (app, model, stage). While the response is being generated the bound is refined:
with ``k`` tokens generated, the forest is queried again with features of the generated prefix and
``k`` itself, and the bound never falls below ``k``.

This module holds the forest (:class:`LengthPredictor`: ``fit``, ``predict``, ``refit``, ``save``/``load``
with a format version stamp, :class:`LengthModelError` on bad files). Beside it: ``tokens.py`` (the
:class:`~jitflow_server.analyzer.tokens.TokenCounter` used for every count, passed as ``counter=`` by
whoever knows the served model, else the process-wide default), ``length_features.py``
(data-independent prompt/prefix features and the context encoder), ``length_calibration.py`` (the online
conformal calibrator, the running-quantile fallback, ``finalize_bound``) and ``length_data.py``
(AlpacaEval and telemetry loading, training rows).

The asynchronous, batched serving wrapper is :mod:`jitflow_server.analyzer.length_service`.

Saved models are pickles of a dict (:meth:`LengthPredictor.save`) whose only jitflow class is
:class:`CompiledForest`, stored under its path ``jitflow_server.analyzer.length.CompiledForest``: it must
stay in this module (or be re-exported from it) for saved models to load.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jitflow_server.analyzer.length_calibration import (
    CALIBRATION_BUCKETS,
    DEFAULT_QUANTILE,
    calibration_bucket,
    finalize_bound,
)
from jitflow_server.analyzer.length_data import LengthExample, build_rows
from jitflow_server.analyzer.length_features import (
    FEATURE_VERSION,
    PREFIX_FEATURE_NAMES,
    PROMPT_FEATURE_NAMES,
    ContextEncoder,
    prefix_features,
    prompt_features,
)
from jitflow_server.analyzer.tokens import TokenCounter, get_token_counter

logger = logging.getLogger(__name__)

#: Version of the saved-model layout; :meth:`LengthPredictor.load` rejects other versions.
FORMAT_VERSION = 1
#: Marker written at the top of every saved model.
MODEL_MAGIC = "jitflow-length-qrf"
#: Generated-token counts at which refinement training rows are built (JITServe re-predicts every
#: 50 tokens; the forest interpolates between grid points because ``k`` is a feature).
DEFAULT_REFINE_GRID: tuple[int, ...] = (50, 100, 150, 200, 300, 400, 600, 800, 1200, 1600)
ENV_MODEL_PATH = "JITFLOW_LENGTH_MODEL"


class LengthModelError(Exception):
    """A length model file is missing, unreadable, corrupt, of another format version, or unusable."""


def default_model_path() -> Path:
    """Path of the default length model: ``$JITFLOW_LENGTH_MODEL`` or ``~/.cache/jitflow/models/length-qrf.pkl``."""
    env = os.environ.get(ENV_MODEL_PATH)
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/jitflow/models/length-qrf.pkl").expanduser()


class CompiledForest:
    """Fast exact prediction path for a fitted ``RandomForestQuantileRegressor`` (single output).

    quantile-forest's ``predict`` parallelises over trees with joblib and pools leaf samples in
    general-purpose code: about 10-15 ms for one request on this machine. This class walks each
    tree with ``tree_.apply`` and pools the stored leaf samples (ragged arrays, one sort per request),
    which reproduces quantile-forest's default estimator (``weighted_quantile=True,
    weighted_leaves=False``, linear interpolation; equal to ~1e-12) in ~1 ms. Verified against
    quantile-forest by ``tests/test_length_predictor.py``.
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
        self.vals = np.concatenate(chunks) if chunks else np.zeros(0)

    def leaves(self, X: np.ndarray) -> np.ndarray:
        """Global leaf ids, shape ``(n, n_trees)``, for float32 rows ``X``."""
        X = np.ascontiguousarray(X, dtype=np.float32)
        return np.stack([t.apply(X) + o for t, o in zip(self.trees, self.node_off, strict=True)], axis=1)

    def predict(self, X: np.ndarray, quantile: float) -> np.ndarray:
        """q-quantile of the pooled leaf samples for each row of ``X``; shape ``(n,)``."""
        L = self.leaves(X)
        n, T = L.shape
        st = self.starts[L].ravel()
        ln = self.lens[L].ravel()
        idx = np.arange(int(ln.sum())) + np.repeat(st - np.cumsum(ln) + ln, ln)
        v = self.vals[idx]
        seg = ln.reshape(n, T).sum(axis=1)
        sid = np.repeat(np.arange(n), seg)
        v = v[np.lexsort((v, sid))]
        start = np.concatenate([[0], np.cumsum(seg)[:-1]])
        pos = quantile * (seg - 1)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, seg - 1)
        fr = pos - lo
        return v[start + lo] * (1 - fr) + v[start + hi] * fr


class LengthPredictor:
    """Quantile-regression-forest bound on the total output length (tokens). JITServe §4.1.

    Parameters: ``quantile`` in (0, 1) (default 0.9); forest hyper-parameters ``n_estimators``,
    ``max_depth``, ``min_samples_leaf``, ``max_samples_leaf`` (samples kept per leaf; ``None`` keeps
    all, the exact Meinshausen estimator); ``refine_grid`` -- generated-token counts at which
    refinement rows are trained; ``log_target`` -- fit on ``log1p(length)`` (quantiles are invariant
    to this monotone map; splits are better balanced); ``cv_folds`` -- if >= 2, a cross-fitted
    conformal correction is learned at training time: ``cv_folds`` forests on instruction-disjoint
    folds give honest bounds for the training rows, and per k-bucket the factor ``exp(θ_b)`` that
    makes their coverage exactly ``q`` is stored and applied (QRF leaf pooling alone under-covers by
    1-2 points here). ``keep_forest`` keeps the ``quantile-forest`` object after fitting (its padded
    leaf arrays take gigabytes for ~10^4 rows); by default only the :class:`CompiledForest` (tens of
    MB, what is saved and served) is kept. Defaults were chosen by measurement (docs/analyzer.md,
    "Length upper bound").
    Raises ``ValueError`` for bad arguments.
    """

    def __init__(self, quantile: float = DEFAULT_QUANTILE, *, n_estimators: int = 100, max_depth: int | None = 30,
                 min_samples_leaf: int = 5, max_samples_leaf: int | None = 64, max_features: float = 0.33,
                 refine_grid: Sequence[int] = DEFAULT_REFINE_GRID, log_target: bool = True, cv_folds: int = 2,
                 random_state: int = 0, counter: TokenCounter | None = None, keep_forest: bool = False) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        if n_estimators < 1:
            raise ValueError("n_estimators must be >= 1")
        self.quantile = float(quantile)
        self.params = dict(n_estimators=int(n_estimators), max_depth=max_depth, min_samples_leaf=int(min_samples_leaf),
                           max_samples_leaf=max_samples_leaf, max_features=max_features)
        self.refine_grid = tuple(int(k) for k in refine_grid)
        self.log_target = bool(log_target)
        self.cv_folds = int(cv_folds)
        self.keep_forest = bool(keep_forest)
        self.random_state = random_state
        self._counter = counter
        self._compiled: CompiledForest | None = None
        #: conformal log-offset per calibration bucket learned at fit time (see ``cv_folds``)
        self.base_theta: dict[int, float] = {}
        self.tokenizer_name: str | None = None
        self.context_encoder = ContextEncoder()
        self.forest: Any = None
        self.version: str = "unfitted"
        self.n_train_examples = 0
        self.train_X: np.ndarray | None = None
        self.train_y: np.ndarray | None = None
        self.train_groups: list[str] | None = None
        self.meta: dict[str, Any] = {}

    # -- helpers ------------------------------------------------------------------------------------
    @property
    def counter(self) -> TokenCounter:
        """The :class:`TokenCounter` used for prompt/prefix token counts."""
        if self._counter is None:
            self._counter = get_token_counter()
        return self._counter

    @property
    def fitted(self) -> bool:
        """True once :meth:`fit` (or :meth:`load`) produced a forest."""
        return self._compiled is not None

    def _assemble(self, P: np.ndarray, G: np.ndarray, contexts: Sequence[Mapping[str, Any] | None]) -> np.ndarray:
        return np.hstack([P, G, self.context_encoder.transform(contexts)]).astype(np.float32)

    def _make_forest(self) -> Any:
        from quantile_forest import RandomForestQuantileRegressor

        return RandomForestQuantileRegressor(random_state=self.random_state, n_jobs=1, **self.params)

    # -- training -----------------------------------------------------------------------------------
    def fit(self, prompts: Sequence[str] | None, lengths: Sequence[int] | None,
            context: Sequence[Mapping[str, Any] | None] | None = None, *, outputs: Sequence[str] | None = None,
            examples: Sequence[LengthExample] | None = None) -> LengthPredictor:
        """Train the forest.

        Either ``prompts`` (texts) + ``lengths`` (total output tokens) [+ ``context`` dicts with
        app/model/stage, + ``outputs`` texts to build refinement rows], or ``examples`` (from
        :func:`load_examples`). Raises ``ValueError`` on empty or mismatched inputs or negative lengths.
        """
        if examples is None:
            if prompts is None or lengths is None:
                raise ValueError("fit needs prompts+lengths or examples")
            if len(prompts) != len(lengths):
                raise ValueError(f"{len(prompts)} prompts but {len(lengths)} lengths")
            if context is not None and len(context) != len(prompts):
                raise ValueError("context must have one entry per prompt")
            if outputs is not None and len(outputs) != len(prompts):
                raise ValueError("outputs must have one entry per prompt")
            examples = [
                LengthExample(output_len=int(n), prompt=p, output=(outputs[i] if outputs is not None else None),
                              app=(context[i] or {}).get("app") if context else None,
                              model=(context[i] or {}).get("model") if context else None,
                              stage=(context[i] or {}).get("stage") if context else None)
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
            ]
        if not examples:
            raise ValueError("no training examples")
        if any(e.output_len < 0 for e in examples):
            raise ValueError("output lengths must be >= 0")
        P, G, y, C, idx = build_rows(examples, self.refine_grid, self.counter)
        self.context_encoder = ContextEncoder().fit([e.context for e in examples])
        X = self._assemble(P, G, C)
        keys = [examples[i].key for i in idx]
        self._fit_matrix(X, y, keys)
        self.n_train_examples = len(examples)
        return self

    def fit_rows(self, P: np.ndarray, G: np.ndarray, y: np.ndarray, contexts: Sequence[Mapping[str, Any] | None],
                 groups: Sequence[str] | None = None) -> LengthPredictor:
        """Train on precomputed rows (see :func:`build_rows`): prompt features ``P (n, n_prompt)``,
        prefix features ``G (n, n_prefix)``, total lengths ``y (n,)``, one context dict per row and an
        optional group key per row (rows of one response share a key; used by ``cv_folds``)."""
        if len(y) == 0:
            raise ValueError("no training rows")
        self.context_encoder = ContextEncoder().fit(list(contexts))
        self._fit_matrix(self._assemble(P, G, contexts), np.asarray(y, dtype=np.float64), groups)
        self.n_train_examples = len(set(groups)) if groups is not None else int(np.sum(G[:, 1] == 0))
        return self

    def _k_column(self) -> int:
        return len(PROMPT_FEATURE_NAMES) + PREFIX_FEATURE_NAMES.index("k")

    def _fit_matrix(self, X: np.ndarray, y: np.ndarray, groups: Sequence[str] | None = None) -> None:
        target = np.log1p(y) if self.log_target else y
        ks = X[:, self._k_column()].astype(np.int64)
        self.base_theta = {}
        if self.cv_folds >= 2 and groups is not None and len(set(groups)) >= 2 * self.cv_folds:
            fold = np.asarray([int(hashlib.sha1(g.encode()).hexdigest()[:8], 16) % self.cv_folds for g in groups])
            honest = np.full(len(y), np.nan)
            for f in range(self.cv_folds):
                tr, te = fold != f, fold == f
                if tr.sum() == 0 or te.sum() == 0:
                    continue
                m = self._make_forest().fit(X[tr], target[tr])
                honest[te] = CompiledForest(m).predict(X[te], self.quantile)
            ok = ~np.isnan(honest)
            pred = np.expm1(honest) if self.log_target else honest
            buckets = np.asarray([calibration_bucket(int(k)) for k in ks])
            for b in CALIBRATION_BUCKETS:
                sel = ok & (buckets == b)
                if sel.sum() >= 30:
                    bound = np.maximum(pred[sel], ks[sel] + 1.0)
                    score = np.log(np.maximum(y[sel], 1.0) / np.maximum(bound, 1.0))
                    self.base_theta[b] = float(np.quantile(score, self.quantile, method="higher"))
        forest = self._make_forest()
        forest.fit(X, target)
        self._compiled = CompiledForest(forest)
        self.forest = forest if self.keep_forest else None
        self.train_X, self.train_y = X, y
        self.train_groups = list(groups) if groups is not None else None
        self.tokenizer_name = self.counter.name
        digest = hashlib.sha1(X.tobytes() + y.tobytes()).hexdigest()[:10]
        self.version = f"qrf-v{FORMAT_VERSION}f{FEATURE_VERSION}-{time.strftime('%Y%m%dT%H%M%S')}-{digest}"

    def refit(self, examples: Sequence[LengthExample], keep_previous: bool = True) -> LengthPredictor:
        """A new predictor trained on ``examples`` (+ this one's training rows if ``keep_previous``).

        Does not modify ``self`` (the caller swaps atomically). The context vocabulary is re-fitted on
        the new examples plus the previous vocabulary. Raises ``ValueError`` if there is nothing to fit.
        """
        new = LengthPredictor(self.quantile, refine_grid=self.refine_grid, log_target=self.log_target,
                              cv_folds=self.cv_folds, random_state=self.random_state, counter=self._counter,
                              keep_forest=self.keep_forest, **self.params)
        old_vocab = self.context_encoder.vocab
        ctxs = [e.context for e in examples]
        new.context_encoder = ContextEncoder().fit(ctxs)
        for f in ContextEncoder.FIELDS:  # keep old columns first so previous rows stay meaningful
            merged = list(old_vocab.get(f, [])) + [v for v in new.context_encoder.vocab[f] if v not in old_vocab.get(f, [])]
            new.context_encoder.vocab[f] = merged[: new.context_encoder.max_values]
        mats, ys, groups = [], [], []
        if examples:
            P, G, y, C, idx = build_rows(examples, self.refine_grid, self.counter)
            mats.append(new._assemble(P, G, C))
            ys.append(y)
            groups += [examples[i].key for i in idx]
        if keep_previous and self.train_X is not None and self.train_y is not None:
            n_old_ctx = len(self.context_encoder.names)
            base = self.train_X[:, : self.train_X.shape[1] - n_old_ctx]
            old_ctx = self.train_X[:, self.train_X.shape[1] - n_old_ctx:]
            ctx = np.zeros((len(base), len(new.context_encoder.names)), dtype=np.float32)
            # old vocab columns are a prefix of each new field block
            src = dst = 0
            for f in ContextEncoder.FIELDS:
                n_old, n_new = len(old_vocab.get(f, [])), len(new.context_encoder.vocab[f])
                m = min(n_old, n_new)
                ctx[:, dst: dst + m] = old_ctx[:, src: src + m]
                src, dst = src + n_old, dst + n_new
            mats.append(np.hstack([base, ctx]).astype(np.float32))
            ys.append(self.train_y)
            groups += self.train_groups or [f"old{i}" for i in range(len(self.train_y))]
        if not mats:
            raise ValueError("nothing to refit on")
        new._fit_matrix(np.vstack(mats), np.concatenate(ys), groups)
        new.n_train_examples = len(examples) + (self.n_train_examples if keep_previous else 0)
        return new

    # -- prediction ---------------------------------------------------------------------------------
    def features(self, prompts: Sequence[str], generated: Sequence[str] | None = None,
                 context: Sequence[Mapping[str, Any] | None] | None = None,
                 generated_tokens: Sequence[int] | None = None, prompt_tokens: Sequence[int] | None = None,
                 prompt_feats: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(X, k)``: the model matrix (float32) and the generated-token counts for a batch.

        ``generated`` are the generated texts so far (default empty); ``generated_tokens`` their token
        counts and ``prompt_tokens`` the prompts' (default: counted with :attr:`counter`).
        ``prompt_feats`` may be passed to reuse cached :func:`prompt_features` rows.
        """
        n = len(prompts)
        gen = list(generated) if generated is not None else [""] * n
        if len(gen) != n:
            raise ValueError("generated must have one entry per prompt")
        if generated_tokens is None:
            ks = self.counter.count(gen) if any(gen) else [0] * n
        else:
            ks = [int(k) for k in generated_tokens]
            if len(ks) != n:
                raise ValueError("generated_tokens must have one entry per prompt")
        if prompt_feats is None:
            if prompt_tokens is None:
                prompt_tokens = self.counter.count(prompts)
            prompt_feats = prompt_features(prompts, prompt_tokens)
        G = prefix_features(gen, ks)
        ctx = list(context) if context is not None else [None] * n
        return self._assemble(prompt_feats, G, ctx), np.asarray(ks, dtype=np.int64)

    def predict_matrix(self, X: np.ndarray, quantile: float | None = None, *, conformal: bool = True) -> np.ndarray:
        """Raw bound on the total length for model rows ``X`` (float tokens, shape ``(n,)``).

        The forest's q-quantile times the fit-time conformal factor of each row's k-bucket
        (``conformal=True`` and ``quantile`` equal to the trained one). Raises
        :class:`LengthModelError` if the predictor is not fitted.
        """
        if self._compiled is None:
            raise LengthModelError("length predictor is not fitted")
        q = self.quantile if quantile is None else float(quantile)
        pred = self._compiled.predict(np.asarray(X, dtype=np.float32), q)
        pred = np.expm1(pred) if self.log_target else pred
        if conformal and self.base_theta and q == self.quantile:
            ks = X[:, self._k_column()]
            pred = pred * np.exp([self.base_theta.get(calibration_bucket(int(k)), 0.0) for k in ks])
        return pred

    def predict(self, prompts: Sequence[str], generated: Sequence[str] | None = None,
                context: Sequence[Mapping[str, Any] | None] | None = None, *,
                generated_tokens: Sequence[int] | None = None, max_tokens: Sequence[int | None] | None = None,
                quantile: float | None = None) -> np.ndarray:
        """Upper bound (int tokens, shape ``(len(prompts),)``) on each request's total output length.

        With ``k`` tokens generated the bound is ``max(forest_q, k + 1)`` (never below ``k``: the request
        is still running), capped by ``max_tokens`` when given (but not below ``k``).
        """
        X, ks = self.features(prompts, generated, context, generated_tokens)
        raw = self.predict_matrix(X, quantile)
        caps = list(max_tokens) if max_tokens is not None else [None] * len(prompts)
        return np.asarray([finalize_bound(r, int(k), c) for r, k, c in zip(raw, ks, caps, strict=True)], dtype=np.int64)

    # -- persistence --------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Pickle the predictor with its version stamp to ``path`` (atomic rename). Returns the path.

        Raises :class:`LengthModelError` if not fitted. Only load files you produced: the format is pickle.
        """
        if self._compiled is None:
            raise LengthModelError("cannot save an unfitted length predictor")
        import quantile_forest
        import sklearn

        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "magic": MODEL_MAGIC,
            "format_version": FORMAT_VERSION,
            "feature_version": FEATURE_VERSION,
            "version": self.version,
            "quantile": self.quantile,
            "params": self.params,
            "refine_grid": self.refine_grid,
            "log_target": self.log_target,
            "cv_folds": self.cv_folds,
            "base_theta": self.base_theta,
            "train_groups": self.train_groups,
            "random_state": self.random_state,
            "tokenizer": self.tokenizer_name,
            "context_vocab": self.context_encoder.vocab,
            "compiled": self._compiled,
            "n_train_examples": self.n_train_examples,
            "train_X": self.train_X,
            "train_y": self.train_y,
            "meta": self.meta,
            "libs": {"sklearn": sklearn.__version__, "quantile_forest": quantile_forest.__version__},
        }
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as fh:
            pickle.dump(payload, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str], counter: TokenCounter | None = None) -> LengthPredictor:
        """Load a predictor saved by :meth:`save`, counting tokens with ``counter`` (default: the
        process-wide :func:`~jitflow_server.analyzer.tokens.get_token_counter`).

        Raises :class:`LengthModelError` (with the path and reason) if the file is missing, not a
        jitflow length model, of another format/feature version, or corrupt. Logs a warning if the
        model was trained with a tokenizer of another :attr:`TokenCounter.name` than ``counter``'s
        (its bounds are then in other tokens than the ones counted at serving time).
        """
        path = Path(path).expanduser()
        if not path.is_file():
            raise LengthModelError(f"length model not found: {path}")
        try:
            with open(path, "rb") as fh:
                payload = pickle.load(fh)
        except Exception as exc:  # pickle raises many types on corrupt input
            raise LengthModelError(f"corrupt length model {path}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(payload, dict) or payload.get("magic") != MODEL_MAGIC:
            raise LengthModelError(f"{path} is not a jitflow length model")
        if payload.get("format_version") != FORMAT_VERSION or payload.get("feature_version") != FEATURE_VERSION:
            raise LengthModelError(
                f"{path}: model format v{payload.get('format_version')}/features v{payload.get('feature_version')}, "
                f"this jitflow reads v{FORMAT_VERSION}/v{FEATURE_VERSION}; retrain with `jitflow analyzer train-length`")
        try:
            p = cls(payload["quantile"], refine_grid=payload["refine_grid"], log_target=payload["log_target"],
                    cv_folds=payload["cv_folds"], random_state=payload["random_state"], counter=counter,
                    **payload["params"])
            p.base_theta = {int(k): float(v) for k, v in payload["base_theta"].items()}
            p.train_groups = payload.get("train_groups")
            p._compiled = payload["compiled"]
            p.version = payload["version"]
            p.tokenizer_name = payload["tokenizer"]
            p.context_encoder.vocab = payload["context_vocab"]
            p.n_train_examples = payload["n_train_examples"]
            p.train_X, p.train_y = payload.get("train_X"), payload.get("train_y")
            p.meta = payload.get("meta", {})
        except (KeyError, TypeError, ValueError) as exc:
            raise LengthModelError(f"corrupt length model {path}: missing/invalid field {exc}") from exc
        if not isinstance(p._compiled, CompiledForest):
            raise LengthModelError(f"corrupt length model {path}: no compiled forest")
        current = p.counter.name
        if p.tokenizer_name != current:
            logger.warning("length model %s was trained with tokenizer %r but %r is in use; bounds may be off",
                           path, p.tokenizer_name, current)
        return p


def load_predictor_or_none(path: str | os.PathLike[str] | None = None,
                           counter: TokenCounter | None = None) -> LengthPredictor | None:
    """Load the length model at ``path`` (default :func:`default_model_path`) with ``counter`` (see
    :meth:`LengthPredictor.load`); on any :class:`LengthModelError` log a warning and return ``None``
    (callers then use the fallback)."""
    path = Path(path).expanduser() if path is not None else default_model_path()
    try:
        return LengthPredictor.load(path, counter=counter)
    except LengthModelError as exc:
        logger.warning("length model unavailable, using the running-quantile fallback: %s", exc)
        return None
