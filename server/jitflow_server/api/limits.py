"""Limits on what one request may ask of the server (hostile input is normal input).

- :func:`check_json_schema`: a ``response_format`` JSON schema is compiled into a grammar by the engine's
  structured-output backend, whose size grows with the schema's repetition bounds: one schema with
  ``"minItems": 100000000`` made the API and engine processes grow to 10 GB and never finish. Schemas are
  checked before they reach the engine: serialized size, nesting depth and node count are bounded, and
  every count bound (``minItems``, ``maxItems``, ``minLength``, ``maxLength``, ``minProperties``,
  ``maxProperties``, ``minContains``, ``maxContains``) must be at most :data:`MAX_SCHEMA_COUNT`; a
  ``minItems`` / ``minProperties`` / ``minContains`` above the request's ``max_tokens`` cannot be met
  (every item or property needs a token) and is refused with that reason.
- :class:`BodySizeLimit`: an ASGI middleware that answers ``413`` once a request body passes
  ``max_bytes``, before it is parsed or tokenized (a 20 MB body stalled the event loop for 25 s).

Every refusal is an :class:`~jitflow_server.api.schemas.APIError` in OpenAI's error shape naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from jitflow_server.api.schemas import APIError

#: Largest serialized ``response_format`` schema (bytes of compact JSON).
MAX_SCHEMA_BYTES = 64 * 1024
#: Deepest nesting of objects/arrays in a schema.
MAX_SCHEMA_DEPTH = 32
#: Most objects and arrays in a schema.
MAX_SCHEMA_NODES = 4096
#: Largest count bound (``minItems``, ``maxLength``, ...) a schema may state.
MAX_SCHEMA_COUNT = 16384
#: Largest request body (bytes) by default.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

COUNT_KEYS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
              "minContains", "maxContains")
#: Lower bounds that need at least one output token per unit (an array item, a property).
PER_TOKEN_KEYS = ("minItems", "minProperties", "minContains")
_PARAM = "response_format.json_schema.schema"


def check_json_schema(schema: dict[str, Any], max_tokens: int) -> None:
    """Refuse a ``response_format`` schema the engine should not compile (module docstring).

    ``max_tokens``: the request's output cap (tokens). Raises ``APIError(400)`` naming the field
    (``response_format.json_schema.schema`` or the offending key's path in it).
    """
    try:
        size = len(json.dumps(schema, separators=(",", ":"), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"the schema is not valid JSON: {exc}", param=_PARAM) from None
    if size > MAX_SCHEMA_BYTES:
        raise APIError(400, f"the schema is {size} bytes; the limit is {MAX_SCHEMA_BYTES}", param=_PARAM)
    nodes = 0
    stack: list[tuple[Any, str, int]] = [(schema, _PARAM, 1)]
    while stack:
        node, path, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise APIError(400, f"the schema has more than {MAX_SCHEMA_NODES} objects and arrays", param=_PARAM)
        if depth > MAX_SCHEMA_DEPTH:
            raise APIError(400, f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param=path)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, val in items:
            sub = f"{path}.{key}" if isinstance(node, dict) else f"{path}[{key}]"
            if isinstance(node, dict) and key in COUNT_KEYS and isinstance(val, (int, float)) \
                    and not isinstance(val, bool):
                if val > MAX_SCHEMA_COUNT:
                    raise APIError(400, f"{key} is {val}; the limit is {MAX_SCHEMA_COUNT}", param=sub)
                if key in PER_TOKEN_KEYS and val > max_tokens:
                    raise APIError(400, f"{key} {val} cannot be met within max_tokens {max_tokens}", param=sub)
            stack.append((val, sub, depth + 1))


class BodySizeLimit:
    """ASGI middleware: a request whose body exceeds ``max_bytes`` gets ``413`` in OpenAI's error shape
    (``param`` null, ``code`` ``"request_too_large"``) and the connection's remaining body is not read
    into memory. A ``Content-Length`` above the limit is refused before any byte is read."""

    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.app, self.max_bytes = app, int(max_bytes)

    def _error(self) -> APIError:
        return APIError(413, f"request body exceeds {self.max_bytes} bytes", type="invalid_request_error",
                        code="request_too_large")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await self._send_error(send)
                    return
        seen = 0
        sent_error = False

        async def limited_receive() -> dict:
            nonlocal seen, sent_error
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    if not sent_error:
                        sent_error = True
                        await self._send_error(send)
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg: dict) -> None:
            if not sent_error:
                await send(msg)

        await self.app(scope, limited_receive, guarded_send)

    async def _send_error(self, send: Any) -> None:
        body = json.dumps(self._error().body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
