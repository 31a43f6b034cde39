"""httpx transports that add a compound task's ``x-jitflow-*`` headers (docs/api.md) to every request,
shared by the framework integrations: each gives the function that reads its framework's run context."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

#: A function returning the headers to add to the request being sent now (``{}``: none).
HeaderSource = Callable[[], dict[str, str]]


def task_context_headers(task_id: str, app: str, deadline_at: float, stage: str | None,
                         stage_index: int | None) -> dict[str, str]:
    """The ``x-jitflow-*`` headers of one call of a compound task due at ``deadline_at`` (unix s)."""
    out = {"x-jitflow-task-id": task_id, "x-jitflow-app": app, "x-jitflow-slo-kind": "compound",
           "x-jitflow-deadline": f"{max(deadline_at - time.time(), 0.001):.3f}"}
    if stage_index is not None:
        out["x-jitflow-stage-index"] = str(stage_index)
    if stage:
        out["x-jitflow-stage"] = stage
    return out


class HeaderTransport(httpx.BaseTransport):
    """Adds ``headers()`` to every request, then sends it with ``inner`` (default ``httpx.HTTPTransport()``)."""

    def __init__(self, headers: HeaderSource, inner: httpx.BaseTransport | None = None) -> None:
        self._headers = headers
        self._inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.headers.update(self._headers())
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


class AsyncHeaderTransport(httpx.AsyncBaseTransport):
    """Async twin of :class:`HeaderTransport`."""

    def __init__(self, headers: HeaderSource, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self._headers = headers
        self._inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.headers.update(self._headers())
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def client_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for an httpx client, with a timeout long enough for generations (600 s) unless given."""
    kwargs.setdefault("timeout", httpx.Timeout(600, connect=5))
    return kwargs


def check_task(app: str, deadline: float) -> None:
    """``ValueError`` unless ``app`` is non-empty and ``deadline`` a positive finite number of seconds."""
    if not app:
        raise ValueError("app must be a non-empty application name")
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 < deadline < float("inf"):
        raise ValueError(f"deadline must be a positive number of seconds, got {deadline!r}")
