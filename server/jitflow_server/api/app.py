"""The jitflow HTTP API: OpenAI-compatible chat/completions with the ``slo`` extension (docs/api.md).

``create_app(engine, settings)`` builds a FastAPI app around any :class:`~jitflow_server.engine.protocol.Engine`
(the vLLM engine in ``jitflow serve``, a fake one in unit tests). With ``owns_engine=True`` the app's
lifespan starts and stops the engine. The lifespan also owns the task manager, the length service and
the background tasks: pushing refined length bounds to the scheduler, closing finished implicit tasks,
and reading the engine's measured speed (deadline admission, the analyzer's call-time model).
Requests not admitted within their ``waiting_time`` get HTTP 429 ``admission_rejected`` (JITServe §5).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_fastapi_instrumentator import Instrumentator
from starlette.exceptions import HTTPException as StarletteHTTPException

from jitflow_server.api.admin import register_admin_routes
from jitflow_server.api.auth import Auth
from jitflow_server.api.limits import BodySizeLimit
from jitflow_server.api.openai_spec import load as load_openai_spec
from jitflow_server.api.request_id import RequestId
from jitflow_server.api.responses import ResponsesRequest, new_response_id, responses_param, to_chat
from jitflow_server.api.responses import respond as respond_response
from jitflow_server.api.schemas import APIError, ChatCompletionRequest, CompletionRequest
from jitflow_server.api.serving import serve_request, start_call
from jitflow_server.api.state import ServerSettings, ServerState
from jitflow_server.api.tasks import attach_tasks, register_task_routes
from jitflow_server.api.tracing import instrument_app, setup_tracing_from_env
from jitflow_server.engine.protocol import Engine
from jitflow_server.settings import env_settings

logger = logging.getLogger("jitflow.api")

__all__ = ["ServerSettings", "ServerState", "create_app"]


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


#: Discriminator tags of the task-event union (dropped from error paths).
EVENT_TAGS = ("llm", "tool", "stage_start", "stage_end")


def _validation_to_api_error(exc: RequestValidationError) -> APIError:
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    raw = [x for x in first.get("loc", ()) if x != "body"]
    # Drop pydantic's union/literal branch tags (and a discriminated union's tag after a list index) so the
    # param is the field path, with list indexes as ``[i]``: ``events[0].input_tokens``.
    parts: list[str] = []
    prev_index = False
    for x in raw:
        if isinstance(x, int):
            parts.append(f"[{x}]")
            prev_index = True
            continue
        x = str(x)
        if x.startswith(("function-", "constrained-", "literal[")) or x in (
                "str", "int", "float", "list[int]", "list[dict[str,any]]") or (prev_index and x in EVENT_TAGS):
            prev_index = False
            continue
        parts.append(("." if parts else "") + x)
        prev_index = False
    param = "".join(parts) or None
    msg = first.get("msg", "invalid value")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


def _length_service(state: ServerState):
    """The length service with the engine's tokenizer, or ``None`` when the predictor is off."""
    from jitflow_server.analyzer.length_service import LengthService
    from jitflow_server.analyzer.tokens import TokenCounter

    tok = getattr(state.engine, "tokenizer", None)  # the served model's tokenizer (the fake engine has none)
    try:
        counter = TokenCounter(tok) if tok is not None else None
    except TypeError:  # a slow tokenizer without a Rust backend: the process-wide counter
        counter = None
    tele = env_settings().length_telemetry
    return LengthService.from_default_model(counter=counter, telemetry_path=tele)


async def close_implicit_tasks(state, period: float = 5.0) -> None:
    """Every ``period`` s, complete the implicit tasks that are over (:meth:`TaskManager.close_implicit`);
    runs until cancelled (the app's lifespan owns it)."""
    while True:
        await asyncio.sleep(period)
        if state.tasks is not None:
            try:
                await asyncio.to_thread(state.tasks.close_implicit)
            except Exception:
                logger.warning("closing implicit tasks failed", exc_info=True)


