"""``POST /v1/responses``: OpenAI's Responses API on the chat-completions serving path.

A Responses request is translated into a chat request (:func:`to_chat`: ``instructions`` and the
``input`` messages become chat messages, ``max_output_tokens`` the token cap, ``text.format`` the
``response_format``) and served by the same code (:func:`~jitflow_server.api.serving.start_call`):
admission, length bounds, scheduling hints, task context and telemetry are the chat endpoint's. Only
the answer's shape differs: a ``response`` object, or the Responses stream of typed events
(``response.created`` … ``response.output_text.delta`` … ``response.completed``).

SLOs: the fields Concord puts on ``client.responses.create`` (``deadline``, ``target_ttft``,
``target_tbt``, ``waiting_time``, seconds; pass them in the OpenAI client's ``extra_body``) or
jitflow's ``slo`` object, not both; ``jitflow`` carries the compound task context as for chat.

What is refused with a 400 naming the field (never silently dropped): tools and tool choice,
``previous_response_id`` and ``conversation`` (no conversation state is kept), ``store: true`` and
``background: true`` (responses are not stored), ``include``, ``reasoning``, ``prompt`` templates,
``top_logprobs``, and input items other than text messages (images, files, function calls).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from jitflow_server.api.schemas import (
    SLO,
    APIError,
    ChatCompletionRequest,
    Integer,
    TaskContext,
    check_seconds,
    check_utf8,
    null_is_default,
)
from jitflow_server.api.serving import Started, release_call, respond_json

#: Text content part types of an input message (``output_text``: an earlier assistant turn).
TEXT_PARTS = ("input_text", "output_text", "text")
#: Roles of an input message; ``developer`` is OpenAI's newer name for ``system``.
ROLES = ("user", "system", "developer", "assistant")
#: Concord's SLO fields (seconds).
SLO_FIELDS = ("deadline", "target_ttft", "target_tbt", "waiting_time")


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` body (OpenAI Responses API plus Concord's SLO fields and jitflow's)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: Integer | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stream: bool = False
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    deadline: float | None = None
    target_ttft: float | None = None
    target_tbt: float | None = None
    waiting_time: float | None = None
    slo: SLO | None = None
    jitflow: TaskContext | None = None
    # Fields this server does not serve: accepted only when they ask for nothing.
    tools: list[Any] | None = None
    tool_choice: Any = None
    previous_response_id: str | None = None
    conversation: Any = None
    store: bool | None = None
    background: bool | None = None
    include: list[Any] | None = None
    reasoning: Any = None
    prompt: Any = None
    top_logprobs: Integer | None = None

    @field_validator(*SLO_FIELDS, mode="before")
    @classmethod
    def _seconds(cls, v: Any, info) -> Any:
        return check_seconds(v, info.field_name)

    @field_validator("temperature", "top_p", "stream", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info) -> Any:
        return null_is_default(cls, v, info.field_name)

    @field_validator("instructions")
    @classmethod
    def _instructions_utf8(cls, v: Any) -> Any:
        return check_utf8(v) if isinstance(v, str) else v

    @field_validator("tools", "tool_choice", "previous_response_id", "conversation", "store", "background",
                     "include", "reasoning", "prompt", "top_logprobs")
    @classmethod
    def _not_served(cls, v: Any, info) -> Any:
        if v is None or v in ("none", "auto") or (not v and not isinstance(v, str)):  # asks for nothing
            return v
        why = {"store": "responses are not stored", "background": "responses are not stored",
               "previous_response_id": "no conversation state is kept",
               "conversation": "no conversation state is kept"}.get(info.field_name, "not supported")
        raise ValueError(f"{why} by this server")


def _messages(body: ResponsesRequest) -> list[dict[str, str]]:
    """Chat messages of ``instructions`` + ``input``. Raises ``APIError(400)`` naming ``input[i]...``."""
    msgs = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return [*msgs, {"role": "user", "content": _utf8_or_400(body.input, "input")}]
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind != "message":
            raise APIError(400, f"input item type {kind!r} is not supported by this server (text messages only)",
                           param=f"input[{i}].type")
        role = item.get("role")
        if role not in ROLES:
            raise APIError(400, f"input[{i}].role must be one of {', '.join(ROLES)}", param=f"input[{i}].role")
        content = item.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(
                        part.get("text"), str):
                    raise APIError(400, f"content part type {part.get('type') if isinstance(part, dict) else part!r} "
                                        "is not supported by this server (text only)",
                                   param=f"input[{i}].content[{j}].type")
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise APIError(400, f"input[{i}].content must be a string or a list of text parts",
                           param=f"input[{i}].content")
        msgs.append({"role": "system" if role == "developer" else role,
                     "content": _utf8_or_400(text, f"input[{i}].content")})
    if not msgs:
        raise APIError(400, "input has no messages", param="input")
    return msgs


def _utf8_or_400(text: str, param: str) -> str:
    try:
        return check_utf8(text)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None


def _slo(body: ResponsesRequest) -> SLO | None:
    """The request's SLO: the ``slo`` object, or Concord's fields (latency from ``target_ttft`` and
    ``target_tbt``, deadline from ``deadline``). Raises ``APIError(400)`` on a conflict."""
    given = [f for f in SLO_FIELDS if getattr(body, f) is not None]
    if body.slo is not None:
        if given:
            raise APIError(400, f"give the SLO either as slo or as {given[0]}, not both", param=given[0])
        return body.slo
    if not given:
        return None
    latency = body.target_ttft is not None or body.target_tbt is not None
    if latency and body.deadline is not None:
        raise APIError(400, "deadline and target_ttft/target_tbt are different SLO kinds; give one",
                       param="deadline")
    if latency:
        missing = "target_tbt" if body.target_tbt is None else "target_ttft" if body.target_ttft is None else None
        if missing:
            raise APIError(400, f"{missing} is required with the other latency target", param=missing)
        return SLO(kind="latency", ttft=body.target_ttft, tbt=body.target_tbt, waiting_time=body.waiting_time)
    if body.deadline is not None:
        kind = "compound" if body.jitflow is not None else "deadline"
        return SLO(kind=kind, deadline=body.deadline, waiting_time=body.waiting_time)
    return SLO(kind="compound" if body.jitflow is not None else "best_effort", waiting_time=body.waiting_time)


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return {"type": fmt.get("type")}


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves ``body``. Raises ``APIError(400)`` naming the Responses field."""
    return ChatCompletionRequest.model_construct(
        model=body.model, messages=_messages(body), max_tokens=body.max_output_tokens, max_completion_tokens=None,
        temperature=body.temperature, top_p=body.top_p, n=1, stream=body.stream, stream_options=None, stop=None,
        seed=None, ignore_eos=False, min_tokens=0, user=body.user, slo=_slo(body), jitflow=body.jitflow,
        vllm_xargs=None, response_format=_response_format(body))


