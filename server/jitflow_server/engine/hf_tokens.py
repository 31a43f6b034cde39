"""Prompt token ids from a Hugging Face tokenizer: the tokenizer half of the ``Engine`` protocol, shared by
the engines that tokenize in the front end (the embedded vLLM engine and the replica router), so both send
an engine the same ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jitflow_server.engine.protocol import EngineError


class HFTokenizerMixin:
    """``vocab_size``, ``encode`` and ``encode_chat`` over ``self.tokenizer`` (a Hugging Face tokenizer,
    ``None`` until the engine starts). Each raises ``EngineError`` with ``not_started_message`` before that."""

    tokenizer: Any = None
    not_started_message = "engine not started"

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise EngineError(self.not_started_message)
        return self.tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (valid prompt ids are ``[0, vocab_size)``)."""
        return len(self._tokenizer())

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no chat template)."""
        return list(self._tokenizer()(text).input_ids)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of ``messages`` (``[{"role", "content"}]``) through the model's chat template, with the
        generation prompt appended."""
        ids = self._tokenizer().apply_chat_template([dict(m) for m in messages], tokenize=True,
                                                    add_generation_prompt=True)
        if hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