def create_app(engine: Engine, settings: ServerSettings | None = None, *, owns_engine: bool = False) -> FastAPI:
    """Build the ASGI app around ``engine``; with ``owns_engine`` the lifespan starts and shuts it down."""
    settings = settings or ServerSettings()
    setup_tracing_from_env()
    state = ServerState(engine, settings)
    spec = load_openai_spec()

    async def conform(endpoint: str, request: Request) -> None:
        """400 naming the field unless the body conforms to OpenAI's specification (``openai_spec.py``)."""
        if spec is not None:
            spec.check(endpoint, await request.json())  # Starlette keeps the parsed body: no second parse

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if owns_engine:
            await asyncio.to_thread(engine.start)
        await attach_tasks(app, state)
        if settings.length_predictor:
            state.attach_length_service(await asyncio.to_thread(_length_service, state))
        background = [asyncio.create_task(state.push_bounds(), name="push-length-bounds"),
                      asyncio.create_task(close_implicit_tasks(state), name="close-implicit-tasks"),
                      asyncio.create_task(state.poll_service(), name="poll-engine-speed")]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if state.length is not None:
                state.length.close()
            if state.tasks is not None:
                await state.tasks.close()
            if owns_engine:
                aclose = getattr(engine, "aclose", None)  # an engine holding async connections (the router)
                if aclose is not None:
                    await aclose()
                engine.shutdown()

    app = FastAPI(title="jitflow", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(Auth, keys=settings.api_keys)  # no body is read before the key is checked
    app.add_middleware(RequestId)  # outermost: every answer, 401 and 413 included, names its request
    instrument_app(app)  # an HTTP SERVER span per request (outside all of the above)
    # HTTP metrics (http_requests_total, http_request_duration_seconds, ... by handler, method and status
    # class) in the server's own registry, next to the SLO metrics on /metrics
    Instrumentator(registry=state.metrics.registry, excluded_handlers=["/metrics", "/health"]).instrument(app)
    app.state.jitflow = state
    register_task_routes(app, state)
    register_admin_routes(app, state)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("internal error")
        return _error_response(APIError(500, "internal server error", type="internal_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        return _error_response(_validation_to_api_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        msg = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
               else str(exc.detail))
        return _error_response(APIError(exc.status_code, msg, type=kind, headers=dict(exc.headers or {})))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        await conform("chat", request)
        _check_model(state, body.model)
        msgs = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                for m in body.messages]
        text = "\n".join(m["content"] for m in msgs)
        prompt_ids = await _tokenize(engine.encode_chat, msgs, len(text))
        return await serve_request(state, body, prompt_ids, request, chat=True, prompt_text=text)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        await conform("responses", request)
        _check_model(state, body.model)
        try:
            chat_body = to_chat(body)
            msgs = chat_body.messages
            text = "\n".join(m["content"] for m in msgs)
            prompt_ids = await _tokenize(engine.encode_chat, msgs, len(text))
            started = await start_call(state, chat_body, prompt_ids, request, chat=True, prompt_text=text,
                                       rid=new_response_id())
        except APIError as err:
            err.param = responses_param(err.param)
            raise
        return await respond_response(state, body, started, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        await conform("completion", request)
        _check_model(state, body.model)
        if isinstance(body.prompt, str):
            prompt_ids = await _tokenize(engine.encode, body.prompt, len(body.prompt))
        else:
            vocab = engine.vocab_size
            if any(t < 0 or t >= vocab for t in body.prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            prompt_ids = list(body.prompt)
        text = body.prompt if isinstance(body.prompt, str) else ""
        return await serve_request(state, body, prompt_ids, request, chat=False, prompt_text=text)

    return app


#: Prompts longer than this (characters) are tokenized on a worker thread, off the event loop. Shorter
#: ones stay inline: the thread hop costs more than tokenizing them, and a 20 MB prompt tokenized
#: inline stalled every other request (``/health`` included) for 25 s.
TOKENIZE_INLINE_CHARS = 32 * 1024


async def _tokenize(fn, arg, n_chars: int) -> list[int]:
    """``fn(arg)`` (a tokenizer call), on a worker thread when the text is longer than
    :data:`TOKENIZE_INLINE_CHARS`."""
    if n_chars <= TOKENIZE_INLINE_CHARS:
        return fn(arg)
    return await asyncio.to_thread(fn, arg)


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"model {model!r} not found; this server serves {state.model_name!r}",
                       type="not_found_error", param="model", code="model_not_found")
