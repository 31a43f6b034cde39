"""The decorators of agent programs: ``@jitflow.agent`` (one compound task per call, with an end-to-end
deadline) and ``@jitflow.tool`` (a traced tool node), and the default client they use
(``jitflow.configure``, ``jitflow.get_client``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

from ._calls import ToolCall
from ._context import current_task_var
from ._task import OnDeadline, _check_deadline, _check_on_deadline, _check_waiting_time

if TYPE_CHECKING:  # pragma: no cover
    from ._client import AsyncClient

__all__ = ["agent", "tool", "configure", "get_client"]

F = TypeVar("F", bound=Callable[..., Any])


# ---------------------------------------------------------------------- default client
_config: dict[str, Any] = {}
_explicit_client: AsyncClient | None = None
_default: AsyncClient | None = None


def configure(
    base_url: str | None = None, *, client: AsyncClient | None = None, **client_kwargs: Any
) -> None:
    """Configure the default client used by ``@jitflow.agent`` without ``client=``.

    Args:
        base_url: server URL (default: env ``JITFLOW_BASE_URL``, else ``http://127.0.0.1:8000``).
        client: use this :class:`AsyncClient` as the default instead of building one.
        **client_kwargs: other :class:`AsyncClient` arguments (``api_key``, ``model``,
            ``timeout``, ``transport``, ``tracer_provider``, ``telemetry_*`` ...).
    """
    global _explicit_client, _default
    _config.clear()
    if base_url is not None:
        _config["base_url"] = base_url
    _config.update(client_kwargs)
    _explicit_client = client
    _default = None


def get_client() -> AsyncClient:
    """The default :class:`AsyncClient` (see :func:`configure`), built lazily once.

    Like every :class:`AsyncClient` it may be used from successive event loops
    (``anyio.run`` calls, asyncio or trio): its connection pool is per event loop.
    """
    global _default
    if _explicit_client is not None:
        return _explicit_client
    if _default is None:
        from ._client import AsyncClient

        _default = AsyncClient(**_config)
    return _default


# ---------------------------------------------------------------------- decorators
def agent(
    app: str | None = None,
    *,
    deadline: float,
    client: AsyncClient | None = None,
    model: str | None = None,
    on_deadline: OnDeadline = "raise",
    metadata: dict[str, Any] | None = None,
    waiting_time: float | None = None,
) -> Callable[[F], F]:
    """Decorate an ``async def`` agent so that each call runs as one compound task.

    Args:
        app: application name (default: the function's ``__name__``).
        deadline: end-to-end deadline D in seconds from call start (positive, finite).
        client: the :class:`AsyncClient` to use (default: :func:`get_client`).
        model: default model for ``stage.chat``.
        on_deadline: ``"raise"`` or ``"best_effort"`` when a stage starts after the deadline.
        metadata: JSON-serialisable metadata sent with the task registration.
        waiting_time: admission bound in seconds for each of the task's LLM calls that sets none
            itself (default: the server's).

    If a task is already active (nested agents), the call joins it instead of opening a new one.

    Raises:
        TypeError: the decorated function is not ``async``; ``deadline`` not a number.
        ValueError: invalid ``deadline`` / ``on_deadline`` / ``waiting_time``.
    """
    _check_deadline(deadline)
    _check_on_deadline(on_deadline)
    _check_waiting_time(waiting_time)

    def decorate(fn: F) -> F:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError("@jitflow.agent decorates async functions (async def)")
        name = app or fn.__name__

        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            if current_task_var.get() is not None:
                return await fn(*args, **kwargs)
            c = client or get_client()
            async with c.task(name, deadline, model=model, on_deadline=on_deadline, metadata=metadata,
                              waiting_time=waiting_time):
                return await fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


@overload
def tool(fn: F, /) -> F: ...


@overload
def tool(*, name: str | None = None) -> Callable[[F], F]: ...


def tool(fn: Any = None, /, *, name: str | None = None) -> Any:
    """Mark a sync or async function as a tool: each call records a tool node (start, end,
    duration, error) in the current task/stage and an ``execute_tool {name}`` span.

    Usable as ``@jitflow.tool`` or ``@jitflow.tool(name="web_search")``. Exceptions propagate
    unchanged (and are recorded). Outside a task only the span is produced.
    """

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        tool_name = name or f.__name__
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                call = ToolCall(tool_name)
                call.begin()
                try:
                    result = await f(*args, **kwargs)
                except BaseException as e:
                    call.finish(e)
                    raise
                call.finish(None)
                return result

            return async_wrapper

        @functools.wraps(f)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            call = ToolCall(tool_name)
            call.begin()
            try:
                result = f(*args, **kwargs)
            except BaseException as e:
                call.finish(e)
                raise
            call.finish(None)
            return result

        return sync_wrapper

    if fn is not None:
        if not callable(fn):
            raise TypeError("@jitflow.tool expects a function")
        return decorate(fn)
    return decorate
