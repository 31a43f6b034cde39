"""Typed exceptions raised by the jitflow SDK.

Hierarchy (modelled on httpx / openai-python)::

    JitflowError
    ├── APIError                       anything that came from talking to the server
    │   ├── APIConnectionError         server unreachable, connection reset, protocol error
    │   │   └── APITimeoutError        the HTTP timeout elapsed
    │   └── APIStatusError             the server answered with an error status (or a mid-stream error)
    │       ├── BadRequestError            400 (validation errors of the jitflow server; ``param`` names the field)
    │       ├── NotFoundError              404 (unknown model, unknown task)
    │       ├── UnprocessableEntityError   422 (validation error as other servers send it)
    │       ├── AdmissionRejectedError     429/503 with error.type == "admission_rejected"
    │       ├── RateLimitError             other 429
    │       ├── InternalServerError        5xx
    │       └── StreamError                ``data: {"error": ...}`` event inside an SSE stream
    ├── DeadlineExceededError          a stage started after its compound task's deadline
    └── NoActiveTaskError              ``jitflow.stage()`` used outside a compound task
"""

from __future__ import annotations

import email.utils
import time
from typing import Any

import httpx

__all__ = [
    "JitflowError",
    "APIError",
    "APIConnectionError",
    "APITimeoutError",
    "APIStatusError",
    "BadRequestError",
    "NotFoundError",
    "UnprocessableEntityError",
    "AdmissionRejectedError",
    "RateLimitError",
    "InternalServerError",
    "StreamError",
    "DeadlineExceededError",
    "NoActiveTaskError",
]


class JitflowError(Exception):
    """Base class of every exception raised by the jitflow SDK."""


