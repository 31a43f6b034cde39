"""``x-request-id`` on every response, as OpenAI's API sends it.

A client's own ``x-request-id`` (up to 128 printable ASCII characters, the header proxies and tracing
tools set) is echoed so its logs and ours name the request alike; otherwise a streamed completion is
named by its completion id (what the server's logs and ``/v1/jitflow/engine/events`` use) and any other
answer by an id the server makes (``req_`` + 32 hex digits). Pure ASGI, so it also covers 401, 413 and errors raised before routing.
"""

from __future__ import annotations

import uuid
from typing import Any

_HEADER = b"x-request-id"
MAX_REQUEST_ID = 128


def _valid(value: bytes) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID and all(0x21 <= c <= 0x7E for c in value)


class RequestId:
    """ASGI middleware adding ``x-request-id`` to every HTTP response (module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", []) if k == _HEADER), None)
        given = given if given is not None and _valid(given) else None

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                own = next((v for k, v in headers if k.lower() == _HEADER), None)
                rid = given or own or f"req_{uuid.uuid4().hex}".encode()
                headers = [(k, v) for k, v in headers if k.lower() != _HEADER]
                message = {**message, "headers": [*headers, (_HEADER, rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