#: Chat parameter names in errors of the shared serving path, as the Responses request names them.
PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format.type": "text.format.type"}


def responses_param(param: str | None) -> str | None:
    """``param`` of an error raised while serving a translated request, named as the Responses body does."""
    if param is None:
        return None
    if param.startswith("response_format.json_schema."):
        return "text.format." + param[len("response_format.json_schema."):]
    return PARAMS.get(param, param)


def response_object(body: ResponsesRequest, rid: str, created: float, *, status: str, text: str | None,
                    usage: dict[str, int] | None, finish_reason: str | None, summary: dict | None) -> dict[str, Any]:
    """The Responses API ``response`` object (OpenAI's required fields, plus the ``jitflow`` summary)."""
    output = []
    if text is not None:
        output = [{"type": "message", "id": _item_id(rid), "status": status, "role": "assistant",
                   "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}]
    incomplete = finish_reason == "length"
    return {
        "id": rid, "object": "response", "created_at": created,
        "status": "incomplete" if incomplete and status == "completed" else status,
        "completed_at": time.time() if status == "completed" else None, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
        "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": None, "store": False, "temperature": body.temperature,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}}, "tool_choice": "none", "tools": [],
        "top_p": body.top_p, "truncation": body.truncation or "disabled",
        **({"user": body.user} if body.user is not None else {}),
        "metadata": body.metadata or {},
        **({} if usage is None else {"usage": {  # absent, not null, until known (OpenAI's schema)
            "input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}}),
        "jitflow": summary,
    }


async def respond(state, body: ResponsesRequest, started: Started, request: Request):
    """The answer to a started call: a ``response`` object, or the Responses event stream."""
    created = started.call.timing.arrival
    if not body.stream:
        chat = await respond_json(state, started, True, request)
        choice = chat["choices"][0]
        return response_object(body, started.call.rid, created, status="completed", text=choice["message"]["content"],
                               usage=chat["usage"], finish_reason=choice["finish_reason"], summary=chat["jitflow"])
    return StreamingResponse(_events(state, body, started, created), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": started.call.rid})


def _sse(seq: list[int], event: dict[str, Any]) -> bytes:
    event["sequence_number"] = seq[0]
    seq[0] += 1
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


async def _events(state, body: ResponsesRequest, started: Started, created: float) -> AsyncIterator[bytes]:
    """The Responses stream: created, in_progress, the message item and its text part opened, one
    ``response.output_text.delta`` per chunk of text, then the part, item and response closed
    (``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut it). An engine
    failure mid-stream is an ``error`` event."""
    call, finish = started.call, started.finish
    rid, seq = call.rid, [0]
    item_id = _item_id(rid)
    loc = {"item_id": item_id, "output_index": 0, "content_index": 0}
    ok, parts = False, []
    try:
        shell = response_object(body, rid, created, status="in_progress", text=None, usage=None, finish_reason=None,
                                summary=None)
        yield _sse(seq, {"type": "response.created", "response": shell})
        yield _sse(seq, {"type": "response.in_progress", "response": shell})
        item = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}
        yield _sse(seq, {"type": "response.output_item.added", "output_index": 0, "item": item})
        yield _sse(seq, {"type": "response.content_part.added", **loc,
                         "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
        ev = started.first
        while True:
            try:
                text, _ = call.absorb(ev)
            except APIError as err:
                yield _sse(seq, {"type": "error", "code": err.type, "message": err.message, "param": None})
                return
            if text:
                parts.append(text)
                yield _sse(seq, {"type": "response.output_text.delta", **loc, "delta": text, "logprobs": []})
            if call.finished:
                break
            ev = await call.next()
        ok = call.finish_reason is not None and call.finish_reason != "abort"
        full = "".join(parts)
        summary = finish(ok)
        part = {"type": "output_text", "text": full, "annotations": [], "logprobs": []}
        yield _sse(seq, {"type": "response.output_text.done", **loc, "text": full, "logprobs": []})
        yield _sse(seq, {"type": "response.content_part.done", **loc, "part": part})
        done = response_object(body, rid, created, status="completed", text=full, usage=started.usage(),
                               finish_reason=call.finish_reason, summary=summary)
        yield _sse(seq, {"type": "response.output_item.done", "output_index": 0, "item": done["output"][0]})
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        yield _sse(seq, {"type": kind, "response": done})
    finally:
        await release_call(state, call, finish, ok)


def _item_id(rid: str) -> str:
    """The id of the one message item of response ``rid`` (``msg_`` + the response's hex digits)."""
    return "msg_" + rid.removeprefix("resp_")


def new_response_id() -> str:
    """A Responses API id (``resp_`` + 24 hex digits)."""
    return f"resp_{uuid.uuid4().hex[:24]}"