class APIError(JitflowError):
    """An error while talking to the jitflow server.

    Attributes:
        message: human-readable description.
        request: the ``httpx.Request`` that failed, when known.
        body: the decoded JSON error body (or raw text) when the server sent one, else ``None``.
        type, param, code: the OpenAI-shaped ``error.type`` / ``error.param`` / ``error.code``
            fields when present (``param`` names the offending field, e.g. ``"slo.deadline"``).
        attempts: HTTP attempts the call made before this error was raised (``1`` plus the
            retries of a 429/503, see ``AsyncClient(max_retries=...)``).
    """

    def __init__(self, message: str, *, request: httpx.Request | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.request = request
        self.body = body
        err = body.get("error") if isinstance(body, dict) else None
        err = err if isinstance(err, dict) else {}
        self.type: str | None = err.get("type")
        self.param: str | None = err.get("param")
        self.code: Any = err.get("code")
        self.attempts: int = 1


class APIConnectionError(APIError):
    """The server could not be reached (connect refused, reset, DNS, protocol error)."""

    def __init__(self, message: str = "Connection error.", *, request: httpx.Request | None = None) -> None:
        super().__init__(message, request=request)


class APITimeoutError(APIConnectionError):
    """The request exceeded the client's timeout (seconds, see ``AsyncClient(timeout=...)``)."""

    def __init__(self, message: str = "Request timed out.", *, request: httpx.Request | None = None) -> None:
        super().__init__(message, request=request)


class APIStatusError(APIError):
    """The server answered with a 4xx/5xx status.

    Args:
        status_code: HTTP status code.
        body: decoded JSON body (``{"error": {"message", "type", "param", "code"}}``) or text.
        message: human-readable message (taken from ``error.message`` when present).
        response: the ``httpx.Response``, when available.
        retry_after: seconds the server asked the client to wait (``Retry-After`` header,
            delta-seconds or HTTP-date), or ``None`` if absent / unparsable.
    """

    def __init__(
        self,
        status_code: int,
        body: Any,
        message: str,
        *,
        response: httpx.Response | None = None,
        retry_after: float | None = None,
    ) -> None:
        request = None
        if response is not None:
            try:
                request = response.request
            except RuntimeError:
                request = None
        super().__init__(message, request=request, body=body)
        self.status_code = status_code
        self.response = response
        self.request_id: str | None = response.headers.get("x-request-id") if response is not None else None
        self.retry_after = retry_after

    def __str__(self) -> str:
        param = f" (param: {self.param})" if self.param else ""
        return f"Error code: {self.status_code} - {self.message}{param}"


class BadRequestError(APIStatusError):
    """HTTP 400: the request is malformed (``param`` names the field)."""


class NotFoundError(APIStatusError):
    """HTTP 404: unknown model, task or route."""


class UnprocessableEntityError(APIStatusError):
    """HTTP 422: the body failed validation, as some OpenAI-compatible servers report it (the jitflow
    server sends validation errors as 400, :class:`BadRequestError`, with ``param`` naming the field)."""


class RateLimitError(APIStatusError):
    """HTTP 429 whose ``error.type`` is not ``"admission_rejected"``."""


class InternalServerError(APIStatusError):
    """HTTP 5xx: engine failure or server bug."""


class AdmissionRejectedError(APIStatusError):
    """The server's admission control rejected the request (JITServe §4.2, ``waiting_time``).

    Raised for HTTP 429 or 503 whose body has ``error.type == "admission_rejected"``. The clients
    retry it (``max_retries``) before raising it.

    Attributes:
        retry_after: seconds to wait before retrying, parsed from the ``Retry-After`` header
            (delta-seconds or HTTP-date), or ``None`` if absent / unparsable.
    """


class StreamError(APIStatusError):
    """An ``data: {"error": {...}}`` event arrived in the middle of an SSE stream.

    ``status_code`` is ``error.code`` when that is an HTTP status (400..599), else 500.
    """


class DeadlineExceededError(JitflowError):
    """A stage was started after its compound task's deadline (``on_deadline="raise"``).

    Attributes:
        task_id: the task's id.
        app: the task's application name.
        deadline: the task's end-to-end deadline in seconds (relative to task start).
        elapsed: seconds since task start when the stage was opened.
        stage: the stage name being opened.
    """

    def __init__(self, task_id: str, app: str, deadline: float, elapsed: float, stage: str) -> None:
        super().__init__(
            f"task {task_id} ({app}): stage {stage!r} started {elapsed:.3f}s after task start, "
            f"past its deadline of {deadline:.3f}s"
        )
        self.task_id = task_id
        self.app = app
        self.deadline = deadline
        self.elapsed = elapsed
        self.stage = stage


class NoActiveTaskError(JitflowError, RuntimeError):
    """A task-scoped API (``jitflow.stage``) was used outside ``@jitflow.agent`` / ``client.task``."""


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Parse a ``Retry-After`` header value into seconds (>= 0).

    Accepts delta-seconds (``"3"``, ``"1.5"``) or an HTTP-date; returns ``None`` when absent or
    unparsable.
    """
    if value is None:
        return None
    value = value.strip()
    try:
        secs = float(value)
    except ValueError:
        try:
            dt = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if dt is None:
            return None
        secs = dt.timestamp() - (time.time() if now is None else now)
    if secs != secs or secs in (float("inf"), float("-inf")):
        return None
    return max(0.0, secs)


def _decode_body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except (ValueError, UnicodeDecodeError):
        try:
            return response.text or None
        except Exception:  # pragma: no cover - undecodable bytes
            return None


def _message_from_body(body: Any, status_code: int) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        detail = body.get("detail")  # FastAPI's default shape
        if detail:
            return str(detail)
    if isinstance(body, str) and body.strip():
        return body.strip()[:500]
    return f"HTTP {status_code}"


def status_error_from_response(response: httpx.Response) -> APIStatusError:
    """Build the typed :class:`APIStatusError` subclass for an error response (body must be read)."""
    status = response.status_code
    body = _decode_body(response)
    message = _message_from_body(body, status)
    err = body.get("error") if isinstance(body, dict) else None
    err_type = err.get("type") if isinstance(err, dict) else None
    retry_after = parse_retry_after(response.headers.get("retry-after"))
    if status in (429, 503) and err_type == "admission_rejected":
        return AdmissionRejectedError(status, body, message, response=response, retry_after=retry_after)
    if status == 429:
        return RateLimitError(status, body, message, response=response, retry_after=retry_after)
    cls: type[APIStatusError]
    if status == 400:
        cls = BadRequestError
    elif status == 404:
        cls = NotFoundError
    elif status == 422:
        cls = UnprocessableEntityError
    elif status >= 500:
        cls = InternalServerError
    else:
        cls = APIStatusError
    return cls(status, body, message, response=response, retry_after=retry_after)


def stream_error_from_event(obj: dict[str, Any], response: httpx.Response | None) -> StreamError:
    """Build a :class:`StreamError` from a decoded ``{"error": {...}}`` SSE event."""
    err = obj.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    status = code if isinstance(code, int) and 400 <= code <= 599 else 500
    return StreamError(status, obj, _message_from_body(obj, status), response=response)
