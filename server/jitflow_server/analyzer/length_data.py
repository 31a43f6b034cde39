"""Training data of the length model: examples, the telemetry line format, loading examples from
AlpacaEval-style files and telemetry, and the refinement training rows (JITServe §4.1)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jitflow_server.analyzer.length_features import (
    FEATURE_VERSION,
    PREFIX_FEATURE_NAMES,
    PROMPT_FEATURE_NAMES,
    prefix_features,
    prompt_features,
)
from jitflow_server.analyzer.tokens import TokenCounter, get_token_counter

logger = logging.getLogger(__name__)

#: ``kind`` field of one length-telemetry JSONL record (one finished request per line).
TELEMETRY_KIND = "jitflow.length.v1"


# --------------------------------------------------------------------------------------------------
# Training data
# --------------------------------------------------------------------------------------------------


@dataclass
class LengthExample:
    """One finished response usable for training/evaluation.

    ``output_len`` is in tokens of the :class:`TokenCounter` named ``tokenizer``. Either ``prompt``
    text or ``prompt_features`` (a FEATURE_VERSION vector) is present; ``output`` text (optional)
    enables refinement rows at the refine grid; ``prefix_features`` maps ``k`` to a prefix-feature
    vector recorded online (telemetry without text). ``kind`` (SLO kind), ``max_tokens`` and
    ``response_format`` (OpenAI ``response_format.type``) are the request's own; ``memory_features``
    are the prompt-memory features served with it (used for telemetry rows without prompt text).
    """

    output_len: int
    prompt: str | None = None
    output: str | None = None
    app: str | None = None
    model: str | None = None
    stage: str | None = None
    prompt_tokens: int | None = None
    prompt_features: list[float] | None = None
    prefix_features: dict[int, list[float]] = field(default_factory=dict)
    source: str = ""
    kind: str | None = None
    max_tokens: int | None = None
    response_format: str | None = None
    memory_features: list[float] | None = None

    @property
    def context(self) -> dict[str, Any]:
        """The request context dict ``{"app", "kind", "model", "stage", "max_tokens", "response_format"}``."""
        return {"app": self.app, "kind": self.kind, "model": self.model, "stage": self.stage,
                "max_tokens": self.max_tokens, "response_format": self.response_format}

    @property
    def key(self) -> str:
        """Stable identity of the prompt (for instruction-disjoint splits)."""
        if self.prompt is not None:
            return hashlib.sha1(self.prompt.encode()).hexdigest()
        return hashlib.sha1(json.dumps(self.prompt_features).encode()).hexdigest()


def telemetry_record(
    *,
    output_len: int,
    prompt: str | None = None,
    prompt_tokens: int | None = None,
    prompt_feats: Sequence[float] | None = None,
    prefix_feats: Mapping[int, Sequence[float]] | None = None,
    app: str | None = None,
    model: str | None = None,
    stage: str | None = None,
    max_tokens: int | None = None,
    bound0: int | None = None,
    output: str | None = None,
    tokenizer: str | None = None,
    kind: str | None = None,
    response_format: str | None = None,
    memory_feats: Sequence[float] | None = None,
) -> dict[str, Any]:
    """One line of the jitflow length-telemetry JSONL (one finished request per line).

    Format ``{"kind": "jitflow.length.v1", "ts": unix_s, "tokenizer": str, "feature_version": int,
    "app", "model", "stage": str|null, "max_tokens": int|null, "output_len": int (tokens),
    "prompt_tokens": int|null, "bound0": int|null (bound issued at arrival),
    "prompt": str (optional, only when text recording is on), "output": str (optional),
    "prompt_features": [float] (optional), "prefix_features": {"<k>": [float]} (optional),
    "slo_kind": str|null (SLO kind), "response_format": str|null, "memory_features": [float] (optional)}``.
    Training needs ``output_len`` and either ``prompt`` or ``prompt_features``.
    """
    rec: dict[str, Any] = {
        "kind": TELEMETRY_KIND,
        "ts": round(time.time(), 3),
        "tokenizer": tokenizer or get_token_counter().name,
        "feature_version": FEATURE_VERSION,
        "app": app,
        "model": model,
        "stage": stage,
        "max_tokens": max_tokens,
        "output_len": int(output_len),
        "prompt_tokens": prompt_tokens,
        "bound0": bound0,
        "slo_kind": kind,
        "response_format": response_format,
    }
    if memory_feats is not None:
        rec["memory_features"] = [round(float(x), 6) for x in memory_feats]
    if prompt is not None:
        rec["prompt"] = prompt
    if output is not None:
        rec["output"] = output
    if prompt_feats is not None:
        rec["prompt_features"] = [round(float(x), 6) for x in prompt_feats]
    if prefix_feats:
        rec["prefix_features"] = {str(k): [round(float(x), 6) for x in v] for k, v in prefix_feats.items()}
    return rec


def _example_from_telemetry(rec: Mapping[str, Any], source: str) -> LengthExample | None:
    if "output_len" not in rec:
        raise ValueError("telemetry record without output_len")
    feats = rec.get("prompt_features")
    pre = rec.get("prefix_features") or {}
    if rec.get("feature_version", FEATURE_VERSION) != FEATURE_VERSION:
        feats, pre = None, {}
        rec = {k: v for k, v in rec.items() if k != "memory_features"}
    if rec.get("prompt") is None and feats is None:
        return None
    return LengthExample(
        output_len=int(rec["output_len"]),
        prompt=rec.get("prompt"),
        output=rec.get("output"),
        app=rec.get("app"),
        model=rec.get("model"),
        stage=rec.get("stage"),
        prompt_tokens=rec.get("prompt_tokens"),
        prompt_features=list(feats) if feats is not None else None,
        prefix_features={int(k): list(v) for k, v in pre.items()},
        source=source,
        kind=rec.get("slo_kind"),
        max_tokens=rec.get("max_tokens"),
        response_format=rec.get("response_format"),
        memory_features=list(rec["memory_features"]) if rec.get("memory_features") is not None else None,
    )


def load_examples(paths: Iterable[str | os.PathLike[str]], counter: TokenCounter | None = None,
                  app: str | None = None) -> list[LengthExample]:
    """Read training/evaluation examples from AlpacaEval JSON files and jitflow telemetry JSONL files.

    AlpacaEval: a JSON list of ``{"instruction", "output", "generator", ...}``; the output length is
    counted with ``counter`` (default :func:`get_token_counter`), ``model`` = ``generator``, ``app`` =
    the ``app`` argument (None by default). Telemetry: JSONL of :func:`telemetry_record` objects
    (records without prompt text and without features are skipped; counted in a log message).
    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for an unparseable one.
    """
    counter = counter or get_token_counter()
    out: list[LengthExample] = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"length data file not found: {path}")
        text = path.read_text(encoding="utf-8")
        stripped = text.lstrip()
        if stripped.startswith("["):
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON ({exc})") from exc
            batch = []
            for j, r in enumerate(rows):
                if not isinstance(r, dict) or "instruction" not in r or "output" not in r:
                    raise ValueError(f"{path}: item {j} lacks 'instruction'/'output' (AlpacaEval format)")
                batch.append(r)
            lens = counter.count([r["output"] for r in batch])
            ptoks = counter.count([r["instruction"] for r in batch])
            for r, n, pt in zip(batch, lens, ptoks, strict=True):
                out.append(LengthExample(output_len=n, prompt=r["instruction"], output=r["output"], app=app,
                                         model=r.get("generator"), prompt_tokens=pt, source=path.name))
        else:
            skipped = 0
            for ln, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    ex = _example_from_telemetry(rec, path.name)
                except (json.JSONDecodeError, ValueError, TypeError) as exc:
                    raise ValueError(f"{path}:{ln}: bad telemetry record ({exc})") from exc
                if ex is None:
                    skipped += 1
                else:
                    out.append(ex)
            if skipped:
                logger.info("%s: skipped %d telemetry records without prompt text/features", path, skipped)
    return out


# --------------------------------------------------------------------------------------------------
# Training rows
# --------------------------------------------------------------------------------------------------


def build_rows(examples: Sequence[LengthExample], refine_grid: Sequence[int], counter: TokenCounter,
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any]], np.ndarray]:
    """Build ``(P, G, y, contexts, example_index)`` training rows for ``examples``.

    One row at k=0 per example, plus one row per grid k < output_len (the response is still running
    after k tokens, so the model learns the length distribution conditioned on ``len > k``).
    """
    need = [i for i, e in enumerate(examples) if e.prompt_features is None]
    pf = np.zeros((len(examples), len(PROMPT_FEATURE_NAMES)))
    if need:
        texts = [examples[i].prompt or "" for i in need]
        ntok = [examples[i].prompt_tokens for i in need]
        if any(t is None for t in ntok):
            ntok = counter.count(texts)
        pf[need] = prompt_features(texts, ntok)
    for i, e in enumerate(examples):
        if e.prompt_features is not None:
            pf[i] = e.prompt_features
    P, G, Y, C, IDX = [], [], [], [], []
    for i, e in enumerate(examples):
        P.append(pf[i])
        G.append(np.zeros(len(PREFIX_FEATURE_NAMES)))
        Y.append(e.output_len)
        C.append(e.context)
        IDX.append(i)
        ks = [k for k in refine_grid if k < e.output_len]
        if e.output is not None and ks:
            _, prefs = counter.prefixes(e.output, ks)
            gf = prefix_features(prefs, ks)
            for row in gf:
                P.append(pf[i])
                G.append(row)
                Y.append(e.output_len)
                C.append(e.context)
                IDX.append(i)
        elif e.prefix_features:
            for k, row in sorted(e.prefix_features.items()):
                if 0 < k < e.output_len:
                    P.append(pf[i])
                    G.append(np.asarray(row, dtype=np.float64))
                    Y.append(e.output_len)
                    C.append(e.context)
                    IDX.append(i)
    return np.asarray(P), np.asarray(G), np.asarray(Y, dtype=np.float64), C, np.asarray(IDX)
