"""Helpers for the SDK unit tests (imported by tests/test_sdk_*.py; not a pytest conftest).

``FakeServer`` implements the jitflow wire contract (docs/sdk.md) as an ``httpx.MockTransport``
handler so the SDK's real HTTP, SSE, task and telemetry code runs end to end without a server.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx


class TrackingStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """Response body that records whether the client closed it."""

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        yield from self.parts

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for p in self.parts:
            yield p

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


def sse(objs: list[Any], *, done: bool = True) -> list[bytes]:
    """Encode SSE ``data:`` events (objects are JSON-encoded; strings sent verbatim)."""
    out = [f"data: {o if isinstance(o, str) else json.dumps(o)}\n\n".encode() for o in objs]
    if done:
        out.append(b"data: [DONE]\n\n")
    return out


def timing(body: dict[str, Any], n_out: int, n_in: int = 5) -> dict[str, Any]:
    """A ``jitflow`` timing object the way the server would compute it."""
    now = time.time()
    arrival = now - 0.01 * (n_out + 1)
    jf = body.get("jitflow")
    slo = body.get("slo") or {}
    return {
        "request_id": f"req-{int(now * 1e6)}",
        "kind": slo.get("kind", "best_effort"),
        "arrival": arrival,
        "first_token_time": arrival + 0.01,
        "last_token_time": now,
        "ttft": 0.01,
        "tbt_max": 0.012,
        "tbt_mean": 0.01,
        "e2el": now - arrival,
        "prompt_tokens": n_in,
        "output_tokens": n_out,
        "slo_met": None if slo.get("kind", "best_effort") == "best_effort" else True,
        "sub_deadline": (arrival + 1.5) if jf else None,
        "len_bound": 64,
    }


class FakeServer:
    """In-process jitflow server double (wire contract of docs/sdk.md).

    Attributes:
        calls: decoded JSON bodies of chat/completion requests, in arrival order.
        headers: the request headers of those calls.
        tasks: task_id -> {"register": body, "events": [...], "complete": body | None}.
        streams: every TrackingStream handed out (to check they were closed).
        route: optional override ``(request) -> httpx.Response | None`` tried first.
        telemetry: optional override for ``/v1/tasks*`` paths (e.g. raise ConnectError).
    """

    def __init__(self, models: tuple[str, ...] = ("demo",)) -> None:
        self.models = models
        self.calls: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []
        self.tasks: dict[str, dict[str, Any]] = {}
        self.streams: list[TrackingStream] = []
        self.route: Callable[[httpx.Request], httpx.Response | None] | None = None
        self.telemetry: Callable[[httpx.Request], Any] | None = None

    # transports -------------------------------------------------------------
    def async_transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self._async_handle)

    def sync_transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def _async_handle(self, request: httpx.Request) -> httpx.Response:
        if self.telemetry is not None and request.url.path.startswith("/v1/tasks"):
            r = self.telemetry(request)
            if hasattr(r, "__await__"):
                r = await r
            if r is not None:
                return r
        return self.handle(request)

    # routing ------------------------------------------------------------------
    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.route is not None:
            r = self.route(request)
            if r is not None:
                return r
        path = request.url.path
        if request.method == "GET" and path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": m} for m in self.models]})
        if request.method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            body = json.loads(request.content)
            self.calls.append(body)
            self.headers.append(request.headers)
            if body.get("model") not in self.models:
                return error(404, f"model {body.get('model')!r} not found", "not_found_error", "model")
            return self._completion(path, body)
        if request.method == "POST" and path == "/v1/tasks":
            body = json.loads(request.content)
            self.tasks[body["task_id"]] = {"register": body, "events": [], "complete": None}
            return httpx.Response(201, json={"task_id": body["task_id"]})
        if path.startswith("/v1/tasks/"):
            parts = path.split("/")
            task = self.tasks.get(parts[3])
            if task is None:
                return error(404, "unknown task", "not_found_error", "task_id")
            if request.method == "GET" and len(parts) == 4:
                return httpx.Response(200, json={"task_id": parts[3], **task})
            body = json.loads(request.content)
            if parts[4] == "events":
                task["events"].extend(body["events"])
            elif parts[4] == "complete":
                task["complete"] = body
            return httpx.Response(200, json={"ok": True})
        return error(404, f"no route {request.method} {path}", "not_found_error", None)

    def _completion(self, path: str, body: dict[str, Any]) -> httpx.Response:
        n = int(body.get("max_tokens") or 3)
        chat = path.endswith("chat/completions")
        rid = f"cmpl-{len(self.calls)}"
        base = {"id": rid, "created": int(time.time()), "model": body["model"]}
        usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
        if not body.get("stream"):
            if chat:
                choices = [{"index": 0, "message": {"role": "assistant", "content": "tok " * n},
                            "finish_reason": "length"}]
                obj = {**base, "object": "chat.completion", "choices": choices}
            else:
                obj = {**base, "object": "text_completion",
                       "choices": [{"index": 0, "text": "tok " * n, "finish_reason": "length"}]}
            return httpx.Response(200, json={**obj, "usage": usage, "jitflow": timing(body, n)})
        events: list[Any] = []
        for i in range(n):
            fin = "length" if i == n - 1 else None
            if chat:
                delta = {"role": "assistant", "content": "tok "} if i == 0 else {"content": "tok "}
                events.append({**base, "object": "chat.completion.chunk",
                               "choices": [{"index": 0, "delta": delta, "finish_reason": fin}]})
            else:
                events.append({**base, "object": "text_completion",
                               "choices": [{"index": 0, "text": "tok ", "finish_reason": fin}]})
        events.append({**base, "object": "chat.completion.chunk" if chat else "text_completion",
                       "choices": [], "usage": usage, "jitflow": timing(body, n)})
        stream = TrackingStream(sse(events))
        self.streams.append(stream)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)


def error(status: int, message: str, type_: str, param: str | None, headers: dict[str, str] | None = None
          ) -> httpx.Response:
    """An OpenAI-shaped error response."""
    return httpx.Response(
        status, headers=headers or {},
        json={"error": {"message": message, "type": type_, "param": param, "code": None}},
    )
