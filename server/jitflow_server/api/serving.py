"""The request path of ``/v1/chat/completions`` and ``/v1/completions``.

For each request: validate the lengths, decide the SLO and the admission deadline, ask the task
manager (compound calls) and the length predictor for advice, build the request's one
:class:`~jitflow_server.scheduler.hints.SchedHints`, hand a
:class:`~jitflow_server.engine.protocol.GenerateRequest` to the engine, and answer with a JSON body or
an SSE stream carrying the measured ``jitflow`` timing object (TTFT, TBT, E2EL, ``slo_met``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from jitflow_server.analyzer.advisor import resolve_len_bound
from jitflow_server.api.auth import request_tenant
from jitflow_server.api.calls import LiveCall, deadline_infeasible
from jitflow_server.api.context_headers import context_from_headers
from jitflow_server.api.limits import check_json_schema
from jitflow_server.api.schemas import SLO, APIError
from jitflow_server.api.state import ServerState
from jitflow_server.api.tracing import end_request_span, start_request_span
from jitflow_server.engine.protocol import GenerateRequest, InvalidRequestError, StructuredOutput
from jitflow_server.scheduler.admission import AdmissionDeadline, admission_deadline, compound_waiting_time
from jitflow_server.scheduler.hints import HintsError, SchedHints, reserved_keys
from jitflow_server.scheduler.types import SLOSpec
from jitflow_server.tracker.metrics import RequestTiming


# Streams are written here (``data: <json>`` events through Starlette's ``StreamingResponse``), not with
# sse-starlette's ``EventSourceResponse``: that one ends every open stream as soon as uvicorn starts
# shutting down (its shutdown watcher, ``shutdown_grace_period`` 0 by default), which would cut the SIGTERM
# drain that lets in-flight streams finish (``jitflow serve --drain-timeout``), and its keep-alive pings
# add nothing for streams whose first byte waits for the first token. Starlette's response already
# notices a client that disconnects.
def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


#: How often a non-streaming request checks that its client is still connected (s).
DISCONNECT_POLL_S = 0.25


def structured_output(response_format: dict[str, Any] | None, max_tokens: int) -> StructuredOutput | None:
    """The constrained-decoding spec of an OpenAI ``response_format`` for a request of ``max_tokens``
    output tokens. Raises ``APIError(400)`` naming the field, for an unknown type or a schema outside the
    limits of ``api/limits.py``."""
    if not response_format:
        return None
    t = response_format.get("type")
    if t in (None, "text"):
        return None
    if t == "json_object":
        return StructuredOutput(json_object=True)
    if t == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be an object",
                           param="response_format.json_schema.schema")
        check_json_schema(schema, max_tokens)
        return StructuredOutput(schema=schema)
    raise APIError(400, f"unsupported response_format.type {t!r}", param="response_format.type")


def _check_lengths(state: ServerState, body, n_prompt: int, chat: bool) -> int:
    """The request's ``max_tokens`` (tokens). Raises ``APIError(400)`` when it does not fit the context."""
    max_len = state.engine.max_model_len
    if n_prompt >= max_len:
        raise APIError(400, f"prompt has {n_prompt} tokens; the model's context is {max_len}",
                       param="messages" if chat else "prompt")
    room = max_len - n_prompt
    max_tokens = body.max_completion_tokens or body.max_tokens or min(state.settings.default_max_tokens, room)
    if max_tokens > room:
        raise APIError(400, f"max_tokens {max_tokens} + prompt {n_prompt} tokens exceeds the context "
                       f"of {max_len}", param="max_tokens")
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens {body.min_tokens} exceeds max_tokens {max_tokens}", param="min_tokens")
    return max_tokens


def _waiting_time(state: ServerState, slo: SLO) -> float | None:
    """Admission deadline (s after arrival, JITServe §5): the request's own, else the server default."""
    if slo.waiting_time is not None:
        return slo.waiting_time
    if slo.kind != "best_effort":
        return state.settings.default_waiting_time
    return state.settings.best_effort_waiting_time


def _admission(state: ServerState, kind: str, deadline: float | None, waiting_time: float | None,
               prompt_tokens: int, len_bound: int) -> AdmissionDeadline:
    """The request's admission deadline: its waiting time, tightened for E2EL-deadline requests to their
    latest feasible start (priced alone; the engine's room is the overcommitment test, see
    ``scheduler/admission.py``) when deadline admission is on and the engine reports its speed."""
    rate = state.service if state.settings.deadline_admission else None
    held = state.commitments(rate) if rate is not None and kind == "deadline" else None
    return admission_deadline(kind, deadline, waiting_time, prompt_tokens=prompt_tokens, len_bound=len_bound,
                              rate=rate, safety=state.settings.admission_safety, held=held, now=time.time(),
                              batch=1)


