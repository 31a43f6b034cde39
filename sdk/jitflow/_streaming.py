"""Server-sent-event streams of chunks (async and sync twins).

The wire: ``data: <chunk JSON>`` events; the last chunk before ``data: [DONE]`` has
``choices == []``, ``usage`` and the ``jitflow`` timing; ``data: {"error": {...}}`` mid-stream
raises :class:`jitflow.StreamError`. The Responses API's stream has typed events instead (the last one
carries the response with its ``usage`` and ``jitflow``), no ``[DONE]``, and ``{"type": "error", ...}``
for an error.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from ._exceptions import APIConnectionError, APIError, APITimeoutError, stream_error_from_event

if TYPE_CHECKING:  # pragma: no cover
    from ._calls import LLMCall
    from ._types import Timing, Usage

__all__ = ["AsyncStream", "Stream"]

ChunkT = TypeVar("ChunkT", bound=BaseModel)


class _SSEDecoder:
    """Minimal SSE decoder (WHATWG): returns the ``data`` payload of each complete event.

    Kept instead of httpx-sse, which was tried: its ``EventSource`` refuses a response whose
    ``Content-Type`` is not ``text/event-stream`` and drops a last event that the server ended without its
    blank line; this decoder reads both (``tests/test_sdk_client.py::test_sse_multiline_comments_and_missing_done``),
    as the OpenAI client does, so a proxy that rewrites headers or a server that closes early still
    delivers the final chunk with the usage and timing."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if line == "":
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        return None

    def end(self) -> str | None:
        return self.feed("")


class _StreamState(Generic[ChunkT]):
    """What both stream flavours accumulate while iterating."""

    def __init__(
        self, response: httpx.Response, chunk_cls: type[ChunkT], call: LLMCall | None, attempts: int = 1
    ) -> None:
        self.response = response
        self.attempts = attempts
        self._chunk_cls = chunk_cls
        self._call = call
        self.id: str | None = None
        self.model: str | None = None
        self.timing: Timing | None = None
        self.usage: Usage | None = None
        self.finish_reasons: list[str] = []
        self._content_chunks = 0
        self._done = False

    @property
    def call_id(self) -> str | None:
        """The SDK call id inside a compound task (see :attr:`ChatCompletion.call_id`)."""
        return self._call.call_id if self._call is not None and self._call.record is not None else None

    def _decode(self, data: str) -> ChunkT | None:
        """Decode one event payload; None for ``[DONE]``. Raises StreamError / APIError."""
        if data.strip() == "[DONE]":
            self._done = True
            return None
        try:
            obj: Any = json.loads(data)
        except ValueError as e:
            raise APIError(f"invalid JSON in stream event: {data[:200]!r}") from e
        if isinstance(obj, dict) and "error" in obj and "choices" not in obj:
            raise stream_error_from_event(obj, self.response)
        if isinstance(obj, dict) and obj.get("type") == "error":  # the Responses API's error event
            raise stream_error_from_event({"error": obj}, self.response)
        try:
            chunk = self._chunk_cls.model_validate(obj)
        except ValidationError as e:
            raise APIError(f"unexpected stream chunk: {e}", body=obj) from e
        self._observe(chunk)
        return chunk

    def _observe(self, chunk: Any) -> None:
        self.id = self.id or getattr(chunk, "id", None)
        self.model = self.model or getattr(chunk, "model", None)
        if getattr(chunk, "usage", None) is not None:
            self.usage = chunk.usage
        if getattr(chunk, "jitflow", None) is not None:
            self.timing = chunk.jitflow
        for choice in getattr(chunk, "choices", None) or []:
            if choice.finish_reason:
                self.finish_reasons.append(choice.finish_reason)
            delta = getattr(choice, "delta", None)
            text = delta.content if delta is not None else getattr(choice, "text", None)
            if text:
                self._content_chunks += 1

    def _finish_call(self, error: BaseException | None) -> None:
        if self._call is not None:
            self._call.finish(
                error=error,
                timing=self.timing,
                usage=self.usage,
                response_id=self.id,
                response_model=self.model,
                finish_reasons=self.finish_reasons,
                output_tokens=self._content_chunks,
            )

    @staticmethod
    def _map_transport_error(e: httpx.HTTPError, request: httpx.Request | None) -> APIError:
        if isinstance(e, httpx.TimeoutException):
            return APITimeoutError(request=request)
        return APIConnectionError(f"connection error while streaming: {e!r}", request=request)


