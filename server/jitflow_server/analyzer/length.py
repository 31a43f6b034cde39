"""Output-length upper bound: a quantile regression forest with online refinement and calibration.

JITServe §4.1 "Estimating Response Length Upper-bound" (thesis §4.1): a quantile
regression forest (QRF, Meinshausen 2006; the ``quantile-forest`` package) predicts a high quantile
``q`` (default 0.9) of a request's *total* output length (tokens) from features of its prompt and of
its serving context (app, model, stage). While the response is being generated the bound is refined:
with ``k`` tokens generated, the forest is queried again with features of the generated prefix and
``k`` itself, and the bound never falls below ``k``.

The pieces, all usable on their own:

- :class:`TokenCounter` -- the single tokenizer used for every count (prompt lengths, output lengths,
  generated prefixes). Default: the jitflow demo model's BPE tokenizer
  (installed by the command line, :func:`set_token_counter_factory`), else a documented regex fallback.
- :func:`prompt_features` / :func:`prefix_features` -- data-independent feature vectors (no fitted
  vocabulary), so telemetry rows recorded by one model version can train the next.
- :class:`LengthPredictor` -- the forest: ``fit``, ``predict``, ``save``/``load`` with a format
  version stamp (:class:`LengthModelError` on bad files), ``refit`` from new rows.
- :class:`OnlineCalibrator` -- adaptive conformal inference (Gibbs & Candès 2021, "quantile
  tracking" form of Angelopoulos et al. 2023) on the log of the bound, per (app, model, k-bucket):
  realised coverage tracks ``q`` even when the served model is not the one the forest was trained on.
- :class:`RunningQuantileFallback` -- the bound used when no model is loaded: the running q-quantile
  of observed lengths per app (conditioned on ``> k``), capped by ``max_tokens``.
- :func:`load_examples` -- training data: AlpacaEval JSON and jitflow length telemetry JSONL
  (format in :data:`TELEMETRY_KIND` / :func:`telemetry_record`).

The asynchronous, batched serving wrapper is :mod:`jitflow_server.analyzer.length_service`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: Version of the saved-model layout; :meth:`LengthPredictor.load` rejects other versions.
FORMAT_VERSION = 1
#: Version of the feature definitions; telemetry rows carrying other versions are re-featurised
#: from text when possible, otherwise skipped.
FEATURE_VERSION = 1
#: Marker written at the top of every saved model.
MODEL_MAGIC = "jitflow-length-qrf"
#: ``kind`` field of one length-telemetry JSONL record (one finished request per line).
TELEMETRY_KIND = "jitflow.length.v1"
DEFAULT_QUANTILE = 0.9
#: Generated-token counts at which refinement training rows are built (JITServe re-predicts every
#: 50 tokens; the forest interpolates between grid points because ``k`` is a feature).
DEFAULT_REFINE_GRID: tuple[int, ...] = (50, 100, 150, 200, 300, 400, 600, 800, 1200, 1600)
#: k-buckets of the online calibrator (a bound issued at k uses the bucket of the largest edge <= k).
CALIBRATION_BUCKETS: tuple[int, ...] = (0, 50, 100, 200, 400)
#: Bound used by the fallback when nothing has been observed yet and the request has no max_tokens.
DEFAULT_FALLBACK_TOKENS = 1024
ENV_MODEL_PATH = "JITFLOW_LENGTH_MODEL"


class LengthModelError(Exception):
    """A length model file is missing, unreadable, corrupt, of another format version, or unusable."""


def default_model_path() -> Path:
    """Path of the default length model: ``$JITFLOW_LENGTH_MODEL`` or ``~/.cache/jitflow/models/length-qrf.pkl``."""
    env = os.environ.get(ENV_MODEL_PATH)
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/jitflow/models/length-qrf.pkl").expanduser()


# --------------------------------------------------------------------------------------------------
# Tokenizer seam
# --------------------------------------------------------------------------------------------------

_REGEX_TOKEN = re.compile(r"\w+|[^\w\s]|\n")


class TokenCounter:
    """Counts tokens and cuts generated prefixes with one tokenizer, used consistently everywhere.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (anything with ``encode_batch`` returning encodings
    with ``.ids`` and ``.offsets``) or ``None`` for the regex fallback (``\\w+|[^\\w\\s]|\\n``, one token
    per word, punctuation mark or newline; roughly 1.2 tokens per English word). ``name`` identifies
    the tokenizer in saved models and telemetry.
    """

    def __init__(self, tokenizer: Any | None = None, name: str | None = None) -> None:
        self._tok = tokenizer
        self.name = name or ("regex-words-v1" if tokenizer is None else "tokenizers")

    def _offsets(self, texts: Sequence[str]) -> list[list[tuple[int, int]]]:
        if self._tok is None:
            return [[m.span() for m in _REGEX_TOKEN.finditer(t)] for t in texts]
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [list(e.offsets) for e in encs]

    def count(self, texts: Sequence[str]) -> list[int]:
        """Number of tokens of each text (list of ``len(texts)`` ints)."""
        if not texts:
            return []
        if self._tok is None:
            return [sum(1 for _ in _REGEX_TOKEN.finditer(t)) for t in texts]
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [len(e.ids) for e in encs]

    def prefixes(self, text: str, ks: Sequence[int]) -> tuple[int, list[str]]:
        """``(n_tokens, [text of the first k tokens for k in ks])`` for one text (k clipped to n)."""
        offs = self._offsets([text])[0]
        n = len(offs)
        out = []
        for k in ks:
            k = min(int(k), n)
            out.append(text[: offs[k - 1][1]] if k > 0 else "")
        return n, out


_COUNTER: TokenCounter | None = None
_COUNTER_FACTORY: Callable[[], TokenCounter] | None = None
_COUNTER_LOCK = threading.Lock()


def set_token_counter_factory(factory: Callable[[], TokenCounter] | None) -> None:
    """Install how the process-wide :class:`TokenCounter` is built (called once, lazily, on first use).

    The analyzer never loads a tokenizer itself: whoever knows the served model does. The ``jitflow``
    command line installs the demo model's locally trained BPE (the tokenizer the demo engine serves
    with, so counts match the engine's token counts). Resets a counter already built.
    """
    global _COUNTER, _COUNTER_FACTORY
    with _COUNTER_LOCK:
        _COUNTER_FACTORY = factory
        _COUNTER = None


def get_token_counter() -> TokenCounter:
    """The process-wide :class:`TokenCounter`: the installed factory's (see
    :func:`set_token_counter_factory`), else the regex fallback. A failing factory logs a warning and
    the regex fallback is used."""
    global _COUNTER
    with _COUNTER_LOCK:
        if _COUNTER is None:
            try:
                _COUNTER = _COUNTER_FACTORY() if _COUNTER_FACTORY is not None else TokenCounter(None)
            except Exception as exc:  # ImportError, or a failure while building the tokenizer
                logger.warning("tokenizer unavailable (%s); counting tokens with the regex fallback", exc)
                _COUNTER = TokenCounter(None)
        return _COUNTER


def count_tokens(texts: Sequence[str]) -> list[int]:
    """Token counts of ``texts`` with the process-wide tokenizer (see :func:`get_token_counter`)."""
    return get_token_counter().count(texts)


# --------------------------------------------------------------------------------------------------
# Features (data-independent; FEATURE_VERSION)
# --------------------------------------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9']+")
_CUES: dict[str, tuple[str, ...]] = {
    "list": ("list", "steps", "ways", "examples", "tips", "ideas", "names", "suggest", "options", "recommend"),
    "long": ("essay", "article", "story", "blog", "explain", "describe", "detailed", "guide", "plan",
             "compare", "analyze", "analyse", "discuss", "outline", "poem", "letter", "speech", "script"),
    "short": ("short", "brief", "briefly", "concise", "sentence", "one", "word", "title", "slogan",
              "tweet", "yes", "classify", "correct", "grammar", "rewrite", "paraphrase", "translate"),
    "code": ("code", "python", "function", "program", "sql", "javascript", "java", "script", "regex",
             "html", "css", "c++", "bash", "implement", "algorithm"),
    "math": ("calculate", "solve", "equation", "compute", "sum", "how", "many", "much"),
    "question": ("what", "who", "when", "where", "which", "why", "is", "are", "does", "can"),
}
_COUNT_SPEC = re.compile(r"\b(\d{1,4})\s*(-|\s)?\s*(words?|sentences?|paragraphs?|items?|lines?|bullet|points?|"
                         r"examples?|ideas?|tips?|ways?|steps?|reasons?|names?|questions?|characters?)\b")
_UNIT_SCALE = {"word": 1.3, "sentence": 25.0, "paragraph": 120.0, "line": 12.0, "character": 0.3}
_FIRST_WORDS = ("what", "how", "write", "give", "can", "i", "create", "explain", "is", "why", "please",
                "tell", "make", "describe", "list", "generate", "who", "do", "suggest", "find")
N_HASH = 32


def _stable_hash(token: str) -> int:
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little")


_HASH_CACHE: dict[str, tuple[int, float]] = {}


def _hashed_bow(words: Sequence[str], n: int = N_HASH) -> np.ndarray:
    """Signed feature hashing of words into ``n`` buckets, l2-normalised (a fixed random projection)."""
    v = np.zeros(n, dtype=np.float64)
    for w in words:
        hs = _HASH_CACHE.get(w)
        if hs is None:
            h = _stable_hash(w)
            hs = (h % n, 1.0 if (h >> 32) & 1 else -1.0)
            if len(_HASH_CACHE) < 200_000:
                _HASH_CACHE[w] = hs
        v[hs[0]] += hs[1]
    norm = np.linalg.norm(v)
    return v / norm if norm > 0 else v


PROMPT_FEATURE_NAMES: tuple[str, ...] = (
    ("log_tokens", "log_chars", "n_lines", "n_qmarks", "digit_frac", "mean_word_len", "n_sentences")
    + tuple(f"cue_{c}" for c in _CUES)
    + ("req_count_log", "req_count_tokens_log", "has_code_block", "has_quote", "has_colon_input")
    + tuple(f"first_{w}" for w in _FIRST_WORDS)
    + tuple(f"h{i}" for i in range(N_HASH))
)
PREFIX_FEATURE_NAMES: tuple[str, ...] = (
    "log_k", "k", "nl_per_tok", "n_list_items", "max_item_no", "n_headings", "in_code_block",
    "n_code_fences", "last_par_tokens_log", "n_paragraphs", "ends_sentence", "has_conclusion",
)


def prompt_features(prompts: Sequence[str], n_tokens: Sequence[int] | None = None) -> np.ndarray:
    """Feature matrix of prompts, shape ``(len(prompts), len(PROMPT_FEATURE_NAMES))``, float64.

    Prompt length (log tokens with the :class:`TokenCounter`; pass ``n_tokens`` to avoid recounting),
    shape statistics, keyword-cue counts (list/long/short/code/math/question), an explicit requested
    count ("in 100 words", "5 tips") converted to an approximate token target, first-word indicators
    and a 32-bucket signed hashed bag of words. No fitted state: the same text always gives the same
    vector (FEATURE_VERSION).
    """
    if n_tokens is None:
        n_tokens = count_tokens(prompts)
    out = np.zeros((len(prompts), len(PROMPT_FEATURE_NAMES)), dtype=np.float64)
    for i, (text, nt) in enumerate(zip(prompts, n_tokens, strict=True)):
        low = text.lower()
        words = _WORD.findall(low)
        wset = set(words)
        n_chars = len(text)
        row: list[float] = [
            math.log1p(nt),
            math.log1p(n_chars),
            float(text.count("\n") + 1),
            float(text.count("?")),
            sum(c.isdigit() for c in text) / max(n_chars, 1),
            (sum(len(w) for w in words) / len(words)) if words else 0.0,
            float(len(re.findall(r"[.!?](\s|$)", text))),
        ]
        for cue_words in _CUES.values():
            row.append(float(sum(1 for w in cue_words if w in wset)))
        m = _COUNT_SPEC.search(low)
        if m:
            num = float(m.group(1))
            unit = m.group(3).rstrip("s")
            row += [math.log1p(num), math.log1p(num * _UNIT_SCALE.get(unit, 30.0))]
        else:
            row += [0.0, 0.0]
        row += [float("```" in text), float('"' in text or "“" in text), float(":" in text)]
        first = words[0] if words else ""
        row += [float(first == w) for w in _FIRST_WORDS]
        out[i, : len(row)] = row
        out[i, len(row):] = _hashed_bow(words)
    return out


_LIST_ITEM = re.compile(r"^\s*(?:[-*•]|(\d{1,3})[.)])\s+", re.M)


def prefix_features(prefixes: Sequence[str], ks: Sequence[int]) -> np.ndarray:
    """Features of generated prefixes, shape ``(len(prefixes), len(PREFIX_FEATURE_NAMES))``.

    ``ks`` are the generated-token counts (tokens of the served model's tokenizer); a row with
    ``k == 0`` is all zeros. Features describe the structure generated so far: newlines per token,
    list items and the highest item number, markdown headings, whether a code block is open, the
    length of the current paragraph, and whether the text ends a sentence or has started a
    conclusion ("in summary", "overall", ...).
    """
    out = np.zeros((len(prefixes), len(PREFIX_FEATURE_NAMES)), dtype=np.float64)
    for i, (text, k) in enumerate(zip(prefixes, ks, strict=True)):
        k = int(k)
        if k <= 0:
            continue
        items = _LIST_ITEM.findall(text)
        nums = [int(x) for x in items if x]
        fences = text.count("```")
        pars = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
        last = pars[-1] if pars else ""
        tail = text.rstrip()[-1:] if text.strip() else ""
        low_tail = text[-600:].lower()
        out[i] = [
            math.log1p(k),
            float(k),
            text.count("\n") / k,
            float(len(items)),
            float(max(nums) if nums else 0),
            float(len(re.findall(r"^\s*#{1,6}\s", text, re.M)) + len(re.findall(r"^\*\*[^*\n]+\*\*", text, re.M))),
            float(fences % 2),
            float(fences),
            math.log1p(len(_REGEX_TOKEN.findall(last))),
            float(len(pars)),
            float(tail in ".!?"),
            float(any(s in low_tail for s in ("in summary", "in conclusion", "overall,", "to summarize",
                                               "hope this helps", "let me know", "i hope"))),
        ]
    return out


class ContextEncoder:
    """One-hot encoding of the categorical context (app, stage, model) with a vocabulary fitted at training.

    Unknown or missing values encode as all zeros for that field. ``max_values`` bounds the vocabulary
    per field (most frequent values kept).
    """

    FIELDS = ("app", "stage", "model")

    def __init__(self, max_values: int = 16) -> None:
        self.max_values = max_values
        self.vocab: dict[str, list[str]] = {f: [] for f in self.FIELDS}

    def fit(self, contexts: Sequence[Mapping[str, Any] | None]) -> ContextEncoder:
        """Learn the vocabulary from training contexts (dicts with optional app/stage/model keys)."""
        for f in self.FIELDS:
            counts: dict[str, int] = {}
            for c in contexts:
                v = (c or {}).get(f)
                if v is not None:
                    counts[str(v)] = counts.get(str(v), 0) + 1
            # a field with a single value carries no information
            keep = sorted(counts, key=lambda v: (-counts[v], v))[: self.max_values]
            self.vocab[f] = keep if len(keep) > 1 else []
        return self

    @property
    def names(self) -> list[str]:
        """Column names, ``field=value``."""
        return [f"{f}={v}" for f in self.FIELDS for v in self.vocab[f]]

    def transform(self, contexts: Sequence[Mapping[str, Any] | None]) -> np.ndarray:
        """Shape ``(len(contexts), len(self.names))`` one-hot matrix."""
        cols = self.names
        out = np.zeros((len(contexts), len(cols)), dtype=np.float64)
        offset = 0
        for f in self.FIELDS:
            index = {v: j for j, v in enumerate(self.vocab[f])}
            for i, c in enumerate(contexts):
                v = (c or {}).get(f)
                j = index.get(str(v)) if v is not None else None
                if j is not None:
                    out[i, offset + j] = 1.0
            offset += len(self.vocab[f])
        return out


# --------------------------------------------------------------------------------------------------
# Training data
# --------------------------------------------------------------------------------------------------


@dataclass
class LengthExample:
    """One finished response usable for training/evaluation.

    ``output_len`` is in tokens of the :class:`TokenCounter` named ``tokenizer``. Either ``prompt``
    text or ``prompt_features`` (a FEATURE_VERSION vector) is present; ``output`` text (optional)
    enables refinement rows at the refine grid; ``prefix_features`` maps ``k`` to a prefix-feature
    vector recorded online (telemetry without text).
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

    @property
    def context(self) -> dict[str, Any]:
        """The categorical context dict ``{"app", "model", "stage"}``."""
        return {"app": self.app, "model": self.model, "stage": self.stage}

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
) -> dict[str, Any]:
    """One line of the jitflow length-telemetry JSONL (one finished request per line).

    Format ``{"kind": "jitflow.length.v1", "ts": unix_s, "tokenizer": str, "feature_version": int,
    "app", "model", "stage": str|null, "max_tokens": int|null, "output_len": int (tokens),
    "prompt_tokens": int|null, "bound0": int|null (bound issued at arrival),
    "prompt": str (optional, only when text recording is on), "output": str (optional),
    "prompt_features": [float] (optional), "prefix_features": {"<k>": [float]} (optional)}``.
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
    }
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
# Predictor
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
        counts (default: counted with :attr:`counter`). ``prompt_feats`` may be passed to reuse
        cached :func:`prompt_features` rows.
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
        """Load a predictor saved by :meth:`save`.

        Raises :class:`LengthModelError` (with the path and reason) if the file is missing, not a
        jitflow length model, of another format/feature version, or corrupt. Logs a warning if the
        model was trained with another tokenizer than the current one.
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


