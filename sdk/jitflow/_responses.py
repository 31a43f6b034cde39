"""``client.responses``: OpenAI's Responses API with SLOs (async :class:`AsyncResponses` and sync
:class:`Responses`). The SLO fields are Concord's (``deadline``, ``target_ttft``, ``target_tbt``,
``waiting_time``, seconds); inside a task a call is a stage call as with chat."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from ._slo import SLO, Deadline, Latency
from ._streaming import AsyncStream, Stream
from ._types import Response, ResponseStreamEvent

if TYPE_CHECKING:
    from ._client import AsyncClient, Client


def _slo(slo: SLO | dict[str, Any] | None, deadline: float | None, target_ttft: float | None,
         target_tbt: float | None) -> SLO | dict[str, Any] | None:
    """The call's SLO from ``slo`` or Concord's fields. Raises ``ValueError`` when both are given, when
    only one latency target is, or when a deadline and latency targets are mixed."""
    latency = target_ttft is not None or target_tbt is not None
    if slo is not None and (latency or deadline is not None):
        raise ValueError("give the SLO either as slo= or as deadline=/target_ttft=/target_tbt=, not both")
    if latency:
        if deadline is not None:
            raise ValueError("deadline and target_ttft/target_tbt are different SLO kinds; give one")
        if target_ttft is None or target_tbt is None:
            raise ValueError("target_ttft and target_tbt go together (a latency SLO needs both)")
        return Latency(ttft=target_ttft, tbt=target_tbt)
    if deadline is not None:
        return Deadline(deadline)
    return slo


def _body(model: str, input: str | Sequence[Mapping[str, Any]], instructions: str | None,
          max_output_tokens: int | None, temperature: float | None, text: Mapping[str, Any] | None) -> dict[str, Any]:
    if isinstance(input, str):
        if not input:
            raise ValueError("input must be a non-empty string or a list of message items")
        items: Any = input
    elif isinstance(input, Sequence) and input and all(isinstance(i, Mapping) for i in input):
        items = [dict(i) for i in input]
    else:
        raise ValueError("input must be a non-empty string or a list of message items")
    body = {"model": model, "input": items, "instructions": instructions, "max_output_tokens": max_output_tokens,
            "temperature": temperature, "text": dict(text) if text is not None else None}
    return {k: v for k, v in body.items() if v is not None}


class AsyncResponses:
    """``client.responses``."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(
        self,
        *,
        input: str | Sequence[Mapping[str, Any]],
        model: str | None = None,
        stream: bool = False,
        instructions: str | None = None,
        max_output_tokens: int | None = None,
        temperature: float | None = None,
        text: Mapping[str, Any] | None = None,
        deadline: float | None = None,
        target_ttft: float | None = None,
        target_tbt: float | None = None,
        waiting_time: float | None = None,
        slo: SLO | dict[str, Any] | None = None,
        parents: Sequence[str] | None = None,
        timeout: float | httpx.Timeout | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> Response | AsyncStream[ResponseStreamEvent]:
        """``POST /v1/responses``.

        Args:
            input: the prompt (a string) or OpenAI input message items (``{"role", "content"}``).
            model: model id (default: task/client model, else the server's first model).
            stream: if True, returns an :class:`AsyncStream` of :class:`ResponseStreamEvent`
                (``response.output_text.delta`` events carry the text; the last event the response).
            instructions: system message. max_output_tokens: output-token cap.
            temperature: sampling temperature. text: OpenAI ``text`` object (``{"format": ...}``).
            deadline: E2EL deadline (s). target_ttft, target_tbt: latency SLO (s; both or neither).
            waiting_time: admission bound (s). slo: a jitflow SLO instead of the fields above.
            parents, timeout, extra_headers, extra_body, **extra: as for ``chat.completions.create``.

        Returns:
            :class:`Response` (``.output_text``, ``.usage``, ``.jitflow`` = :class:`Timing`) or a stream.

        Raises:
            ValueError: bad ``input`` or conflicting SLO arguments. The HTTP errors of
            ``chat.completions.create`` (AdmissionRejectedError for a 429, BadRequestError for a 400, ...).
        """
        call_slo = _slo(slo, deadline, target_ttft, target_tbt)
        model = await self._client._resolve_model(model)
        body = _body(model, input, instructions, max_output_tokens, temperature, text)
        return await self._client._llm(
            "/v1/responses", "chat", body, stream=stream, cast=Response, chunk_cls=ResponseStreamEvent,
            slo=call_slo, waiting_time=waiting_time, parents=parents, timeout=timeout,
            extra_headers=extra_headers, extra_body=extra_body, extra=extra,
        )


class Responses:
    """``client.responses`` (sync)."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(
        self,
        *,
        input: str | Sequence[Mapping[str, Any]],
        model: str | None = None,
        stream: bool = False,
        instructions: str | None = None,
        max_output_tokens: int | None = None,
        temperature: float | None = None,
        text: Mapping[str, Any] | None = None,
        deadline: float | None = None,
        target_ttft: float | None = None,
        target_tbt: float | None = None,
        waiting_time: float | None = None,
        slo: SLO | dict[str, Any] | None = None,
        parents: Sequence[str] | None = None,
        timeout: float | httpx.Timeout | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> Response | Stream[ResponseStreamEvent]:
        """Sync twin of :meth:`AsyncResponses.create`."""
        call_slo = _slo(slo, deadline, target_ttft, target_tbt)
        model = self._client._resolve_model(model)
        body = _body(model, input, instructions, max_output_tokens, temperature, text)
        return self._client._llm(
            "/v1/responses", "chat", body, stream=stream, cast=Response, chunk_cls=ResponseStreamEvent,
            slo=call_slo, waiting_time=waiting_time, parents=parents, timeout=timeout,
            extra_headers=extra_headers, extra_body=extra_body, extra=extra,
        )
