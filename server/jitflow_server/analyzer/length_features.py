"""Feature vectors of the length model (JITServe §4.1): data-independent prompt features, generated-prefix
features, request features (``max_tokens``, response format) and the categorical context (app, kind, model,
stage). The prompt and prefix features have no fitted vocabulary, so telemetry recorded by one model
version can train the next; the prompt memory (``length_memory.py``) is the fitted part."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jitflow_server.analyzer.tokens import WORD_TOKEN_RE, count_tokens

#: Version of the feature definitions; telemetry rows carrying other versions are re-featurised
#: from text when possible, otherwise skipped.
FEATURE_VERSION = 2


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
            math.log1p(len(WORD_TOKEN_RE.findall(last))),
            float(len(pars)),
            float(tail in ".!?"),
            float(any(s in low_tail for s in ("in summary", "in conclusion", "overall,", "to summarize",
                                               "hope this helps", "let me know", "i hope"))),
        ]
    return out


REQUEST_FEATURE_NAMES: tuple[str, ...] = ("log_max_tokens", "json_format")
#: Response formats that constrain the output to JSON (OpenAI's ``response_format.type``).
JSON_FORMATS = frozenset({"json_object", "json_schema"})


def request_features(contexts: Sequence[Mapping[str, Any] | None]) -> np.ndarray:
    """Shape ``(len(contexts), 2)``: ``log1p(max_tokens)`` (0 when the request sets none) and 1.0 when
    ``response_format`` (a ``type`` string such as ``"json_schema"``) constrains the output to JSON.

    Requests state these limits themselves; AlpacaEval rows have neither, so the forest learns their
    effect only from serving telemetry (the served bound is capped by ``max_tokens`` in any case).
    """
    out = np.zeros((len(contexts), len(REQUEST_FEATURE_NAMES)))
    for i, c in enumerate(contexts):
        c = c or {}
        mt = c.get("max_tokens")
        if isinstance(mt, (int, float)) and mt > 0:
            out[i, 0] = math.log1p(float(mt))
        out[i, 1] = float(c.get("response_format") in JSON_FORMATS)
    return out


class ContextEncoder:
    """One-hot encoding of the categorical context (app, kind, stage, model) with a vocabulary fitted
    at training.

    Unknown or missing values encode as all zeros for that field. ``max_values`` bounds the vocabulary
    per field (most frequent values kept).
    """

    FIELDS = ("app", "kind", "stage", "model")

    def __init__(self, max_values: int = 16) -> None:
        self.max_values = max_values
        self.vocab: dict[str, list[str]] = {f: [] for f in self.FIELDS}

    def fit(self, contexts: Sequence[Mapping[str, Any] | None]) -> ContextEncoder:
        """Learn the vocabulary from training contexts (dicts with optional app/kind/stage/model keys)."""
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
