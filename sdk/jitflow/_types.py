"""Response models (pydantic v2), OpenAI-shaped plus jitflow's ``jitflow`` timing object.

All models allow extra fields so newer servers do not break older clients.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, PrivateAttr

__all__ = [
    "Timing",
    "Usage",
    "ChatCompletionMessage",
    "Choice",
    "ChatCompletion",
    "ChoiceDelta",
    "ChunkChoice",
    "ChatCompletionChunk",
    "CompletionChoice",
    "Completion",
    "Model",
    "ModelList",
]


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class Timing(_Base):
    """Server-measured timing of one request (the ``jitflow`` object of a response / final chunk).

    Times named ``*_time`` / ``arrival`` / ``sub_deadline`` are unix seconds; ``ttft``, ``tbt_*``
    and ``e2el`` are durations in seconds; token counts are tokens. Every field is optional on
    parse (a partial object from an older server must not fail the call).

    Attributes:
        request_id: server request id.
        kind: SLO kind the server applied (``latency``/``deadline``/``compound``/``best_effort``).
        arrival: when the server received the request.
        first_token_time, last_token_time: emission times of the first/last output token.
        ttft: time to first token (first_token_time - arrival).
        tbt_max, tbt_mean: max / mean time between consecutive output tokens.
        e2el: end-to-end latency (last_token_time - arrival).
        prompt_tokens, output_tokens: token counts.
        slo_met: whether the request met its SLO as defined in JITServe §3 (``None`` for best effort).
        sub_deadline: the stage sub-deadline the server computed for a compound call
            (``T0 + φ(s)·D``, JITServe §4.1), else ``None``.
        len_bound: the analyzer's output-length upper bound (tokens), else ``None``.
    """

    request_id: Optional[str] = None
    kind: Optional[str] = None
    arrival: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    ttft: Optional[float] = None
    tbt_max: Optional[float] = None
    tbt_mean: Optional[float] = None
    e2el: Optional[float] = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    slo_met: Optional[bool] = None
    sub_deadline: Optional[float] = None
    len_bound: Optional[int] = None


class Usage(_Base):
    """OpenAI token usage (tokens)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatCompletionMessage(_Base):
    """An assistant message."""

    role: str = "assistant"
    content: Optional[str] = None


class Choice(_Base):
    """One choice of a :class:`ChatCompletion`."""

    index: int = 0
    message: ChatCompletionMessage
    finish_reason: Optional[str] = None
    logprobs: Optional[Any] = None


class _WithCallId(_Base):
    _call_id: Optional[str] = PrivateAttr(default=None)

    @property
    def call_id(self) -> Optional[str]:
        """The SDK's call id for this LLM call inside a compound task (usable in ``parents=``)."""
        return self._call_id


class ChatCompletion(_WithCallId):
    """A non-streamed chat completion (``POST /v1/chat/completions``).

    ``jitflow`` carries the server-measured :class:`Timing` (``None`` against a plain OpenAI server).
    """

    id: str
    object: str = "chat.completion"
    created: int = 0
    model: str
    choices: list[Choice]
    usage: Optional[Usage] = None
    jitflow: Optional[Timing] = None

    @property
    def content(self) -> str:
        """Text of the first choice (``""`` if none)."""
        if not self.choices:
            return ""
        return self.choices[0].message.content or ""


class ChoiceDelta(_Base):
    """Incremental message content of a streamed chunk."""

    role: Optional[str] = None
    content: Optional[str] = None


class ChunkChoice(_Base):
    """One choice of a :class:`ChatCompletionChunk`."""

    index: int = 0
    delta: ChoiceDelta = ChoiceDelta()
    finish_reason: Optional[str] = None
    logprobs: Optional[Any] = None


class ChatCompletionChunk(_Base):
    """One SSE event of a streamed chat completion.

    The last chunk before ``[DONE]`` has ``choices == []``, ``usage`` and the ``jitflow`` timing.
    """

    id: str
    object: str = "chat.completion.chunk"
    created: int = 0
    model: str
    choices: list[ChunkChoice] = []
    usage: Optional[Usage] = None
    jitflow: Optional[Timing] = None


class CompletionChoice(_Base):
    """One choice of a :class:`Completion` (also used for streamed completion chunks)."""

    index: int = 0
    text: str = ""
    finish_reason: Optional[str] = None
    logprobs: Optional[Any] = None


class Completion(_WithCallId):
    """A text completion (``POST /v1/completions``); streamed chunks have the same shape."""

    id: str
    object: str = "text_completion"
    created: int = 0
    model: str
    choices: list[CompletionChoice] = []
    usage: Optional[Usage] = None
    jitflow: Optional[Timing] = None

    @property
    def content(self) -> str:
        """Text of the first choice (``""`` if none)."""
        return self.choices[0].text if self.choices else ""


class ResponseUsage(_Base):
    """Token usage of a Responses API answer (``input_tokens``, ``output_tokens``, ``total_tokens``)."""

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        """``input_tokens`` (the chat API's name; the SDK's telemetry reads it)."""
        return self.input_tokens

    @property
    def completion_tokens(self) -> int:
        """``output_tokens`` (the chat API's name)."""
        return self.output_tokens


class Response(_WithCallId):
    """A Responses API answer (``POST /v1/responses``): ``output`` holds message items whose ``content``
    parts carry the text (:attr:`output_text` joins them); ``status`` is ``completed`` or ``incomplete``
    (``max_output_tokens`` reached); ``jitflow`` the server's :class:`Timing`."""

    id: str
    object: str = "response"
    created_at: float = 0.0
    status: str = "completed"
    model: str
    output: list[dict[str, Any]] = []
    incomplete_details: Optional[dict[str, Any]] = None
    usage: Optional[ResponseUsage] = None
    jitflow: Optional[Timing] = None

    @property
    def output_text(self) -> str:
        """The text of every ``output_text`` part of every message item, joined (as openai-python's)."""
        return "".join(part.get("text", "") for item in self.output if item.get("type") == "message"
                       for part in item.get("content") or [] if part.get("type") == "output_text")


class ResponseStreamEvent(_Base):
    """One event of a streamed Responses API answer: ``type`` names it (``response.created``,
    ``response.output_text.delta`` with the text in ``delta``, …, ``response.completed`` or
    ``response.incomplete`` with the whole :class:`Response` in ``response``)."""

    type: str
    sequence_number: int = 0
    delta: Optional[str] = None
    response: Optional[Response] = None

    @property
    def usage(self) -> ResponseUsage | None:
        """The usage of the response this event carries (the last event's), else None."""
        return self.response.usage if self.response is not None else None

    @property
    def jitflow(self) -> Timing | None:
        """The server's timing of the response this event carries (the last event's), else None."""
        return self.response.jitflow if self.response is not None else None

    @property
    def model(self) -> str | None:
        """The model of the response this event carries, else None."""
        return self.response.model if self.response is not None else None

    @property
    def id(self) -> str | None:
        """The id of the response this event carries, else None."""
        return self.response.id if self.response is not None else None


class Model(_Base):
    """A served model (``GET /v1/models``)."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "jitflow"


class ModelList(_Base):
    """The ``GET /v1/models`` response."""

    object: str = "list"
    data: list[Model] = []