def load_predictor_or_none(path: str | os.PathLike[str] | None = None) -> LengthPredictor | None:
    """Load the length model at ``path`` (default :func:`default_model_path`); on any
    :class:`LengthModelError` log a warning and return ``None`` (callers then use the fallback)."""
    path = Path(path).expanduser() if path is not None else default_model_path()
    try:
        return LengthPredictor.load(path)
    except LengthModelError as exc:
        logger.warning("length model unavailable, using the running-quantile fallback: %s", exc)
        return None


def finalize_bound(raw: float, k: int, max_tokens: int | None) -> int:
    """Turn a raw bound (float tokens) into the served bound: ceil, cap by ``max_tokens``, never below ``k``.

    Result ``>= k + 1`` while ``k < max_tokens`` (the request is still running), ``<= max_tokens``.
    """
    b = int(math.ceil(raw)) if math.isfinite(raw) else (max_tokens or DEFAULT_FALLBACK_TOKENS)
    floor = k + 1
    if max_tokens is not None and max_tokens > 0:
        b = min(b, int(max_tokens))
        floor = min(floor, int(max_tokens))
    return max(b, floor, 1)


# --------------------------------------------------------------------------------------------------
# Online calibration and fallback
# --------------------------------------------------------------------------------------------------


def calibration_bucket(k: int) -> int:
    """Calibration bucket of a bound issued after ``k`` generated tokens (largest edge <= k)."""
    b = 0
    for edge in CALIBRATION_BUCKETS:
        if k >= edge:
            b = edge
    return b


