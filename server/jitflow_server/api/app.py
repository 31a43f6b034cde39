"""The jitflow HTTP API: OpenAI-compatible chat/completions with the ``slo`` extension (docs/api.md).

``create_app(engine, settings)`` builds a FastAPI app around a started ``VLLMEngine``
(or builds and starts one in the app's lifespan when given an ``EngineConfig``).
Every request's SLO travels to the scheduler plug-in in ``SamplingParams.extra_args``;
responses carry the measured ``jitflow`` timing object; requests not admitted within
their ``waiting_time`` get HTTP 429 ``admission_rejected`` (JITServe §5).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jitflow_server.api.schemas import (
    SLO,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)
from jitflow_server.api.tracing import setup_tracing_from_env, tracer
from jitflow_server.engine.vllm_engine import EngineConfig, VLLMEngine
from jitflow_server.tracker.goodput import SLOSpec
from jitflow_server.tracker.metrics import RequestTiming, ServerMetrics
from jitflow_server.tracker.steps import STEP_FIELDS

logger = logging.getLogger("jitflow.api")


@dataclass
class ServerSettings:
    """Server-level defaults (seconds, tokens)."""

    default_waiting_time: float = 5.0
    default_max_tokens: int = 256
    best_effort_waiting_time: float | None = None
    length_predictor: bool = True


class ServerState:
    """Everything a request handler needs: the engine, metrics, settings, and optional task/analyzer hooks."""

    def __init__(self, engine: VLLMEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics()
        self.waiting_first_token = 0
        self.in_flight = 0
        self.tasks = None  # jitflow_server.api.tasks.TaskManager, attached when available
        self.length = None  # jitflow_server.analyzer.length_service.LengthService
        self.live: dict[str, _Call] = {}  # in-flight calls (for pushing refined length bounds)
        self._pushed: dict[str, int] = {}
        #: Recent request lifecycle events seen by the HTTP server ``(unix s, event, request id, detail)``:
        #: arrive / first_token / done / abort (diagnostics, bounded; ``GET /v1/jitflow/engine/events``).
        self.events: deque[tuple[float, str, str, str]] = deque(maxlen=256)

    async def push_bounds(self, period: float = 0.1) -> None:
        """Background task: send refined length bounds of in-flight requests to the scheduler.

        The length predictor runs off the scheduling path (JITServe §4.1); the scheduler uses the
        latest bound it was given and never waits for a prediction.
        """
        while True:
            await asyncio.sleep(period)
            if self.length is None or not self.live:
                continue
            upd = {}
            for rid, call in list(self.live.items()):
                if call.fixed_bound:
                    continue
                b = self.length.latest(rid)
                if b is not None and self._pushed.get(rid) != b:
                    upd[rid] = int(b)
            if upd:
                try:
                    await self.engine.rpc("update", {"len_bound": upd})
                    self._pushed.update(upd)
                except Exception:
                    logger.debug("bound push failed", exc_info=True)

    @property
    def model_name(self) -> str:
        return self.engine.config.served_name


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _validation_to_api_error(exc: RequestValidationError) -> APIError:
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # Drop pydantic's union/literal branch tags so the param is the field path.
    loc = [x for x in loc if not x.startswith(("function-", "constrained-", "literal["))
           and x not in ("str", "int", "float", "list[int]", "list[dict[str,any]]")]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class _Call:
    """One in-flight engine request: producer task feeding a queue of (kind, output, time)."""

    def __init__(self, state: ServerState, rid: str, prompt_ids: list[int], sp, timing: RequestTiming,
                 waiting_time: float | None, trace_headers: dict[str, str] | None = None) -> None:
        self.state = state
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.sp = sp
        self.timing = timing
        self.waiting_time = waiting_time
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.finish_reason: str | None = None
        self.task: asyncio.Task | None = None
        self.trace_headers = trace_headers
        self.prompt_text = ""
        self.text: list[str] = []
        self.fixed_bound = False

    async def _produce(self) -> None:
        try:
            gen = self.state.engine.generate(self.prompt_ids, self.sp, self.rid, trace_headers=self.trace_headers)
            async for out in gen:
                self.queue.put_nowait(("out", out, time.time()))
            self.queue.put_nowait(("end", None, time.time()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # engine failure
            self.queue.put_nowait(("error", exc, time.time()))

    def start(self) -> None:
        self.task = asyncio.create_task(self._produce())

    async def first(self) -> tuple:
        """Wait for the first event, enforcing admission (``waiting_time``) with the scheduler."""
        deadline = self.timing.arrival + self.waiting_time if self.waiting_time else None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.time())
            try:
                return await asyncio.wait_for(self.queue.get(), timeout)
            except asyncio.TimeoutError:
                res = await self.state.engine.rpc("reject_waiting", {"ids": [self.rid]})
                if self.rid in (res or {}).get("rejected", []):
                    await self.state.engine.abort(self.rid)
                    self.finished = True
                    raise APIError(
                        429, f"request was not admitted within its waiting_time of {self.waiting_time:g} s",
                        type="admission_rejected", param="slo.waiting_time",
                        headers={"Retry-After": str(max(1, round(self.waiting_time)))},
                    ) from None
                deadline = None  # admitted: wait without a limit

    def absorb(self, ev: tuple) -> tuple[str, list[int]]:
        """Apply one queue event to the timing; returns (delta text, delta token ids)."""
        kind, out, t = ev
        if kind == "error":
            self.finished = True
            raise APIError(500, f"engine failure: {out}", type="engine_error")
        if kind == "end":
            self.finished = True
            return "", []
        c = out.outputs[0]
        ids = list(c.token_ids)
        if ids:
            before = len(self.timing.token_times)
            self.timing.add_tokens(len(ids), t)
            self.text.append(c.text or "")
            n = len(self.timing.token_times)
            svc = self.state.length
            if (svc is not None and not self.fixed_bound and not out.finished
                    and n // svc.refine_every > before // svc.refine_every):
                svc.submit(self.rid, self.prompt_text, model=self.state.model_name,
                           max_tokens=self.sp.max_tokens, generated_text="".join(self.text), generated_tokens=n)
        if out.finished:
            self.finished = True
            self.finish_reason = c.finish_reason or "stop"
        return c.text or "", ids

    async def close(self) -> None:
        """Abort the engine request if it is still running and stop the producer (no leaks)."""
        if not self.finished:
            self.state.events.append((time.time(), "abort", self.rid, f"tokens={len(self.timing.token_times)}"))
            try:
                await self.state.engine.abort(self.rid)
            except Exception:  # engine already gone
                logger.debug("abort of %s failed", self.rid, exc_info=True)
        if self.task is not None and not self.task.done():
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass


def create_app(engine: VLLMEngine | EngineConfig, settings: ServerSettings | None = None) -> FastAPI:
    """Build the ASGI app. With an ``EngineConfig`` the engine is started/stopped by the lifespan."""
    settings = settings or ServerSettings()
    setup_tracing_from_env()
    owns_engine = isinstance(engine, EngineConfig)
    eng = VLLMEngine(engine) if isinstance(engine, EngineConfig) else engine
    state = ServerState(eng, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if owns_engine:
            await asyncio.to_thread(eng.start)
        from jitflow_server.api.tasks import attach_tasks

        await attach_tasks(app, state)
        if settings.length_predictor:
            from jitflow_server.analyzer.length_service import LengthService

            tele = os.environ.get("JITFLOW_LENGTH_TELEMETRY") or None
            state.length = await asyncio.to_thread(lambda: LengthService.from_default_model(telemetry_path=tele))
        pusher = asyncio.create_task(state.push_bounds())
        try:
            yield
        finally:
            pusher.cancel()
            if state.length is not None:
                state.length.close()
            if state.tasks is not None:
                await state.tasks.close()
            if owns_engine:
                eng.shutdown()

    app = FastAPI(title="jitflow", version="0.1.0", lifespan=lifespan)
    app.state.jitflow = state
    from jitflow_server.api.tasks import register_task_routes

    register_task_routes(app, state)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("internal error")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="internal_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        return _error_response(_validation_to_api_error(exc))

    @app.get("/health")
    async def health():
        if not eng.alive:
            return JSONResponse({"status": "engine_dead"}, status_code=503)
        return {"status": "ok", "model": state.model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                             "owned_by": "jitflow"}]}

    @app.get("/metrics")
    async def metrics():
        try:
            st = await eng.rpc("stats")
            state.metrics.engine_waiting.set(st["waiting"])
            state.metrics.engine_running.set(st["running"])
        except Exception:
            logger.debug("stats rpc failed", exc_info=True)
        state.metrics.queue.set(state.waiting_first_token)
        state.metrics.in_flight.set(state.in_flight)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/jitflow/engine")
    async def engine_stats():
        """Scheduler and engine counters (policy, frames, unfinished requests)."""
        st = await eng.rpc("stats")
        st["frontend_unfinished"] = eng.num_unfinished_frontend()
        st["server_in_flight"] = state.in_flight
        st["dtype"] = getattr(eng, "dtype", None)
        if state.length is not None:
            st["length_predictor"] = {"model": state.length.predictor is not None, **state.length.stats}
        return st

    @app.post("/v1/jitflow/engine/pause")
    async def engine_pause():
        """Stop scheduling without losing work: running requests keep their KV cache, new requests queue
        (admission control still rejects those whose ``waiting_time`` passes). For maintenance and for
        setting up reproducible scenarios; undo with ``/v1/jitflow/engine/resume``."""
        await eng.pause()
        return {"paused": await eng.is_paused()}

    @app.post("/v1/jitflow/engine/resume")
    async def engine_resume():
        """Resume scheduling after ``/v1/jitflow/engine/pause``."""
        await eng.resume()
        return {"paused": await eng.is_paused()}

    @app.get("/v1/jitflow/engine/events")
    async def engine_events():
        """Recent request lifecycle events (diagnostics), oldest first, each ``[unix s, event, request id,
        detail]``: ``engine`` from the scheduler plug-in (add, first_sched, preempt, finish, reject) and
        ``server`` from the HTTP layer (arrive, first_token, done, abort)."""
        return {"engine": await eng.rpc("events"), "server": [list(e) for e in state.events]}

    @app.get("/v1/jitflow/engine/steps")
    async def engine_steps(since: str = "0"):
        """The engine's step log (step-time model fits, simulator fidelity): steps after unix time
        ``since`` (s), oldest first, each ``[unix s, period s, forward s, n_decode, prefill tokens,
        context tokens of the decodes, cv of the batch's context lengths]``. ``period`` is the time since
        the previous step (null after the engine was idle); ``forward`` the model execution alone."""
        try:
            t = float(since)
        except ValueError:
            raise APIError(400, "since must be a number (unix seconds)", param="since") from None
        if not math.isfinite(t):
            raise APIError(400, "since must be finite", param="since")
        steps = await eng.rpc("steps", {"since": t})
        return {"fields": list(STEP_FIELDS), "steps": steps}

    @app.get("/v1/jitflow/engine/plan")
    async def engine_plan():
        """The scheduler's last decision (diagnostics): the chosen batch, the preemptions and every
        request it ranked with its kind, state, priority and deadlines; ``{}`` before the first frame."""
        return await eng.rpc("plan")

    @app.post("/v1/jitflow/policy")
    async def set_policy(body: dict):
        """Switch the scheduling policy at run time: ``{"name": "gmax", "params": {...}, "batch_size": B}``."""
        from jitflow_server.scheduler import POLICY_NAMES, make_policy

        name = body.get("name")
        if name not in (*POLICY_NAMES, "vllm"):
            raise APIError(400, f"name must be one of {list(POLICY_NAMES)}", param="name")
        params = body.get("params") or {}
        if not isinstance(params, dict):
            raise APIError(400, "params must be an object", param="params")
        b = body.get("batch_size")
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise APIError(400, "batch_size must be a positive integer", param="batch_size")
        if name not in ("fcfs", "vllm"):
            try:
                make_policy(name, **params)
            except ValueError as exc:
                raise APIError(400, str(exc), param="params") from None
        try:
            return await eng.rpc("set_policy", {"name": name, "params": params, "batch_size": b})
        except Exception as exc:
            raise APIError(400, f"bad policy parameters: {exc}", param="params") from None

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        _check_model(state, body.model)
        tok = eng.tokenizer
        msgs = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                for m in body.messages]
        prompt_ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        if hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
        text = "\n".join(m["content"] for m in msgs)
        return await _serve(state, body, list(prompt_ids), request, chat=True, prompt_text=text)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(state, body.model)
        if isinstance(body.prompt, str):
            prompt_ids = eng.tokenizer(body.prompt).input_ids
        else:
            vocab = len(eng.tokenizer)
            if any(t < 0 or t >= vocab for t in body.prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            prompt_ids = list(body.prompt)
        text = body.prompt if isinstance(body.prompt, str) else ""
        return await _serve(state, body, prompt_ids, request, chat=False, prompt_text=text)

    return app


def _end_span(span, timing: RequestTiming, summary: dict, finish_reason: str | None) -> None:
    """Close the request's SERVER span with ``queue``/``decode`` children from the measured times."""
    from opentelemetry import trace as ot

    ctx = ot.set_span_in_context(span)
    t_first, t_last = summary.get("first_token_time"), summary.get("last_token_time")
    end = t_last or time.time()
    if t_first is not None:
        tr = tracer()
        q = tr.start_span("queue", context=ctx, start_time=int(timing.arrival * 1e9))
        q.end(end_time=int(t_first * 1e9))
        d = tr.start_span("decode", context=ctx, start_time=int(t_first * 1e9))
        d.set_attribute("gen_ai.usage.output_tokens", summary["output_tokens"])
        d.end(end_time=int(end * 1e9))
    span.set_attributes({"gen_ai.usage.output_tokens": summary["output_tokens"],
                         "gen_ai.response.finish_reasons": [finish_reason or "abort"]})
    for k in ("ttft", "e2el", "slo_met"):
        if summary.get(k) is not None:
            span.set_attribute(f"jitflow.{k}", summary[k])
    span.end(end_time=int(end * 1e9))


def _check_model(state: ServerState, model: str) -> None:
    if model not in (state.model_name,):
        raise APIError(404, f"model {model!r} not found; this server serves {state.model_name!r}",
                       type="not_found_error", param="model")


def _sampling_params(body, max_tokens: int, extra_args: dict):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    so = None
    rf = body.response_format
    if rf:
        t = rf.get("type")
        if t == "json_object":
            so = StructuredOutputsParams(json_object=True)
        elif t == "json_schema":
            js = rf.get("json_schema") or {}
            schema = js.get("schema")
            if not isinstance(schema, dict):
                raise APIError(400, "response_format.json_schema.schema must be an object",
                               param="response_format.json_schema.schema")
            so = StructuredOutputsParams(json=schema)
        elif t not in (None, "text"):
            raise APIError(400, f"unsupported response_format.type {t!r}", param="response_format.type")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
            stop=body.stop, ignore_eos=body.ignore_eos, min_tokens=min(body.min_tokens, max_tokens),
            output_kind=RequestOutputKind.DELTA, structured_outputs=so, extra_args=extra_args,
        )
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"invalid sampling parameters: {exc}") from None


