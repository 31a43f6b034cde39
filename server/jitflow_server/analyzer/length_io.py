"""Saving and loading length models (:meth:`LengthPredictor.save` / :meth:`LengthPredictor.load`): a pickle of
a plain dict with a magic string, format and feature versions, the model version stamp and library
versions. Its only jitflow class is :class:`~jitflow_server.analyzer.length_forest.CompiledForest`; the
prompt memory is stored as plain data. Only load files you produced (pickle).
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any

from jitflow_server.analyzer.length_features import FEATURE_VERSION
from jitflow_server.analyzer.length_forest import CompiledForest
from jitflow_server.analyzer.length_memory import PromptMemory
from jitflow_server.analyzer.tokens import TokenCounter
from jitflow_server.settings import env_settings

logger = logging.getLogger("jitflow_server.analyzer.length")

#: Version of the saved-model layout; :func:`load_predictor` rejects other versions.
FORMAT_VERSION = 2
#: Marker written at the top of every saved model.
MODEL_MAGIC = "jitflow-length-qrf"
#: Environment variable naming the default model file.
ENV_MODEL_PATH = "JITFLOW_LENGTH_MODEL"


class LengthModelError(Exception):
    """A length model file is missing, unreadable, corrupt, of another format version, or unusable."""


def default_model_path() -> Path:
    """Path of the default length model: ``$JITFLOW_LENGTH_MODEL`` or ``<JITFLOW_CACHE>/models/length-qrf.pkl``
    (``~/.cache/jitflow/models/length-qrf.pkl``)."""
    env = env_settings()
    if env.length_model is not None:
        return env.length_model.expanduser()
    return env.cache_dir() / "models" / "length-qrf.pkl"


def save_predictor(predictor: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``predictor`` to ``path`` (see :meth:`LengthPredictor.save`)."""
    if predictor._compiled is None:
        raise LengthModelError("cannot save an unfitted length predictor")
    import quantile_forest
    import sklearn

    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "magic": MODEL_MAGIC,
        "format_version": FORMAT_VERSION,
        "feature_version": FEATURE_VERSION,
        "version": predictor.version,
        "quantile": predictor.quantile,
        "params": predictor.params,
        "refine_grid": predictor.refine_grid,
        "log_target": predictor.log_target,
        "cv_folds": predictor.cv_folds,
        "text_memory": predictor.text_memory,
        "memory_k": predictor.memory_k,
        "spread_scaled": predictor.spread_scaled,
        "memory": predictor.memory.state() if predictor.memory is not None else None,
        "base_theta": predictor.base_theta,
        "train_groups": predictor.train_groups,
        "random_state": predictor.random_state,
        "tokenizer": predictor.tokenizer_name,
        "context_vocab": predictor.context_encoder.vocab,
        "compiled": predictor._compiled,
        "compiled_memory": predictor._compiled_memory,
        "base_theta_memory": predictor.base_theta_memory,
        "memory_similarity": predictor.memory_similarity,
        "n_train_examples": predictor.n_train_examples,
        "train_X": predictor.train_X,
        "train_y": predictor.train_y,
        "meta": predictor.meta,
        "libs": {"sklearn": sklearn.__version__, "quantile_forest": quantile_forest.__version__},
    }
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        pickle.dump(payload, fh, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
    return path



def load_predictor(cls: Any, path: str | os.PathLike[str], counter: TokenCounter | None = None) -> Any:
    """Read a predictor of class ``cls`` from ``path`` (see :meth:`LengthPredictor.load`)."""
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
                text_memory=payload["text_memory"], memory_k=payload["memory_k"],
                memory_similarity=payload["memory_similarity"],
                spread_scaled=payload["spread_scaled"], **payload["params"])
        p.memory = PromptMemory.from_state(payload["memory"]) if payload["memory"] is not None else None
        p.base_theta = {int(k): float(v) for k, v in payload["base_theta"].items()}
        p.train_groups = payload.get("train_groups")
        p._compiled = payload["compiled"]
        p._compiled_memory = payload["compiled_memory"]
        p.base_theta_memory = {int(k): float(v) for k, v in payload["base_theta_memory"].items()}
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
                           counter: TokenCounter | None = None) -> Any:
    """Load the length model at ``path`` (default :func:`default_model_path`) with ``counter`` (see
    :meth:`LengthPredictor.load`); on any :class:`LengthModelError` log a warning and return ``None``
    (callers then use the fallback)."""
    path = Path(path).expanduser() if path is not None else default_model_path()
    try:
        from jitflow_server.analyzer.length import LengthPredictor

        return LengthPredictor.load(path, counter=counter)
    except LengthModelError as exc:
        logger.warning("length model unavailable, using the running-quantile fallback: %s", exc)
        return None
