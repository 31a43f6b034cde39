"""Output-length upper bound: a quantile regression forest with online refinement and calibration.

JITServe §4.1 "Estimating Response Length Upper-bound" (thesis §4.1): a quantile
regression forest (QRF, Meinshausen 2006; the ``quantile-forest`` package) predicts a high quantile
``q`` (default 0.9) of a request's *total* output length (tokens) from features of its prompt and of
its serving context (app, model, stage). While the response is being generated the bound is refined:
with ``k`` tokens generated, the forest is queried again with features of the generated prefix and
``k`` itself, and the bound never falls below ``k``.

This module holds the predictor (:class:`LengthPredictor`: ``fit``, ``predict``, ``refit``, ``save``/``load``
with a format version stamp, :class:`LengthModelError` on bad files). Beside it: ``tokens.py`` (the
:class:`~jitflow_server.analyzer.tokens.TokenCounter` used for every count, passed as ``counter=`` by
whoever knows the served model, else the process-wide default), ``length_features.py``
(data-independent prompt/prefix features and the context encoder), ``length_calibration.py`` (the online
conformal calibrator, the running-quantile fallback, ``finalize_bound``) and ``length_data.py``
(AlpacaEval and telemetry loading, training rows).

The asynchronous, batched serving wrapper is :mod:`jitflow_server.analyzer.length_service`.

Saved models are pickles of a dict (:meth:`LengthPredictor.save`) whose only jitflow class is
:class:`~jitflow_server.analyzer.length_forest.CompiledForest`, stored under its path
``jitflow_server.analyzer.length_forest.CompiledForest``: it must stay there for saved models to load
(the prompt memory is saved as plain data). The predictor keeps two forests when it has a prompt
memory (``length_memory.py``): the text forest and the memory forest (see :class:`LengthPredictor`).
"""

from __future__ import annotations

import hashlib
import logging
import os
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
    request_features,
)
from jitflow_server.analyzer.length_forest import CompiledForest
from jitflow_server.analyzer.length_io import (
    ENV_MODEL_PATH,
    FORMAT_VERSION,
    MODEL_MAGIC,
    LengthModelError,
    default_model_path,
    load_predictor,
    load_predictor_or_none,
    save_predictor,
)
from jitflow_server.analyzer.length_memory import MEMORY_FEATURE_NAMES, PromptMemory
from jitflow_server.analyzer.tokens import TokenCounter, get_token_counter

logger = logging.getLogger(__name__)
#: Names of the saved-model layer, re-exported here (``length_io.py``).
__all__ = ["ENV_MODEL_PATH", "FORMAT_VERSION", "MODEL_MAGIC", "LengthModelError", "LengthPredictor", "CompiledForest",
           "default_model_path", "load_predictor_or_none"]