class OnlineCalibrator:
    """Adaptive conformal inference on the bound, per (app, model, k-bucket). Thread-safe.

    The served bound is ``raw · exp(θ_g)``. After each finished request, for every bound it was
    issued (one per k-bucket), ``θ_g ← θ_g + γ·(1[len > bound] − (1 − q))`` (Gibbs & Candès 2021,
    online quantile tracking on the log-score ``log(len/raw)``): long-run miss rate of every group
    tends to ``1 − q`` whatever the distribution shift, with error ``O(1/(γT))``. A new group starts
    from the θ of the global group of its k-bucket (which is updated by every observation), so an
    unseen model/app inherits what was learned so far. ``step`` γ is in log units (0.05 ≈ 5 %).
    """

    def __init__(self, quantile: float = DEFAULT_QUANTILE, step: float = 0.05, max_abs: float = 3.0) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        if step <= 0:
            raise ValueError("step must be > 0")
        self.quantile = quantile
        self.step = step
        self.max_abs = max_abs
        self._theta: dict[tuple[str, str, int], float] = {}
        self._n: dict[tuple[str, str, int], int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(app: str | None, model: str | None, k: int) -> tuple[str, str, int]:
        return (str(app) if app is not None else "", str(model) if model is not None else "", calibration_bucket(k))

    def theta(self, app: str | None, model: str | None, k: int) -> float:
        """Current log-scale offset of the group (inherits the global one for an unseen group)."""
        key = self._key(app, model, k)
        with self._lock:
            if key in self._theta:
                return self._theta[key]
            return self._theta.get(("*", "*", key[2]), 0.0)

    def factor(self, app: str | None, model: str | None, k: int) -> float:
        """Multiplicative factor ``exp(θ)`` applied to the raw bound."""
        return math.exp(self.theta(app, model, k))

    def update(self, app: str | None, model: str | None, k: int, issued_bound: float, true_len: int) -> None:
        """Record that a bound ``issued_bound`` (as served, tokens) given after ``k`` tokens saw ``true_len``."""
        miss = 1.0 if true_len > issued_bound else 0.0
        delta = self.step * (miss - (1.0 - self.quantile))
        key = self._key(app, model, k)
        gkey = ("*", "*", key[2])
        with self._lock:
            g = self._theta.get(gkey, 0.0)
            cur = self._theta.get(key, g)
            self._theta[key] = float(np.clip(cur + delta, -self.max_abs, self.max_abs))
            self._n[key] = self._n.get(key, 0) + 1
            if key != gkey:
                self._theta[gkey] = float(np.clip(g + delta, -self.max_abs, self.max_abs))
                self._n[gkey] = self._n.get(gkey, 0) + 1

    def state(self) -> dict[str, dict[str, float]]:
        """Snapshot ``{"app|model|bucket": {"theta", "n"}}`` (for metrics/debugging)."""
        with self._lock:
            return {"|".join(map(str, k)): {"theta": v, "n": self._n.get(k, 0)} for k, v in self._theta.items()}


class RunningQuantileFallback:
    """Bound without a model: running q-quantile of observed lengths per app, capped by ``max_tokens``.

    Keeps the last ``window`` observed total lengths per app (and overall). For a request after
    ``k`` tokens the bound is the q-quantile of the app's observed lengths that exceed ``k`` (the
    overall history if the app has fewer than ``min_count`` of them), capped by ``max_tokens``;
    with no history, ``max_tokens`` or :data:`DEFAULT_FALLBACK_TOKENS`. Never below ``k + 1``.
    Thread-safe.
    """

    def __init__(self, quantile: float = DEFAULT_QUANTILE, window: int = 2000, min_count: int = 20,
                 default_tokens: int = DEFAULT_FALLBACK_TOKENS) -> None:
        self.quantile = quantile
        self.window = window
        self.min_count = min_count
        self.default_tokens = default_tokens
        self._hist: dict[str, deque[int]] = {}
        self._cache: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()

    def observe(self, app: str | None, output_len: int) -> None:
        """Record one finished request's total output length (tokens)."""
        with self._lock:
            for key in {str(app), "*"}:
                self._hist.setdefault(key, deque(maxlen=self.window)).append(int(output_len))
            self._cache.clear()

    def _q(self, key: str, k: int) -> float | None:
        ck = (key, int(k) // 50 * 50)
        if ck in self._cache:
            return self._cache[ck]
        hist = self._hist.get(key)
        val = None
        if hist:
            arr = np.fromiter(hist, dtype=np.int64)
            arr = arr[arr > ck[1]]
            if len(arr) >= self.min_count:
                val = float(np.quantile(arr, self.quantile, method="higher"))
        self._cache[ck] = val
        return val

    def bound(self, app: str | None, k: int = 0, max_tokens: int | None = None) -> int:
        """Fallback bound (int tokens) for a request of ``app`` after ``k`` generated tokens."""
        with self._lock:
            q = self._q(str(app), k)
            if q is None:
                q = self._q("*", k)
        if q is None:
            q = float(max_tokens) if max_tokens else float(self.default_tokens)
        return finalize_bound(q, k, max_tokens)
