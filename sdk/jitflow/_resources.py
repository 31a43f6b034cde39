"""The resources of the clients, as in openai-python: ``client.chat.completions``, ``client.completions``
and ``client.models``, async (:class:`AsyncChat`, :class:`AsyncCompletions`, :class:`AsyncModels`) and
sync (:class:`Chat`, :class:`Completions`, :class:`Models`). Each holds its client and builds the request
body; the client sends it (``jitflow/_client.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import BaseModel

from ._slo import SLO
from ._streaming import AsyncStream, Stream
from ._types import ChatCompletion, ChatCompletionChunk, Completion, ModelList

if TYPE_CHECKING:
    from ._client import AsyncClient, Client

def _check_messages(messages: Any) -> list[Any]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for m in messages:
        if isinstance(m, BaseModel):
            m = m.model_dump(exclude_none=True)
        if not isinstance(m, Mapping) or "role" not in m:
            raise ValueError(f"each message must be a mapping with a 'role', got {m!r}")
        out.append(dict(m))
    return out


def _compact(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _check_prompt(prompt: Any) -> None:
    if not isinstance(prompt, (str, list)) or (isinstance(prompt, str) and not prompt):
        raise ValueError("prompt must be a non-empty string or a list of token ids")


def _chat_body(model: str, messages: list[Any], max_tokens: int | None, temperature: float | None,
               response_format: Mapping[str, Any] | None) -> dict[str, Any]:
    """The JSON body of ``POST /v1/chat/completions`` (the sync and async ``create`` share it)."""
    return _compact({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                     "response_format": dict(response_format) if response_format is not None else None})


class AsyncChat:
    """``client.chat`` namespace."""

    def __init__(self, client: AsyncClient) -> None:
        self.completions = AsyncChatCompletions(client)


class AsyncChatCompletions:
    """``client.chat.completions``."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(
        self,
        *,
        messages: Sequence[Mapping[str, Any]],
        model: str | None = None,
        stream: bool = False,
        max_tokens: int | None = None,
        temperature: float | None = None,
        response_format: Mapping[str, Any] | None = None,
        slo: SLO | dict[str, Any] | None = None,
        waiting_time: float | None = None,
        parents: Sequence[str] | None = None,
        timeout: float | httpx.Timeout | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        """``POST /v1/chat/completions``.

        Args:
            messages: OpenAI chat messages (non-empty list of ``{"role", "content"}``).
            model: model id (default: task/client model, else the server's first model).
            stream: if True, returns an :class:`AsyncStream` of :class:`ChatCompletionChunk`
                (sent once the response headers arrive, so admission errors raise here).
            max_tokens: output-token cap. temperature: sampling temperature.
            response_format: OpenAI ``response_format`` object.
            slo: :class:`Latency` | :class:`Deadline` | :class:`Compound` | :class:`BestEffort` or a
                wire dict. Default: none outside a task; inside a task ``Compound`` with the time
                left to the task deadline (``BestEffort`` in a best-effort stage).
            waiting_time: admission bound in seconds, merged into the SLO.
            parents: explicit parent call ids inside a task (default: previous stage's calls).
            timeout: per-call timeout override (seconds / ``httpx.Timeout``).
            extra_headers, extra_body, **extra: merged into the request headers / JSON body.

        Returns:
            :class:`ChatCompletion` (``.jitflow`` = :class:`Timing`) or an :class:`AsyncStream`.

        Raises:
            ValueError: bad ``messages`` / SLO values (pydantic ``ValidationError`` is a ValueError).
            APIStatusError subclasses, AdmissionRejectedError, APIConnectionError, APITimeoutError,
            DeadlineExceededError (implicit stage after the task deadline).
        """
        msgs = _check_messages(messages)
        model = await self._client._resolve_model(model)
        body = _chat_body(model, msgs, max_tokens, temperature, response_format)
        return await self._client._llm(
            "/v1/chat/completions", "chat", body, stream=stream, cast=ChatCompletion,
            chunk_cls=ChatCompletionChunk, slo=slo, waiting_time=waiting_time, parents=parents,
            timeout=timeout, extra_headers=extra_headers, extra_body=extra_body, extra=extra,
        )


