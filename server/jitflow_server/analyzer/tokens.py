"""The one tokenizer seam of the analyzer: :class:`TokenCounter` counts tokens and cuts generated prefixes.

The analyzer never loads a tokenizer itself (it must not import the engine); whoever knows the served
model supplies it, in one of two ways:

- explicitly: ``LengthPredictor(counter=...)``, ``LengthPredictor.load(path, counter=...)``,
  ``LengthService(..., counter=...)``, ``LengthService.from_default_model(counter=...)``,
  ``load_examples(paths, counter=...)``. The API passes a counter built from the engine's Hugging Face
  tokenizer, so bounds are in the served model's tokens;
- as the process-wide default (:func:`get_token_counter`) used wherever no counter is passed: the
  ``jitflow`` command line installs the demo model's BPE with :func:`set_token_counter_factory`; with
  nothing installed it is the regex fallback.

A saved length model records its counter's :attr:`TokenCounter.name`; loading it with a counter of
another name logs a warning (bounds would be in other units).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Tokenizer seam
# --------------------------------------------------------------------------------------------------

#: Tokens of the regex fallback: a word, a punctuation mark or a newline.
WORD_TOKEN_RE = re.compile(r"\w+|[^\w\s]|\n")
#: :attr:`TokenCounter.name` of the regex fallback.
REGEX_COUNTER_NAME = "regex-words-v1"
#: Sections of a ``tokenizer.json`` that decide token counts without special tokens.
COUNTING_PARTS: tuple[str, ...] = ("added_tokens", "normalizer", "pre_tokenizer", "model")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Name of a ``tokenizers.Tokenizer`` that identifies how it counts: ``<model><vocab>-<digest>``,
    e.g. ``bpe2359-3f2a9c81d0``.

    The digest (SHA-1, 10 hex digits) covers the parts of the tokenizer's JSON form that decide the
    counts without special tokens (:data:`COUNTING_PARTS`: added tokens, normalizer, pre-tokenizer,
    model with vocabulary and merges), not the post-processor, decoder, truncation or padding that a
    Hugging Face wrapper sets. So the same tokenizer loaded from ``tokenizer.json`` or through
    ``AutoTokenizer`` gets the same name, and two tokenizers that count differently get different names.
    """
    spec = json.loads(tokenizer.to_str())
    counting = {k: spec.get(k) for k in COUNTING_PARTS}
    digest = hashlib.sha1(json.dumps(counting, sort_keys=True).encode()).hexdigest()[:10]
    model = str(spec.get("model", {}).get("type") or type(tokenizer.model).__name__).lower()
    return f"{model}{tokenizer.get_vocab_size(with_added_tokens=True)}-{digest}"


def _private_copy(tokenizer: Any) -> Any:
    """A copy of a ``tokenizers.Tokenizer`` without truncation or padding, so that settings a caller (e.g.
    a Hugging Face wrapper setting ``truncation=True`` for one call) leaves on the shared object never
    change the counts. Objects that cannot be copied (no ``to_str``/``from_str``) are used as given."""
    if not (hasattr(tokenizer, "to_str") and hasattr(type(tokenizer), "from_str")):
        return tokenizer
    copy = type(tokenizer).from_str(tokenizer.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


class TokenCounter:
    """Counts tokens and cuts generated prefixes with one tokenizer, used consistently everywhere.

    ``tokenizer`` is one of:

    - a ``tokenizers.Tokenizer`` (anything with ``encode_batch`` returning encodings with ``.ids`` and
      ``.offsets``), e.g. the demo model's BPE;
    - a Hugging Face *fast* tokenizer (``AutoTokenizer.from_pretrained(...)``, what the engine serves
      with): its ``backend_tokenizer`` (a ``tokenizers.Tokenizer``) is used, so counts equal the
      engine's without special tokens;
    - ``None``: the regex fallback (``\\w+|[^\\w\\s]|\\n``, one token per word, punctuation mark or
      newline; roughly 1.2 tokens per English word), named ``regex-words-v1``.

    The counter keeps its own copy of a ``tokenizers.Tokenizer``, without truncation or padding, so it
    shares no state with the engine's.

    ``name`` identifies the tokenizer in saved models and telemetry; by default
    :func:`tokenizer_fingerprint`, so two counters built from the same tokenizer have the same name
    however it was loaded. Raises ``TypeError`` for a tokenizer of another kind (e.g. a slow Hugging
    Face tokenizer, which has no ``backend_tokenizer``).
    """

    def __init__(self, tokenizer: Any | None = None, name: str | None = None) -> None:
        if tokenizer is not None and not hasattr(tokenizer, "encode_batch"):
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None or not hasattr(backend, "encode_batch"):
                raise TypeError(f"TokenCounter needs a tokenizers.Tokenizer or a fast Hugging Face tokenizer, "
                                f"got {type(tokenizer).__name__}")
            tokenizer = backend
        self._tok = _private_copy(tokenizer) if tokenizer is not None else None
        if name is None:
            name = REGEX_COUNTER_NAME if tokenizer is None else tokenizer_fingerprint(tokenizer)
        self.name = name

    def _offsets(self, texts: Sequence[str]) -> list[list[tuple[int, int]]]:
        if self._tok is None:
            return [[m.span() for m in WORD_TOKEN_RE.finditer(t)] for t in texts]
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [list(e.offsets) for e in encs]

    def count(self, texts: Sequence[str]) -> list[int]:
        """Number of tokens of each text (list of ``len(texts)`` ints)."""
        if not texts:
            return []
        if self._tok is None:
            return [sum(1 for _ in WORD_TOKEN_RE.finditer(t)) for t in texts]
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
    with, so counts match the engine's token counts). Resets a counter already built; ``None``
    restores the regex fallback. Code that knows the served model's tokenizer should rather pass a
    counter explicitly (see the module docstring).
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