@dataclasses.dataclass
class Started:
    """A call the engine has started: its :class:`LiveCall`, first queue event and the :class:`_Finisher`
    that records its outcome once. Whoever answers the client owns it from here: it must end with
    :func:`release_call` (as :func:`respond_json` does)."""

    call: LiveCall
    first: Any
    finish: _Finisher

    def usage(self) -> dict[str, int]:
        """OpenAI usage of the call so far (tokens)."""
        return _usage(self.call)


async def release_call(state: ServerState, call: LiveCall, finish: _Finisher, ok: bool) -> dict:
    """End an answered call: abort its engine request if it is still running, then count it as let go
    (``state.in_flight``) and record its outcome (``finish(ok)``), whose summary is returned. The abort comes
    first, so the server never reports a call released while the engine still holds it; the release
    happens even when the abort fails or is cancelled."""
    try:
        await call.close()
    finally:
        state.in_flight -= 1
        summary = finish(ok)
    return summary


async def serve_request(state: ServerState, body, prompt_ids: list[int], request: Request, *, chat: bool,
                        prompt_text: str = ""):
    """Serve one chat or text completion (see the module docstring). Raises ``APIError``."""
    started = await start_call(state, body, prompt_ids, request, chat=chat, prompt_text=prompt_text)
    if not body.stream:
        return await respond_json(state, started, chat, request)
    usage = body.stream_options is not None and body.stream_options.include_usage
    return StreamingResponse(_respond_stream(state, started.call, started.first, started.finish, chat, usage),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": started.call.rid})


async def start_call(state: ServerState, body, prompt_ids: list[int], request: Request, *, chat: bool,
                     prompt_text: str = "", rid: str | None = None) -> Started:
    """Admit and start one call and wait for its first event (admission control answers 429 here, before
    any byte of the answer). ``body`` is a chat or completion request; ``rid`` the request id (default
    ``chatcmpl-…`` / ``cmpl-…``). Raises ``APIError``."""
    arrival = time.time()
    tenant = request_tenant(request)
    bad = reserved_keys(body.vllm_xargs)
    if bad:
        raise APIError(400, f"vllm_xargs key {bad[0]!r} is reserved: jitflow sets scheduling hints itself",
                       param=f"vllm_xargs.{bad[0]}")
    h_slo, h_task = context_from_headers(request.headers)
    slo = body.slo or h_slo or SLO()
    task_ctx = body.jitflow or h_task
    slo.check_required(in_task=task_ctx is not None)
    max_tokens = _check_lengths(state, body, len(prompt_ids), chat)
    rid = rid or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    waiting_time = _waiting_time(state, slo)
    timing = RequestTiming(rid, SLOSpec(slo.kind, slo.ttft, slo.tbt, slo.deadline, waiting_time), arrival,
                           len(prompt_ids))
    hints = dict(kind=slo.kind, request_id=rid, arrival=arrival, ttft=slo.ttft, tbt=slo.tbt,
                 deadline=slo.deadline, waiting_time=waiting_time)
    pattern_bound = None
    advice = None
    app_name = None
    if state.tasks is not None and task_ctx is not None:
        advice = await state.tasks.advise_call(task_ctx, body.model, rid, len(prompt_ids), max_tokens, timing,
                                               tenant)
        if advice.analyzer != "ok":
            state.metrics.analyzer_fallbacks.labels(advice.analyzer).inc()
        timing.slo = advice.slo
        timing.sub_deadline = advice.sub_deadline
        app_name = advice.app
        pattern_bound = advice.len_bound
        hints.update(kind="compound", task_id=advice.task_id, stage_index=advice.stage_index,
                     deadline=advice.slo.deadline, sub_deadline=advice.sub_deadline - arrival,
                     task_tokens_est=advice.task_tokens_est, task_rem_gen_time=advice.task_rem_gen_time)
        wait = compound_waiting_time(waiting_time, advice.sub_deadline - arrival, state.settings.compound_waiting)
        if wait != waiting_time:  # longer, with compound_waiting="sub_deadline"
            waiting_time = hints["waiting_time"] = wait
            timing.slo = dataclasses.replace(timing.slo, waiting_time=wait)
    exact = bool(body.ignore_eos)
    predicted = None
    fmt = None
    if state.length is not None and not exact:
        fmt = body.response_format.get("type") if isinstance(body.response_format, dict) else None
        state.length.submit(rid, prompt_text, app=app_name, model=state.model_name,
                            stage=task_ctx.stage if task_ctx else None, max_tokens=max_tokens,
                            kind=str(hints["kind"]), response_format=fmt)
        predicted = state.length.latest(rid)  # provisional (fallback) bound; refined asynchronously
    len_bound, source = resolve_len_bound(max_tokens, exact=exact, pattern=pattern_bound, predicted=predicted)
    timing.len_bound = len_bound
    admit = _admission(state, str(hints["kind"]), slo.deadline, waiting_time, len(prompt_ids), len_bound)
    if admit.binding == "deadline":
        if admit.refuse_now:
            if state.length is not None:
                state.length.discard(rid)
            state.deadline_rejections += 1
            state.metrics.observe(timing, "rejected", timing.summary(finished_ok=False), app_name)
            raise deadline_infeasible(slo.deadline, admit.service_time, admit.reason)
        waiting_time = admit.waiting_time
        hints["waiting_time"] = waiting_time
        timing.slo = dataclasses.replace(timing.slo, waiting_time=waiting_time)
    try:
        sched_hints = SchedHints(**hints, len_bound=len_bound)
    except HintsError as exc:
        raise APIError(400, str(exc), param=f"slo.{exc.field}" if exc.field else None) from None
    gen = GenerateRequest(
        request_id=rid, prompt_token_ids=prompt_ids, max_tokens=max_tokens, hints=sched_hints,
        temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=body.stop,
        ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
        structured=structured_output(body.response_format, max_tokens),
        trace_headers={k: v for k, v in request.headers.items() if k in ("traceparent", "tracestate")} or None,
    )
    call = LiveCall(state, gen, timing, waiting_time, prompt_text=prompt_text, len_bound=len_bound,
                    admission=admit,
                    bound_source=source, app=app_name,
                    stage_samples=advice.len_samples if advice is not None and source == "pattern" else None,
                    stage_pos=advice.stage_pos if advice is not None else 0)
    try:
        call.start()
    except InvalidRequestError as exc:
        if state.length is not None:
            state.length.discard(rid)
        raise APIError(400, str(exc), param=exc.field) from None
    span = start_request_span(state.model_name, gen, timing, chat=chat, task_ctx=task_ctx)
    state.event(arrival, "arrive", rid, f"{slo.kind} max_tokens={max_tokens} stream={bool(body.stream)}")
    state.in_flight += 1
    state.waiting_first_token += 1
    state.live[rid] = call
    try:
        first = await _first_event(call, request)
    except BaseException as exc:
        try:
            await call.close()  # abort the engine request before the server counts the call as let go
        finally:
            state.waiting_first_token -= 1
            state.in_flight -= 1
            outcome = "rejected" if isinstance(exc, APIError) and exc.status == 429 else "aborted"
            state.metrics.observe(timing, outcome, timing.summary(finished_ok=False), app_name)
            state.forget(rid)
            if state.length is not None:
                state.length.discard(rid)
            span.set_attribute("error.type", outcome)
            span.end()
            if state.tasks is not None and task_ctx is not None:
                state.tasks.on_call_end(task_ctx, rid, timing, ok=False, tenant=tenant)
        raise
    state.waiting_first_token -= 1
    state.event(time.time(), "first_token", rid)
    return Started(call, first, _Finisher(state, call, span, task_ctx, tenant))


class _Finisher:
    """Records the outcome of one call exactly once: metrics, length telemetry, task graph, span."""

    def __init__(self, state: ServerState, call: LiveCall, span, task_ctx, tenant: str = "") -> None:
        self.state, self.call, self.span, self.task_ctx, self.tenant = state, call, span, task_ctx, tenant
        self.summary: dict | None = None

    def __call__(self, ok: bool) -> dict:
        if self.summary is not None:
            return self.summary
        state, call, timing = self.state, self.call, self.call.timing
        summary = self.summary = timing.summary(finished_ok=ok)
        state.event(time.time(), "done", call.rid, f"ok={ok} tokens={summary['output_tokens']}")
        state.forget(call.rid)
        if state.length is not None:
            if ok:
                state.length.observe(call.rid, len(timing.token_times))
            else:
                state.length.discard(call.rid)
        if ok and call.stage_samples is not None and state.tasks is not None:
            state.tasks.advisor.stage_calibrator.observe(call.app, call.stage_pos, call.stage_issued,
                                                         len(timing.token_times))
        if not ok:
            outcome = "aborted"
        elif summary["slo_met"] is None:
            outcome = "best_effort"
        else:
            outcome = "slo_met" if summary["slo_met"] else "slo_missed"
        state.metrics.observe(timing, outcome, summary, call.app)
        if state.tasks is not None and self.task_ctx is not None:
            state.tasks.on_call_end(self.task_ctx, call.rid, timing, ok=ok, tenant=self.tenant)
        end_request_span(self.span, timing, summary, call.finish_reason)
        return summary


def _usage(call: LiveCall) -> dict[str, int]:
    n_in, n_out = call.timing.prompt_tokens, len(call.timing.token_times)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


async def _until_disconnect(aw: Awaitable[Any], request: Request) -> Any:
    """The result of ``aw``, or ``None`` once the client has disconnected (checked whenever ``aw`` has not
    finished for :data:`DISCONNECT_POLL_S`); ``aw`` is then cancelled and awaited."""
    waiting = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
            if done:
                return waiting.result()
            if await request.is_disconnected():
                return None
    finally:
        if not waiting.done():
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await waiting


async def _first_event(call: LiveCall, request: Request):
    """``call.first()`` (admission control included), or ``APIError(499)`` once the client has disconnected
    while the call waited for its first token. Without the check a stream whose client gave up stayed
    queued until the engine ran its prefill: measured on the demo engine, 45 requests abandoned at once
    took 8.5 s of engine time to leave, one batch of prefills at a time; with it they leave within
    :data:`DISCONNECT_POLL_S` and none of them is prefilled."""
    ev = await _until_disconnect(call.first(), request)
    if ev is None:
        raise APIError(499, "the client closed the connection before the first token",
                       type="client_closed_request", code="client_disconnected")
    return ev


async def _next_event(call: LiveCall, request: Request):
    """The call's next queue event, or ``None`` once its client has disconnected."""
    return await _until_disconnect(call.next(), request)


async def respond_json(state: ServerState, started: Started, chat: bool, request: Request) -> dict:
    """Collect the whole answer as a chat or text completion. A client that disconnects meanwhile is
    noticed within :data:`DISCONNECT_POLL_S` and its engine request is aborted (nothing is left running)."""
    call, first, finish = started.call, started.first, started.finish
    text_parts: list[str] = []
    ok = False
    last_check = time.monotonic()
    try:
        ev = first
        while True:
            text, _ = call.absorb(ev)
            text_parts.append(text)
            if call.finished:
                break
            now = time.monotonic()
            if now - last_check >= DISCONNECT_POLL_S:  # tokens are flowing: still check now and then
                last_check = now
                if await request.is_disconnected():
                    ev = None
            if ev is not None:
                ev = await _next_event(call, request)
            if ev is None:
                state.event(time.time(), "abort", call.rid, "client disconnected (non-streaming)")
                break
        ok = call.finish_reason is not None and call.finish_reason != "abort"
    finally:
        summary = await release_call(state, call, finish, ok)
    text = "".join(text_parts)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                  "finish_reason": call.finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": call.finish_reason, "logprobs": None}
    return {"id": call.rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(call.timing.arrival), "model": state.model_name, "choices": [choice],
            "usage": _usage(call), "jitflow": summary}


async def _respond_stream(state: ServerState, call: LiveCall, first, finish: _Finisher,
                          chat: bool, usage: bool) -> AsyncIterator[bytes]:
    """The SSE stream as OpenAI sends it: a role chunk (chat), content chunks, the last one with its
    ``finish_reason`` and jitflow's ``jitflow`` summary (an extra field clients ignore), then, only with
    ``stream_options.include_usage``, a chunk with empty ``choices`` and the ``usage``, then ``[DONE]``."""
    ok = False
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": call.rid, "object": obj, "created": int(call.timing.arrival), "model": state.model_name}
    try:
        if chat:
            yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None, "logprobs": None}]})
        ev = first
        while True:
            try:
                text, ids = call.absorb(ev)
            except APIError as err:
                yield _sse(err.body())
                return
            if ids or text or call.finished:
                fr = call.finish_reason if call.finished else None
                if chat:
                    choice = {"index": 0, "delta": {"content": text}, "finish_reason": fr, "logprobs": None}
                else:
                    choice = {"index": 0, "text": text, "finish_reason": fr, "logprobs": None}
                extra = {}
                if call.finished:
                    ok = call.finish_reason is not None and call.finish_reason != "abort"
                    extra = {"jitflow": finish(ok)}
                yield _sse({**head, "choices": [choice], **extra})
            if call.finished:
                break
            ev = await call.next()
        if usage:
            yield _sse({**head, "choices": [], "usage": _usage(call), "jitflow": finish(ok)})
        yield b"data: [DONE]\n\n"
    finally:
        await release_call(state, call, finish, ok)