class AsyncCompletions:
    """``client.completions`` (legacy text completions)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(
        self,
        *,
        prompt: str | list[int],
        model: str | None = None,
        stream: bool = False,
        max_tokens: int | None = None,
        temperature: float | None = None,
        slo: SLO | dict[str, Any] | None = None,
        waiting_time: float | None = None,
        parents: Sequence[str] | None = None,
        timeout: float | httpx.Timeout | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> Completion | AsyncStream[Completion]:
        """``POST /v1/completions``; same arguments and errors as chat, with ``prompt`` (text or
        token ids) instead of ``messages``. Streamed chunks are :class:`Completion` objects."""
        _check_prompt(prompt)
        model = await self._client._resolve_model(model)
        body = _compact({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature})
        return await self._client._llm(
            "/v1/completions", "text_completion", body, stream=stream, cast=Completion,
            chunk_cls=Completion, slo=slo, waiting_time=waiting_time, parents=parents,
            timeout=timeout, extra_headers=extra_headers, extra_body=extra_body, extra=extra,
        )


class AsyncModels:
    """``client.models``."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self) -> ModelList:
        """``GET /v1/models`` -> :class:`ModelList` (``.data`` is a list of :class:`Model`)."""
        response = await self._client._request("GET", "/v1/models")
        return self._client._parse(ModelList, response)


# ============================================================================ sync


class Chat:
    """``client.chat`` namespace (sync)."""

    def __init__(self, client: Client) -> None:
        self.completions = ChatCompletions(client)


class ChatCompletions:
    """``client.chat.completions`` (sync)."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(
        self,
        *,
        messages: Sequence[Mapping[str, Any]],
        model: str | None = None,
        stream: bool = False,
        max_tokens: int | None = None,
        temperature: float | None = None,
        response_format: Mapping[str, Any] | None = None,
        slo: SLO | dict[str, Any] | None = None,
        waiting_time: float | None = None,
        parents: Sequence[str] | None = None,
        timeout: float | httpx.Timeout | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> ChatCompletion | Stream[ChatCompletionChunk]:
        """Sync twin of :meth:`AsyncChatCompletions.create` (returns a :class:`Stream` when
        ``stream=True``)."""
        msgs = _check_messages(messages)
        model = self._client._resolve_model(model)
        body = _chat_body(model, msgs, max_tokens, temperature, response_format)
        return self._client._llm(
            "/v1/chat/completions", "chat", body, stream=stream, cast=ChatCompletion,
            chunk_cls=ChatCompletionChunk, slo=slo, waiting_time=waiting_time, parents=parents,
            timeout=timeout, extra_headers=extra_headers, extra_body=extra_body, extra=extra,
        )


class Completions:
    """``client.completions`` (sync)."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(
        self,
        *,
        prompt: str | list[int],
        model: str | None = None,
        stream: bool = False,
        max_tokens: int | None = None,
        temperature: float | None = None,
        slo: SLO | dict[str, Any] | None = None,
        waiting_time: float | None = None,
        parents: Sequence[str] | None = None,
        timeout: float | httpx.Timeout | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> Completion | Stream[Completion]:
        """Sync twin of :meth:`AsyncCompletions.create`."""
        _check_prompt(prompt)
        model = self._client._resolve_model(model)
        body = _compact({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature})
        return self._client._llm(
            "/v1/completions", "text_completion", body, stream=stream, cast=Completion,
            chunk_cls=Completion, slo=slo, waiting_time=waiting_time, parents=parents,
            timeout=timeout, extra_headers=extra_headers, extra_body=extra_body, extra=extra,
        )


class Models:
    """``client.models`` (sync)."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def list(self) -> ModelList:
        """``GET /v1/models`` -> :class:`ModelList`."""
        response = self._client._request("GET", "/v1/models")
        return self._client._parse(ModelList, response)