#: Generated-token counts at which refinement training rows are built (JITServe re-predicts every
#: 50 tokens; the forest interpolates between grid points because ``k`` is a feature).
DEFAULT_REFINE_GRID: tuple[int, ...] = (50, 100, 150, 200, 300, 400, 600, 800, 1200, 1600)
#: Smallest spread log(q-bound / median) used to scale calibration offsets (log units).
MIN_SPREAD = 0.05
#: Fewest training rows with a near remembered prompt for which a memory forest is fitted.
MIN_MEMORY_ROWS = 200


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
    MB, what is saved and served) is kept. ``text_memory`` adds a second forest, the *memory forest*,
    for prompts whose most similar remembered prompt (:class:`PromptMemory`, TF-IDF cosine) is at least
    ``memory_similarity`` similar: it also sees the output lengths of the ``memory_k`` most similar
    remembered prompts. Every other prompt is bounded by the *text forest*, which never sees memory
    columns, so prompts without a near twin are bounded exactly as without a memory. ``spread_scaled`` measures every
    calibration offset in units of the row's own spread ``log(bound_q / median)`` (normalised conformal
    scores, Lei et al. 2018): rows the forest is sure of move less than rows it is not, which shortens
    the tail of bound/true at the same coverage. Defaults were chosen by measurement (docs/analyzer.md,
    "Length upper bound").

    Feature matrix columns: prompt features, prefix features, memory features, request features
    (``max_tokens``, response format), one-hot context (app, kind, stage, model). ``fit_jobs``: threads that
    build the trees (scikit-learn's ``n_jobs``, -1: one per core); the trees are the same for any value and
    prediction never uses them. Raises ``ValueError`` for bad arguments.
    """

    fit_jobs = 1  # models pickled before ``fit_jobs`` existed

    def __init__(self, quantile: float = DEFAULT_QUANTILE, *, n_estimators: int = 100, max_depth: int | None = 30,
                 min_samples_leaf: int = 5, max_samples_leaf: int | None = 64, max_features: float = 0.33,
                 refine_grid: Sequence[int] = DEFAULT_REFINE_GRID, log_target: bool = True, cv_folds: int = 2,
                 random_state: int = 0, counter: TokenCounter | None = None, keep_forest: bool = False,
                 text_memory: bool = True, memory_k: int = 8, memory_similarity: float = 0.9,
                 spread_scaled: bool = True, fit_jobs: int = 1) -> None:
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
        self.text_memory = bool(text_memory)
        self.memory_k = int(memory_k)
        self.spread_scaled = bool(spread_scaled)
        self.fit_jobs = int(fit_jobs)
        #: the prompt memory (``None``: not used, or no training prompt text)
        self.memory: PromptMemory | None = None
        self.random_state = random_state
        self._counter = counter
        self._compiled: CompiledForest | None = None
        #: forest for prompts with a near remembered prompt (``None``: no memory, or too few such rows)
        self._compiled_memory: Any = None
        self.base_theta_memory: dict[int, float] = {}
        self.memory_similarity = float(memory_similarity)
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

    def _assemble(self, P: np.ndarray, G: np.ndarray, contexts: Sequence[Mapping[str, Any] | None],
                  M: np.ndarray | None = None) -> np.ndarray:
        """Model rows ``[P, G, M, request features, one-hot context]`` (float32); ``M=None``: zeros."""
        if M is None:
            M = np.zeros((len(P), len(MEMORY_FEATURE_NAMES)))
        return np.hstack([P, G, M, request_features(contexts), self.context_encoder.transform(contexts)]
                         ).astype(np.float32)

    def _params(self) -> dict[str, Any]:
        """Constructor arguments of an identically configured predictor."""
        return dict(refine_grid=self.refine_grid, log_target=self.log_target, cv_folds=self.cv_folds,
                    random_state=self.random_state, counter=self._counter, keep_forest=self.keep_forest,
                    text_memory=self.text_memory, memory_k=self.memory_k,
                    memory_similarity=self.memory_similarity, spread_scaled=self.spread_scaled,
                    **self.params)

    def memory_rows(self, examples: Sequence[LengthExample], memory: PromptMemory | None,
                    offset: int = 0) -> np.ndarray:
        """Training memory features per example, shape ``(len(examples), 6)``.

        Examples with prompt text are remembered at rows ``offset, offset+1, ...`` of ``memory`` (in
        order) and never find their own response (other responses to the same prompt they do find: that
        is the case the memory forest serves). Examples without text use their recorded
        ``memory_features`` (else zeros).
        """
        M = np.zeros((len(examples), len(MEMORY_FEATURE_NAMES)))
        if memory is None:
            return M
        with_text = [i for i, e in enumerate(examples) if e.prompt is not None]
        if with_text:
            excl = [offset + j for j in range(len(with_text))]
            M[with_text] = memory.features([examples[i].prompt or "" for i in with_text], exclude=excl)
        for i, e in enumerate(examples):
            if e.prompt is None and e.memory_features is not None and len(e.memory_features) == M.shape[1]:
                M[i] = e.memory_features
        return M

    def fit_memory(self, examples: Sequence[LengthExample]) -> PromptMemory | None:
        """A :class:`PromptMemory` of the examples with prompt text (``None`` when ``text_memory`` is off or
        there are too few); rows follow the order of those examples (see :meth:`memory_rows`)."""
        texts = [(e.prompt, e.output_len) for e in examples if e.prompt is not None]
        if not self.text_memory or len(texts) <= self.memory_k:
            return None
        return PromptMemory(self.memory_k).fit([t for t, _ in texts], [n for _, n in texts])

    def _make_forest(self) -> Any:
        from quantile_forest import RandomForestQuantileRegressor

        return RandomForestQuantileRegressor(random_state=self.random_state, n_jobs=self.fit_jobs, **self.params)

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
        self.memory = self.fit_memory(examples)
        M = self.memory_rows(examples, self.memory)[idx]
        X = self._assemble(P, G, C, M)
        keys = [examples[i].key for i in idx]
        self._fit_matrix(X, y, keys)
        self.n_train_examples = len(examples)
        return self

    def fit_rows(self, P: np.ndarray, G: np.ndarray, y: np.ndarray, contexts: Sequence[Mapping[str, Any] | None],
                 groups: Sequence[str] | None = None, *, M: np.ndarray | None = None,
                 memory: PromptMemory | None = None) -> LengthPredictor:
        """Train on precomputed rows (see :func:`build_rows`): prompt features ``P (n, n_prompt)``,
        prefix features ``G (n, n_prefix)``, total lengths ``y (n,)``, one context dict per row, an
        optional group key per row (rows of one response share a key; used by ``cv_folds``), and the
        rows' memory features ``M (n, 5)`` computed with ``memory`` (which is kept for prediction;
        ``None``: no memory, zero columns)."""
        if len(y) == 0:
            raise ValueError("no training rows")
        self.context_encoder = ContextEncoder().fit(list(contexts))
        self.memory = memory if self.text_memory else None
        if self.memory is None:
            M = None
        self._fit_matrix(self._assemble(P, G, contexts, M), np.asarray(y, dtype=np.float64), groups)
        self.n_train_examples = len(set(groups)) if groups is not None else int(np.sum(G[:, 1] == 0))
        return self

    def _k_column(self) -> int:
        return len(PROMPT_FEATURE_NAMES) + PREFIX_FEATURE_NAMES.index("k")

    def _fit_one(self, X: np.ndarray, y: np.ndarray, groups: Sequence[str] | None) -> tuple[CompiledForest, dict[int, float], Any]:
        """One forest on rows ``X`` with its cross-fitted conformal offsets per k-bucket (``cv_folds``)."""
        target = np.log1p(y) if self.log_target else y
        ks = X[:, self._k_column()].astype(np.int64)
        theta: dict[int, float] = {}
        if self.cv_folds >= 2 and groups is not None and len(set(groups)) >= 2 * self.cv_folds:
            fold = np.asarray([int(hashlib.sha1(g.encode()).hexdigest()[:8], 16) % self.cv_folds for g in groups])
            honest = np.full((len(y), 2), np.nan)
            for f in range(self.cv_folds):
                tr, te = fold != f, fold == f
                if tr.sum() == 0 or te.sum() == 0:
                    continue
                m = self._make_forest().fit(X[tr], target[tr])
                honest[te] = CompiledForest(m).predict_quantiles(X[te], [0.5, self.quantile])
            ok = ~np.isnan(honest[:, 1])
            pred, spread = self._bound_and_spread(np.nan_to_num(honest))
            buckets = np.asarray([calibration_bucket(int(k)) for k in ks])
            for b in CALIBRATION_BUCKETS:
                sel = ok & (buckets == b)
                if sel.sum() >= 30:
                    bound = np.maximum(pred[sel], ks[sel] + 1.0)
                    score = np.log(np.maximum(y[sel], 1.0) / np.maximum(bound, 1.0)) / spread[sel]
                    theta[b] = float(np.quantile(score, self.quantile, method="higher"))
        forest = self._make_forest()
        forest.fit(X, target)
        forest.n_jobs = 1  # a kept forest predicts in the caller's thread, whatever it was fitted with
        return CompiledForest(forest), theta, forest

    def _memory_cols(self) -> slice:
        start = len(PROMPT_FEATURE_NAMES) + len(PREFIX_FEATURE_NAMES)
        return slice(start, start + len(MEMORY_FEATURE_NAMES))

    def _has_twin(self, X: np.ndarray) -> np.ndarray:
        """Rows whose most similar remembered prompt is at least ``memory_similarity`` similar."""
        top = X[:, self._memory_cols().start + MEMORY_FEATURE_NAMES.index("nn_top_sim")]
        return top >= self.memory_similarity

    def _near(self, X: np.ndarray) -> np.ndarray:
        """Rows served by the memory forest (none without one): see :meth:`_has_twin`."""
        if self._compiled_memory is None:
            return np.zeros(len(X), dtype=bool)
        return self._has_twin(X)

    def _fit_matrix(self, X: np.ndarray, y: np.ndarray, groups: Sequence[str] | None = None) -> None:
        """Fit the text forest on every row (memory columns zeroed) and, when a memory exists and enough
        rows have a near remembered prompt, the memory forest on those rows."""
        Xt = X.copy()
        Xt[:, self._memory_cols()] = 0.0
        self._compiled, self.base_theta, forest = self._fit_one(Xt, y, groups)
        self.forest = forest if self.keep_forest else None
        self._compiled_memory, self.base_theta_memory = None, {}
        if self.memory is not None:
            near = self._has_twin(X)
            if near.sum() >= MIN_MEMORY_ROWS:
                g = [groups[i] for i in np.nonzero(near)[0]] if groups is not None else None
                self._compiled_memory, self.base_theta_memory, _ = self._fit_one(X[near], y[near], g)
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
        new = LengthPredictor(self.quantile, **self._params())
        old_vocab = self.context_encoder.vocab
        ctxs = [e.context for e in examples]
        new.context_encoder = ContextEncoder().fit(ctxs)
        for f in ContextEncoder.FIELDS:  # keep old columns first so previous rows stay meaningful
            merged = list(old_vocab.get(f, [])) + [v for v in new.context_encoder.vocab[f] if v not in old_vocab.get(f, [])]
            new.context_encoder.vocab[f] = merged[: new.context_encoder.max_values]
        mats, ys, groups = [], [], []
        texts = [(e.prompt, e.output_len) for e in examples if e.prompt is not None]
        if self.memory is not None:
            new.memory = self.memory.extend([t for t, _ in texts], [n for _, n in texts])
        else:
            new.memory = new.fit_memory(examples)
        if examples:
            P, G, y, C, idx = build_rows(examples, self.refine_grid, self.counter)
            offset = new.memory.n_items - len(texts) if new.memory is not None else 0
            M = new.memory_rows(examples, new.memory, offset=max(offset, 0))[idx]
            mats.append(new._assemble(P, G, C, M))
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

    def features(self, prompts: Sequence[str], generated: Sequence[str] | None = None,
                 context: Sequence[Mapping[str, Any] | None] | None = None,
                 generated_tokens: Sequence[int] | None = None, prompt_tokens: Sequence[int] | None = None,
                 prompt_feats: np.ndarray | None = None,
                 memory_feats: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(X, k)``: the model matrix (float32) and the generated-token counts for a batch.

        ``generated`` are the generated texts so far (default empty); ``generated_tokens`` their token
        counts and ``prompt_tokens`` the prompts' (default: counted with :attr:`counter`).
        ``prompt_feats`` / ``memory_feats`` may be passed to reuse cached :func:`prompt_features` /
        :meth:`memory_features` rows. ``context`` dicts may carry app, kind, model, stage, max_tokens
        and response_format.
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
        if memory_feats is None:
            memory_feats = self.memory_features(prompts)
        return self._assemble(prompt_feats, G, ctx, memory_feats), np.asarray(ks, dtype=np.int64)

    def memory_features(self, prompts: Sequence[str]) -> np.ndarray:
        """Prompt-memory features, shape ``(len(prompts), 5)`` (zeros without a memory)."""
        if self.memory is None:
            return np.zeros((len(prompts), len(MEMORY_FEATURE_NAMES)))
        return self.memory.features(prompts)

    def _bound_and_spread(self, qv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """From forest outputs ``(n, 2)`` (median, q-quantile in target space): the q bound in tokens and
        the spread ``log(bound / median)`` (>= MIN_SPREAD; all ones when not ``spread_scaled``)."""
        lo, hi = (np.expm1(qv[:, 0]), np.expm1(qv[:, 1])) if self.log_target else (qv[:, 0], qv[:, 1])
        if not self.spread_scaled:
            return hi, np.ones(len(hi))
        spread = np.log(np.maximum(hi, 1.0) / np.maximum(lo, 1.0))
        return hi, np.maximum(spread, MIN_SPREAD)

    def predict_bounds(self, X: np.ndarray, quantile: float | None = None, *,
                       conformal: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """``(bound, spread)`` for model rows ``X``, each shape ``(n,)``.

        ``bound``: the forest's q-quantile of the total length (float tokens) times the fit-time conformal
        factor ``exp(θ_b · spread)`` of each row's k-bucket (``conformal=True`` and ``quantile`` equal to
        the trained one). ``spread``: ``log(q-quantile / median)`` of the forest (log units), the unit of
        every calibration offset (1.0 when not ``spread_scaled``); pass it to
        :meth:`OnlineCalibrator.factor`. Raises :class:`LengthModelError` if the predictor is not fitted.
        """
        if self._compiled is None:
            raise LengthModelError("length predictor is not fitted")
        q = self.quantile if quantile is None else float(quantile)
        X = np.asarray(X, dtype=np.float32)
        near = self._near(X)
        qv = np.empty((len(X), 2))
        Xt = X[~near].copy()
        Xt[:, self._memory_cols()] = 0.0
        qv[~near] = self._compiled.predict_quantiles(Xt, [0.5, q]) if len(Xt) else np.empty((0, 2))
        if near.any():
            qv[near] = self._compiled_memory.predict_quantiles(X[near], [0.5, q])
        pred, spread = self._bound_and_spread(qv)
        if conformal and q == self.quantile and (self.base_theta or self.base_theta_memory):
            ks = X[:, self._k_column()]
            theta = np.asarray([(self.base_theta_memory if m else self.base_theta).get(calibration_bucket(int(k)), 0.0)
                                for k, m in zip(ks, near, strict=True)])
            pred = pred * np.exp(theta * spread)
        return pred, spread

    def predict_matrix(self, X: np.ndarray, quantile: float | None = None, *, conformal: bool = True) -> np.ndarray:
        """Bound on the total length for model rows ``X`` (float tokens, shape ``(n,)``): the first
        element of :meth:`predict_bounds`. Raises :class:`LengthModelError` if not fitted."""
        return self.predict_bounds(X, quantile, conformal=conformal)[0]

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

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Pickle the predictor with its version stamp to ``path`` (atomic rename). Returns the path.

        Raises :class:`LengthModelError` if not fitted. Only load files you produced: the format is pickle.
        """
        return save_predictor(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], counter: TokenCounter | None = None) -> LengthPredictor:
        """Load a predictor saved by :meth:`save`, counting tokens with ``counter`` (default: the
        process-wide :func:`~jitflow_server.analyzer.tokens.get_token_counter`).

        Raises :class:`LengthModelError` (with the path and reason) if the file is missing, not a
        jitflow length model, of another format/feature version, or corrupt. Logs a warning if the
        model was trained with a tokenizer of another :attr:`TokenCounter.name` than ``counter``'s
        (its bounds are then in other tokens than the ones counted at serving time).
        """
        return load_predictor(cls, path, counter)
