"""Prompt token ids from a Hugging Face tokenizer, shared by the engines that tokenize in the front end
(the embedded vLLM engine and the replica router), so both send a replica the same ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` (no chat template)."""
    return list(tokenizer(text).input_ids)


def encode_messages(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of ``messages`` (``[{"role", "content"}]``) through the model's chat template, with the
    generation prompt appended."""
    ids = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
