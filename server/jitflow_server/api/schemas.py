"""Request bodies of the HTTP API (OpenAI-compatible, plus jitflow's ``slo`` and ``jitflow`` objects).

See ``docs/api.md``. Validation errors become HTTP 400 with ``error.param`` naming the
field (``slo.deadline``, ``max_tokens``, ...).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

SLO_KINDS = ("latency", "deadline", "compound", "best_effort")


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.headers = headers or {}
        self.code = code

    def body(self) -> dict:
        """The JSON error body (OpenAI shape: ``code`` is a short string or ``null``, never the status)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


#: Most stop sequences, and the longest one (characters).
MAX_STOP_SEQUENCES, MAX_STOP_CHARS = 16, 1000


def check_utf8(text: str) -> str:
    """``text`` if it is valid UTF-8 (no lone surrogates), else ``ValueError``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text contains a lone surrogate (not valid UTF-8)") from None
    return text


def check_seconds(v: Any, name: str) -> float | None:
    """``v`` as seconds (``None`` stays ``None``); ``ValueError`` unless it is a positive, finite number
    (``True`` and numeric strings are refused, not coerced)."""
    if v is None:
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number of seconds")
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number of seconds, got {v!r}")
    return float(v)


def _integral(v: Any) -> Any:
    """A JSON number with no fraction (``5.0``) as the integer it is (JSON Schema counts it as one)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


#: An integer field of a request. Request models are strict (OpenAI's schema types, no coercion of
#: ``"5"`` or ``true``), but JSON Schema's ``integer`` includes ``5.0``, so that is accepted.
Integer = Annotated[int, BeforeValidator(_integral)]

def null_is_default(model: type[BaseModel], v: Any, field_name: str) -> Any:
    """``v``, or the field's default when ``v`` is ``null`` (OpenAI's schema makes these fields nullable,
    with ``null`` meaning "the default")."""
    return model.model_fields[field_name].default if v is None else v


class SLO(BaseModel):
    """The ``slo`` object: kind and its parameters (seconds). JITServe §3, §5."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Literal["latency", "deadline", "compound", "best_effort"] = "best_effort"
    ttft: float | None = None
    tbt: float | None = None
    deadline: float | None = None
    waiting_time: float | None = None

    @field_validator("ttft", "tbt", "deadline", "waiting_time", mode="before")
    @classmethod
    def _check(cls, v: Any, info) -> Any:
        return check_seconds(v, info.field_name)

    def check_required(self, in_task: bool = False) -> None:
        """Raise ``APIError(400)`` naming the missing field the kind needs."""
        need = {"latency": ("ttft", "tbt"), "deadline": ("deadline",),
                "compound": () if in_task else ("deadline",), "best_effort": ()}[self.kind]
        for f in need:
            if getattr(self, f) is None:
                raise APIError(400, f"slo.{f} is required for kind {self.kind!r}", param=f"slo.{f}")


class TaskContext(BaseModel):
    """The ``jitflow`` object: which compound task and stage a call belongs to (docs/api.md)."""

    model_config = ConfigDict(extra="allow", strict=True)

    task_id: str = Field(min_length=1, max_length=200)
    #: the application of a task the call registers implicitly (no ``POST /v1/tasks``); ignored for a
    #: registered task, which named its app when it was registered
    app: str | None = Field(default=None, min_length=1, max_length=200)
    stage: str | None = None
    stage_index: Integer = Field(default=0, ge=0)
    call_id: str | None = None
    parents: list[str] = Field(default_factory=list)


class ChatMessage(BaseModel):
    """One chat message (text content, or a list of ``{"type": "text", "text": ...}`` parts)."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("role")
    @classmethod
    def _served_role(cls, v: str) -> str:
        if v == "function":
            raise ValueError("function messages belong to tool calling, which this server does not support")
        return v

    @field_validator("content")
    @classmethod
    def _text_is_utf8(cls, v: Any) -> Any:
        if isinstance(v, str):
            return check_utf8(v)
        for part in v or []:
            if isinstance(part.get("text"), str):
                check_utf8(part["text"])
        return v

    def text(self) -> str:
        """The message's text content."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content if isinstance(p, dict))


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``."""

    model_config = ConfigDict(strict=True)

    include_usage: bool = True


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    max_tokens: Integer | None = Field(default=None, ge=1)
    max_completion_tokens: Integer | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: Integer = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str, Field(max_length=MAX_STOP_CHARS)] | Annotated[
        list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: Integer | None = Field(default=None, ge=-(2**63), lt=2**63)
    ignore_eos: bool = False
    min_tokens: Integer = Field(default=0, ge=0, le=2**31)
    user: str | None = None
    slo: SLO | None = None
    jitflow: TaskContext | None = None
    #: vLLM's ``vllm_xargs`` (flat values). Keys reserved for jitflow (``jitflow_hints``, ``jf_*``,
    #: ``jitflow*``) are rejected with 400: the server alone sets a request's scheduling hints.
    vllm_xargs: dict[str, str | int | float] | None = None
    #: OpenAI fields this server does not implement: accepted when they ask for nothing (``tools: []``,
    #: ``tool_choice: "none"``, ``logprobs: false``), refused with a 400 naming the field otherwise, never
    #: silently dropped (a client asking for tool calls must not get a plain answer as if it had none).
    tools: list[Any] | None = None
    tool_choice: Any = None
    logprobs: bool | Integer | None = None
    top_logprobs: Integer | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    @field_validator("tools", "functions", "tool_choice", "function_call", "logprobs", "top_logprobs")
    @classmethod
    def _not_served(cls, v: Any, info) -> Any:
        if v is None or v == "none" or (not v and not isinstance(v, str)):  # empty, false, 0: asks for nothing
            return v
        what = "logprobs are" if "logprobs" in info.field_name else "tool calling is"
        raise ValueError(f"{what} not supported by this server")

    @field_validator("temperature", "top_p", "n", "stream", "ignore_eos", "min_tokens", mode="before")
    @classmethod
    def _finite_or_default(cls, v: Any, info) -> Any:
        """A finite number (or the field's non-number), ``null`` as the field's default."""
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("must be finite")
        return null_is_default(cls, v, info.field_name)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v > 1:
            raise ValueError(f"n = {v}: one choice per request is served; send {v} requests instead")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_is_utf8(cls, v: Any) -> Any:
        for x in [v] if isinstance(v, str) else v or []:
            check_utf8(x)
            if not x:
                raise ValueError("stop sequences must not be empty")
        return v


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions`` body."""

    #: Text or token ids. OpenAI's other shapes: a list of one prompt is that prompt; a list of several
    #: (a batch) and ``null`` (generate from the start of text) are refused with a 400 naming ``prompt``.
    prompt: str | list[Integer] | list[str] | list[list[Integer]] | None
    response_format: dict[str, Any] | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if v is None:
            raise ValueError("a prompt is required (null, the start of text alone, is not served)")
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) > 1:
                raise ValueError(f"one prompt per request: this is a batch of {len(v)}; send one request each")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return check_utf8(v) if isinstance(v, str) else v