async def _serve(state: ServerState, body, prompt_ids: list[int], request: Request, *, chat: bool,
                 prompt_text: str = ""):
    arrival = time.time()
    eng = state.engine
    slo = body.slo or SLO()
    task_ctx = body.jitflow
    slo.check_required(in_task=task_ctx is not None)
    max_len = eng.config.max_model_len
    if len(prompt_ids) >= max_len:
        raise APIError(400, f"prompt has {len(prompt_ids)} tokens; the model's context is {max_len}",
                       param="messages" if chat else "prompt")
    room = max_len - len(prompt_ids)
    max_tokens = body.max_completion_tokens or body.max_tokens or min(state.settings.default_max_tokens, room)
    if max_tokens > room:
        raise APIError(400, f"max_tokens {max_tokens} + prompt {len(prompt_ids)} tokens exceeds the context "
                       f"of {max_len}", param="max_tokens")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    waiting_time = slo.waiting_time
    if waiting_time is None and slo.kind != "best_effort":
        waiting_time = state.settings.default_waiting_time
    elif waiting_time is None:
        waiting_time = state.settings.best_effort_waiting_time
    xargs: dict[str, Any] = {k: v for k, v in (body.vllm_xargs or {}).items() if k.startswith("jf_")}
    fixed_bound = "jf_len_bound" in xargs or body.ignore_eos  # caller-given or exact: never re-predicted
    xargs.update({"jf_id": rid, "jf_kind": slo.kind, "jf_arrival": arrival})
    for f in ("ttft", "tbt", "deadline"):
        v = getattr(slo, f)
        if v is not None:
            xargs[f"jf_{f}"] = v
    if waiting_time:
        xargs["jf_waiting_time"] = waiting_time
    spec = SLOSpec(slo.kind, slo.ttft, slo.tbt, slo.deadline, waiting_time)
    timing = RequestTiming(rid, spec, arrival, len(prompt_ids))
    if state.tasks is not None and task_ctx is not None:
        timing.slo = state.tasks.on_call(task_ctx, body, rid, len(prompt_ids), max_tokens, xargs, timing)
    if body.ignore_eos and "jf_len_bound" not in xargs:
        xargs["jf_len_bound"] = max_tokens  # the length is known exactly: max_tokens
    if state.length is not None and not fixed_bound:
        app_name = state.tasks.tasks[task_ctx.task_id].app if (task_ctx and state.tasks) else None
        state.length.submit(rid, prompt_text, app=app_name, model=state.model_name,
                            stage=task_ctx.stage if task_ctx else None, max_tokens=max_tokens)
        b = state.length.latest(rid)  # provisional (fallback) bound; refined asynchronously
        if b is not None and "jf_len_bound" not in xargs:
            xargs["jf_len_bound"] = int(min(max_tokens, b))
    if "jf_len_bound" not in xargs:
        xargs["jf_len_bound"] = max_tokens
    timing.len_bound = int(xargs["jf_len_bound"])
    sp = _sampling_params(body, max_tokens, xargs)

    from opentelemetry import propagate
    from opentelemetry import trace as ot

    headers = {k: v for k, v in request.headers.items() if k in ("traceparent", "tracestate")}
    span = tracer().start_span(f"serve {state.model_name}", context=propagate.extract(headers),
                               kind=ot.SpanKind.SERVER, start_time=int(arrival * 1e9))
    span.set_attributes({"gen_ai.operation.name": "chat" if chat else "text_completion",
                         "gen_ai.request.model": state.model_name, "gen_ai.request.max_tokens": max_tokens,
                         "gen_ai.response.id": rid, "jitflow.slo.kind": timing.slo.kind,
                         "gen_ai.usage.input_tokens": len(prompt_ids)})
    if timing.sub_deadline is not None:
        span.set_attribute("jitflow.sub_deadline", timing.sub_deadline)
    if task_ctx is not None:
        span.set_attributes({"jitflow.task_id": task_ctx.task_id, "jitflow.stage_index": task_ctx.stage_index})
    call = _Call(state, rid, prompt_ids, sp, timing, waiting_time, headers or None)
    state.events.append((arrival, "arrive", rid, f"{slo.kind} max_tokens={max_tokens} stream={bool(body.stream)}"))
    state.in_flight += 1
    state.waiting_first_token += 1
    state.live[rid] = call
    call.prompt_text = prompt_text
    call.fixed_bound = fixed_bound
    call.start()
    created = int(arrival)
    model = state.model_name
    try:
        first = await call.first()
    except BaseException as exc:
        state.waiting_first_token -= 1
        state.in_flight -= 1
        outcome = "rejected" if isinstance(exc, APIError) and exc.status == 429 else "aborted"
        state.metrics.observe(timing, outcome, timing.summary(finished_ok=False))
        state.live.pop(rid, None)
        span.set_attribute("error.type", outcome)
        span.end()
        await call.close()
        if state.tasks is not None and task_ctx is not None:
            state.tasks.on_call_end(task_ctx, rid, timing, ok=False)
        raise
    state.waiting_first_token -= 1
    state.events.append((time.time(), "first_token", rid, ""))

    recorded: list[dict] = []

    def finish_metrics(ok: bool) -> dict:
        if recorded:  # exactly once per request
            return recorded[0]
        summary = timing.summary(finished_ok=ok)
        recorded.append(summary)
        state.events.append((time.time(), "done", rid, f"ok={ok} tokens={summary['output_tokens']}"))
        state.live.pop(rid, None)
        state._pushed.pop(rid, None)
        if state.length is not None and ok:
            state.length.observe(rid, len(timing.token_times))
        if not ok:
            outcome = "aborted"
        elif summary["slo_met"] is None:
            outcome = "best_effort"
        else:
            outcome = "slo_met" if summary["slo_met"] else "slo_missed"
        state.metrics.observe(timing, outcome, summary)
        if state.tasks is not None and task_ctx is not None:
            state.tasks.on_call_end(task_ctx, rid, timing, ok=ok)
        _end_span(span, timing, summary, call.finish_reason)
        return summary

    if not body.stream:
        text_parts: list[str] = []
        ok = False
        try:
            ev = first
            while True:
                text, _ = call.absorb(ev)
                text_parts.append(text)
                if call.finished:
                    break
                ev = await call.queue.get()
            ok = call.finish_reason is not None and call.finish_reason != "abort"
        finally:
            state.in_flight -= 1
            summary = finish_metrics(ok)
            await call.close()
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(timing.token_times),
                 "total_tokens": len(prompt_ids) + len(timing.token_times)}
        text = "".join(text_parts)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": call.finish_reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": call.finish_reason, "logprobs": None}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                "usage": usage, "jitflow": summary}

    async def stream() -> AsyncIterator[bytes]:
        ok = False
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            if chat:
                yield _sse({"id": rid, "object": obj, "created": created, "model": model,
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
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
                    yield _sse({"id": rid, "object": obj, "created": created, "model": model,
                                "choices": [choice]})
                if call.finished:
                    break
                ev = await call.queue.get()
            ok = call.finish_reason is not None and call.finish_reason != "abort"
            summary = finish_metrics(ok)
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(timing.token_times),
                     "total_tokens": len(prompt_ids) + len(timing.token_times)}
            yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                        "usage": usage, "jitflow": summary})
            yield b"data: [DONE]\n\n"
        finally:
            state.in_flight -= 1
            finish_metrics(ok)
            await call.close()

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
