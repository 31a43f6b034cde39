"""Context variables carrying the active compound task and stage, plus OpenTelemetry helpers.

anyio (asyncio and trio) copies the current context into every child task at spawn time, so
calls made in parallel inside ``async with task.stage(...)`` + a task group see the stage.
Only the OpenTelemetry *API* is used: the application chooses the TracerProvider / exporter.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import trace

if TYPE_CHECKING:  # pragma: no cover
    from ._task import Stage, Task

current_task_var: contextvars.ContextVar[Task | None] = contextvars.ContextVar("jitflow_task", default=None)
current_stage_var: contextvars.ContextVar[Stage | None] = contextvars.ContextVar("jitflow_stage", default=None)

TRACER_NAME = "jitflow"


def current_task() -> Task | None:
    """The compound task active in this context (``@jitflow.agent`` / ``client.task``), or None."""
    return current_task_var.get()


def current_stage() -> Stage | None:
    """The stage active in this context (``task.stage`` / ``jitflow.stage``), or None."""
    return current_stage_var.get()


def get_tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """The SDK's tracer from ``provider`` or the global TracerProvider (a no-op unless the
    application configured one)."""
    from . import __version__

    if provider is not None:
        return provider.get_tracer(TRACER_NAME, __version__)
    return trace.get_tracer(TRACER_NAME, __version__)


def server_attributes(base_url: str) -> dict[str, Any]:
    """``server.address`` / ``server.port`` span attributes for a base URL."""
    parts = urlsplit(base_url)
    attrs: dict[str, Any] = {}
    if parts.hostname:
        attrs["server.address"] = parts.hostname
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    if port:
        attrs["server.port"] = port
    return attrs


def error_type(exc: BaseException) -> str:
    """Low-cardinality ``error.type`` value for an exception (its class name)."""
    return type(exc).__name__


def mark_error(span: trace.Span, exc: BaseException) -> None:
    """Record ``exc`` on ``span``: ``error.type``, status ERROR and an exception event."""
    span.set_attribute("error.type", error_type(exc))
    span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)[:200]))
    if isinstance(exc, Exception):
        span.record_exception(exc)


def loop_key() -> Any:
    """An object identifying the running event loop (asyncio loop / trio root task), or None
    outside any loop. Used to keep one httpx connection pool per event loop."""
    try:
        import sniffio

        lib = sniffio.current_async_library()
    except Exception:
        return None
    if lib == "asyncio":
        import asyncio

        return asyncio.get_running_loop()
    if lib == "trio":
        import trio

        return trio.lowlevel.current_root_task()
    return lib
