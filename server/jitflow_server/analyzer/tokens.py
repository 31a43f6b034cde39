"""The one tokenizer seam of the analyzer: :class:`TokenCounter` counts tokens and cuts generated
prefixes; the process-wide counter is installed by whoever knows the served model
(:func:`set_token_counter_factory`), never loaded by the analyzer itself."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Tokenizer seam
# --------------------------------------------------------------------------------------------------

WORD_TOKEN_RE = re.compile(r"\w+|[^\w\s]|\n")


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