class AsyncStream(_StreamState[ChunkT]):
    """Async iterator of chunks; use as ``async with`` to guarantee the HTTP response is closed.

    Attributes (complete after iteration): ``timing`` (:class:`jitflow.Timing` from the final
    chunk), ``usage``, ``id``, ``model``, ``finish_reasons``, ``response`` (``httpx.Response``);
    ``attempts``: HTTP attempts it took to open the stream (``1`` + retries of a 429/503).

    Raises while iterating: :class:`jitflow.StreamError` (server error event),
    :class:`jitflow.APIConnectionError` / :class:`jitflow.APITimeoutError`.
    """

    def __init__(
        self, response: httpx.Response, chunk_cls: type[ChunkT], call: LLMCall | None, attempts: int = 1
    ) -> None:
        super().__init__(response, chunk_cls, call, attempts)
        self._iter = self._events()
        self._closed = False

    def __aiter__(self) -> AsyncIterator[ChunkT]:
        return self

    async def __anext__(self) -> ChunkT:
        return await self._iter.__anext__()

    async def _events(self) -> AsyncIterator[ChunkT]:
        error: BaseException | None = None
        decoder = _SSEDecoder()
        try:
            try:
                async for line in self.response.aiter_lines():
                    data = decoder.feed(line)
                    if data is None:
                        continue
                    chunk = self._decode(data)
                    if chunk is None:
                        return
                    yield chunk
                data = decoder.end()
                if data is not None:
                    chunk = self._decode(data)
                    if chunk is not None:
                        yield chunk
            except httpx.HTTPError as e:
                raise self._map_transport_error(e, self.response.request) from e
        except GeneratorExit:
            raise
        except BaseException as e:
            error = e
            if isinstance(e, APIError):
                e.attempts = self.attempts
            raise
        finally:
            await self._close(error)

    async def _close(self, error: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.response.aclose()
        finally:
            self._finish_call(error)

    async def aclose(self) -> None:
        """Stop iterating and close the HTTP response (idempotent)."""
        await self._iter.aclose()
        await self._close(None)

    async def __aenter__(self) -> AsyncStream[ChunkT]:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class Stream(_StreamState[ChunkT]):
    """Sync twin of :class:`AsyncStream` (iterator + context manager)."""

    def __init__(
        self, response: httpx.Response, chunk_cls: type[ChunkT], call: LLMCall | None, attempts: int = 1
    ) -> None:
        super().__init__(response, chunk_cls, call, attempts)
        self._iter = self._events()
        self._closed = False

    def __iter__(self) -> Iterator[ChunkT]:
        return self

    def __next__(self) -> ChunkT:
        return next(self._iter)

    def _events(self) -> Iterator[ChunkT]:
        error: BaseException | None = None
        decoder = _SSEDecoder()
        try:
            try:
                for line in self.response.iter_lines():
                    data = decoder.feed(line)
                    if data is None:
                        continue
                    chunk = self._decode(data)
                    if chunk is None:
                        return
                    yield chunk
                data = decoder.end()
                if data is not None:
                    chunk = self._decode(data)
                    if chunk is not None:
                        yield chunk
            except httpx.HTTPError as e:
                raise self._map_transport_error(e, self.response.request) from e
        except GeneratorExit:
            raise
        except BaseException as e:
            error = e
            if isinstance(e, APIError):
                e.attempts = self.attempts
            raise
        finally:
            self._close(error)

    def _close(self, error: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.response.close()
        finally:
            self._finish_call(error)

    def close(self) -> None:
        """Stop iterating and close the HTTP response (idempotent)."""
        self._iter.close()
        self._close(None)

    def __enter__(self) -> Stream[ChunkT]:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
