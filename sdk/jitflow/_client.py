"""HTTP clients: :class:`AsyncClient` and its sync twin :class:`Client` (httpx style).

Resources mirror openai-python: ``client.chat.completions.create``, ``client.completions.create``,
``client.models.list`` (``jitflow/_resources.py``). Transports are the seam: pass
``transport=httpx.MockTransport(...)`` in tests or any custom ``httpx`` transport. Every public method
exists twice, async and sync, with the same signature and docstring (the httpx/openai-python
convention); each half reads on its own.

A 429/503 answer to a chat/completions call is retried with tenacity (``RetryPolicy``, _retries.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

import anyio
import httpx
import tenacity
from opentelemetry import trace
from pydantic import BaseModel, ValidationError

from ._calls import LLMCall
from ._context import current_stage_var, current_task_var, loop_key, server_attributes
from ._exceptions import APIConnectionError, APIError, APITimeoutError, status_error_from_response
from ._resources import AsyncChat, AsyncCompletions, AsyncModels, Chat, Completions, Models
from ._responses import AsyncResponses, Responses
from ._retries import DEFAULT_MAX_RETRIES, RetryPolicy, check_max_retries
from ._slo import SLO
from ._streaming import AsyncStream, Stream
from ._task import TaskScope
from ._telemetry import TelemetryStats

__all__ = ["AsyncClient", "Client", "DEFAULT_BASE_URL", "DEFAULT_MAX_RETRIES", "DEFAULT_TIMEOUT"]

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
"""LLM calls can legitimately take minutes under load; connecting should not."""

M = TypeVar("M", bound=BaseModel)
_NOT_GIVEN: Any = httpx.USE_CLIENT_DEFAULT


def _normalise_base_url(base_url: str | None) -> str:
    url = (base_url or os.environ.get("JITFLOW_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
    if url.endswith("/v1"):  # accept OpenAI-style base URLs
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https://, got {url!r}")
    return url


class _BaseClient:
    """Configuration and request building shared by both clients."""

    def __init__(
        self,
        base_url: str | None,
        api_key: str | None,
        model: str | None,
        default_headers: Mapping[str, str] | None,
        tracer_provider: trace.TracerProvider | None,
        max_retries: int,
    ) -> None:
        from . import __version__

        self.max_retries = check_max_retries(max_retries)
        self.base_url = _normalise_base_url(base_url)
        self.api_key = api_key if api_key is not None else os.environ.get("JITFLOW_API_KEY")
        self.model = model or os.environ.get("JITFLOW_MODEL") or None
        self._tracer_provider = tracer_provider
        self._server_attrs = server_attributes(self.base_url)
        self._resolved_model: str | None = None
        headers = {"User-Agent": f"jitflow-python/{__version__}", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        headers.update(default_headers or {})
        self._headers = headers

    def __repr__(self) -> str:
        return f"<{type(self).__name__} base_url={self.base_url!r}>"

    def _default_model(self, model: str | None) -> str | None:
        if model:
            return model
        stage = current_stage_var.get()
        task = stage.task if stage is not None else current_task_var.get()
        if task is not None and task.model:
            return task.model
        return self.model or self._resolved_model

    def _prepare_llm(
        self,
        *,
        operation: str,
        body: dict[str, Any],
        stream: bool,
        slo: SLO | dict[str, Any] | None,
        waiting_time: float | None,
        parents: Sequence[str] | None,
        extra_body: Mapping[str, Any] | None,
        extra: dict[str, Any],
    ) -> tuple[LLMCall, dict[str, Any], dict[str, str]]:
        body = {**body, **(extra_body or {}), **extra}
        if stream:
            body["stream"] = True
            body.setdefault("stream_options", {"include_usage": True})
        else:
            body.pop("stream", None)
        call = LLMCall(
            operation=operation,
            model=body["model"],
            slo=slo,
            waiting_time=waiting_time,
            parents=parents,
            tracer_provider=self._tracer_provider,
            server_attrs=self._server_attrs,
            request_attrs={
                "gen_ai.request.max_tokens": body.get("max_tokens"),
                "gen_ai.request.temperature": body.get("temperature"),
                "gen_ai.request.top_p": body.get("top_p"),
            },
        )
        slo_wire, jf, headers = call.begin()
        if slo_wire is not None:
            body["slo"] = slo_wire
        if jf is not None:
            body["jitflow"] = jf
        return call, body, headers

    def _api_error(self, e: BaseException, request: httpx.Request, *, reading: bool = False) -> BaseException:
        """An httpx transport error as APITimeoutError / APIConnectionError; anything else as is."""
        if isinstance(e, httpx.TimeoutException):
            return APITimeoutError(request=request)
        if not isinstance(e, httpx.TransportError):
            return e
        what = "connection error reading the response" if reading else f"cannot reach {self.base_url}"
        return APIConnectionError(f"{what}: {e!r}", request=request)

    @staticmethod
    def _parse(model: type[M], response: httpx.Response) -> M:
        try:
            return model.model_validate(response.json())
        except (ValueError, ValidationError) as e:
            raise APIError(
                f"unexpected response from {response.request.url}: {str(e)[:300]}", request=response.request
            ) from e

    @staticmethod
    def _finish_parsed(call: LLMCall, obj: Any) -> None:
        finish = [c.finish_reason for c in getattr(obj, "choices", []) if c.finish_reason]
        call.finish(
            timing=obj.jitflow, usage=obj.usage, response_id=obj.id, response_model=obj.model,
            finish_reasons=finish,
        )
        if call.record is not None:
            obj._call_id = call.call_id


# ============================================================================ async
class AsyncClient(_BaseClient):
    """Asynchronous jitflow client (anyio: works under asyncio and trio).

    Args:
        base_url: server URL (default env ``JITFLOW_BASE_URL`` or ``http://127.0.0.1:8000``;
            a trailing ``/v1`` is accepted and stripped).
        api_key: sent as ``Authorization: Bearer`` (default env ``JITFLOW_API_KEY``).
        timeout: seconds or an ``httpx.Timeout`` (default 600 s, connect 5 s).
        max_retries: retries of a chat/completions call answered 429 or 503 before any body was
            read (default 2; 0 disables). Wait: ``Retry-After`` seconds, else 0.5 s doubling (max
            8 s, jittered); at most 60 s, and never past the call's deadline (Deadline/Compound SLO
            or task: then the error is raised at once). ``error.attempts`` counts the tries.
        transport: an ``httpx.AsyncBaseTransport`` (e.g. ``httpx.MockTransport``).
        model: default model when a call omits ``model`` (else env ``JITFLOW_MODEL``, else the
            first model the server lists).
        default_headers: headers added to every request.
        tracer_provider: OpenTelemetry TracerProvider for the SDK's spans (default: global).
        telemetry_buffer: max queued telemetry records per task (overflow is dropped and counted).
        telemetry_retries: retries per telemetry POST after the first attempt.
        telemetry_backoff: first retry delay in seconds (doubles, capped at 1 s).
        telemetry_register_timeout: seconds a task start waits for ``POST /v1/tasks``.
        telemetry_flush_timeout: seconds a task exit waits to deliver buffered telemetry.

    Attributes:
        chat, completions, models: API resources.
        telemetry: :class:`TelemetryStats` (``sent``, ``dropped``, ...).
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        transport: httpx.AsyncBaseTransport | None = None,
        model: str | None = None,
        default_headers: Mapping[str, str] | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        telemetry_buffer: int = 1024,
        telemetry_retries: int = 3,
        telemetry_backoff: float = 0.05,
        telemetry_register_timeout: float = 2.0,
        telemetry_flush_timeout: float = 3.0,
    ) -> None:
        super().__init__(base_url, api_key, model, default_headers, tracer_provider, max_retries)
        self._http_kwargs: dict[str, Any] = dict(
            base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport
        )
        self._pool: httpx.AsyncClient | None = None
        self._pool_key: Any = None
        self.telemetry = TelemetryStats()
        self._telemetry_buffer = telemetry_buffer
        self._telemetry_retries = telemetry_retries
        self._telemetry_backoff = telemetry_backoff
        self._telemetry_register_timeout = telemetry_register_timeout
        self._telemetry_flush_timeout = telemetry_flush_timeout
        self.chat = AsyncChat(self)
        self.completions = AsyncCompletions(self)
        self.responses = AsyncResponses(self)
        self.models = AsyncModels(self)

    @property
    def _http(self) -> httpx.AsyncClient:
        """The httpx pool of the running event loop (a pool must not cross event loops, so a
        client reused by a later ``anyio.run`` gets a fresh one)."""
        key = loop_key()
        if self._pool is None or (key is not None and key is not self._pool_key):
            self._pool = httpx.AsyncClient(**self._http_kwargs)
            self._pool_key = key
        return self._pool

    async def aclose(self) -> None:
        """Close the HTTP connection pool of the current event loop."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def task(
        self,
        app: str,
        deadline: float,
        *,
        model: str | None = None,
        on_deadline: Literal["raise", "best_effort"] = "raise",
        metadata: dict[str, Any] | None = None,
        task_id: str | None = None,
        waiting_time: float | None = None,
    ) -> TaskScope:
        """Open a compound task (async context manager yielding :class:`jitflow.Task`).

        Args:
            app: application name. deadline: end-to-end deadline in seconds from now.
            model: default model for ``stage.chat``. on_deadline: ``"raise"`` or ``"best_effort"``.
            metadata: JSON metadata for the registration. task_id: explicit id (default uuid4).
            waiting_time: admission bound in seconds for each of the task's LLM calls that sets
                none itself (default: the server's, 5 s unless configured; ``jitflow serve
                --compound-waiting sub-deadline`` lets a call wait until its stage's sub-deadline when later).

        Nested use inside an active task reuses that task.

        Raises:
            ValueError / TypeError: invalid ``deadline`` / ``on_deadline`` / ``waiting_time``.
        """
        return TaskScope(
            self, app, deadline, model=model, on_deadline=on_deadline, metadata=metadata, task_id=task_id,
            waiting_time=waiting_time,
        )

    async def get_task(self, task_id: str) -> dict[str, Any]:
        """``GET /v1/tasks/{task_id}``: the server's task view (stages, sub-deadlines, matched
        pattern, outcome) as a dict. Raises :class:`jitflow.NotFoundError` for unknown ids."""
        response = await self._request("GET", f"/v1/tasks/{task_id}")
        try:
            return response.json()
        except ValueError as e:
            raise APIError("task view is not JSON", request=response.request) from e

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as e:
            raise APITimeoutError(request=getattr(e, "request", None)) from e
        except httpx.TransportError as e:
            raise APIConnectionError(f"cannot reach {self.base_url}: {e!r}") from e
        if response.status_code >= 400:
            raise status_error_from_response(response)
        return response

    async def _resolve_model(self, model: str | None) -> str:
        m = self._default_model(model)
        if m:
            return m
        models = await self.models.list()
        if not models.data:
            raise APIError(f"no model given and {self.base_url} lists no models")
        self._resolved_model = models.data[0].id
        return self._resolved_model

    async def _llm(
        self,
        path: str,
        operation: str,
        body: dict[str, Any],
        *,
        stream: bool,
        cast: type[M],
        chunk_cls: type[BaseModel],
        slo: SLO | dict[str, Any] | None,
        waiting_time: float | None,
        parents: Sequence[str] | None,
        timeout: float | httpx.Timeout | None,
        extra_headers: Mapping[str, str] | None,
        extra_body: Mapping[str, Any] | None,
        extra: dict[str, Any],
    ) -> Any:
        call, body, headers = self._prepare_llm(
            operation=operation, body=body, stream=stream, slo=slo, waiting_time=waiting_time,
            parents=parents, extra_body=extra_body, extra=extra,
        )
        policy = RetryPolicy.for_call(self.max_retries, call)

        async def attempt() -> httpx.Response:
            # one try, up to the response headers: a 429/503 here is retried (no body read yet)
            policy.started()
            request = self._http.build_request(
                "POST", path, json=policy.body_for_attempt(body), headers={**headers, **(extra_headers or {})},
                timeout=_NOT_GIVEN if timeout is None else timeout,
            )
            try:
                response = await self._http.send(request, stream=True)
            except httpx.TransportError as e:
                raise self._api_error(e, request) from e
            if response.status_code >= 400:
                try:
                    await response.aread()
                finally:
                    await response.aclose()
                raise status_error_from_response(response)
            return response

        try:
            response = await tenacity.AsyncRetrying(sleep=anyio.sleep, **policy.options())(attempt)
        except BaseException as e:
            call.finish(error=policy.failed(e))
            raise
        if stream:
            return AsyncStream(response, chunk_cls, call, attempts=policy.attempts)
        try:
            try:
                await response.aread()
            finally:
                await response.aclose()
            obj = self._parse(cast, response)
        except BaseException as e:
            exc = self._api_error(e, response.request, reading=True)
            call.finish(error=policy.failed(exc))
            if exc is e:
                raise
            raise exc from e
        self._finish_parsed(call, obj)
        return obj


class Client(_BaseClient):
    """Synchronous twin of :class:`AsyncClient` (same arguments minus telemetry; compound tasks
    are async-only). ``transport`` is an ``httpx.BaseTransport``.
    ``max_retries`` (default 2): retries of a 429/503, waits in seconds as in AsyncClient."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        transport: httpx.BaseTransport | None = None,
        model: str | None = None,
        default_headers: Mapping[str, str] | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        super().__init__(base_url, api_key, model, default_headers, tracer_provider, max_retries)
        self._http = httpx.Client(
            base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport
        )
        self.chat = Chat(self)
        self.completions = Completions(self)
        self.responses = Responses(self)
        self.models = Models(self)

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def get_task(self, task_id: str) -> dict[str, Any]:
        """``GET /v1/tasks/{task_id}`` (see :meth:`AsyncClient.get_task`)."""
        response = self._request("GET", f"/v1/tasks/{task_id}")
        try:
            return response.json()
        except ValueError as e:
            raise APIError("task view is not JSON", request=response.request) from e

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as e:
            raise APITimeoutError(request=getattr(e, "request", None)) from e
        except httpx.TransportError as e:
            raise APIConnectionError(f"cannot reach {self.base_url}: {e!r}") from e
        if response.status_code >= 400:
            raise status_error_from_response(response)
        return response

    def _resolve_model(self, model: str | None) -> str:
        m = self._default_model(model)
        if m:
            return m
        models = self.models.list()
        if not models.data:
            raise APIError(f"no model given and {self.base_url} lists no models")
        self._resolved_model = models.data[0].id
        return self._resolved_model

    def _llm(
        self,
        path: str,
        operation: str,
        body: dict[str, Any],
        *,
        stream: bool,
        cast: type[M],
        chunk_cls: type[BaseModel],
        slo: SLO | dict[str, Any] | None,
        waiting_time: float | None,
        parents: Sequence[str] | None,
        timeout: float | httpx.Timeout | None,
        extra_headers: Mapping[str, str] | None,
        extra_body: Mapping[str, Any] | None,
        extra: dict[str, Any],
    ) -> Any:
        call, body, headers = self._prepare_llm(
            operation=operation, body=body, stream=stream, slo=slo, waiting_time=waiting_time,
            parents=parents, extra_body=extra_body, extra=extra,
        )
        policy = RetryPolicy.for_call(self.max_retries, call)

        def attempt() -> httpx.Response:
            # one try, up to the response headers: a 429/503 here is retried (no body read yet)
            policy.started()
            request = self._http.build_request(
                "POST", path, json=policy.body_for_attempt(body), headers={**headers, **(extra_headers or {})},
                timeout=_NOT_GIVEN if timeout is None else timeout,
            )
            try:
                response = self._http.send(request, stream=True)
            except httpx.TransportError as e:
                raise self._api_error(e, request) from e
            if response.status_code >= 400:
                try:
                    response.read()
                finally:
                    response.close()
                raise status_error_from_response(response)
            return response

        try:
            response = tenacity.Retrying(**policy.options())(attempt)
        except BaseException as e:
            call.finish(error=policy.failed(e))
            raise
        if stream:
            return Stream(response, chunk_cls, call, attempts=policy.attempts)
        try:
            try:
                response.read()
            finally:
                response.close()
            obj = self._parse(cast, response)
        except BaseException as e:
            exc = self._api_error(e, response.request, reading=True)
            call.finish(error=policy.failed(exc))
            if exc is e:
                raise
            raise exc from e
        self._finish_parsed(call, obj)
        return obj
