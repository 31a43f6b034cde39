"""LangGraph: one jitflow compound task per graph run, one stage per LangGraph super-step.

The nodes stay as they are: any OpenAI-compatible client they use (``openai.OpenAI``, LangChain's
``ChatOpenAI``) gets an HTTP client from :func:`http_client` / :func:`async_http_client`, and the graph
is invoked with :func:`task_config`::

    from jitflow.integrations import langgraph as jf

    llm = ChatOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", http_client=jf.http_client())
    graph.invoke(inputs, config=jf.task_config("research-graph", deadline=60))

Each request a node sends carries the task's context as jitflow's ``x-jitflow-*`` headers
(docs/api.md): the task id and application, the stage (the node's name) and its index (the super-step,
``langgraph_step``, from 0), kind ``compound`` and the time left to the task's deadline. The server
registers the task at its first call, gives every stage a sub-deadline from the application's history
and closes the task once its calls are over. The context is read from LangGraph's own run config
(``langgraph.config.get_config``) when the request is sent, so requests outside a graph run, or in a run
not started with :func:`task_config`, go out unchanged.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx

from jitflow.integrations._transport import (
    AsyncHeaderTransport,
    HeaderTransport,
    check_task,
    client_kwargs,
    task_context_headers,
)

__all__ = ["task_config", "http_client", "async_http_client", "JitflowTransport", "AsyncJitflowTransport",
           "task_headers"]

#: Key of the task context in the run config's ``configurable``.
TASK_KEY = "jitflow_task"


def task_config(app: str, deadline: float, *, task_id: str | None = None,
                config: dict[str, Any] | None = None) -> dict[str, Any]:
    """A LangGraph run config (``graph.invoke(inputs, config=...)``) that makes the run one jitflow task of
    application ``app`` due ``deadline`` seconds from now. ``config`` (optional) is merged in.

    Raises:
        ValueError: ``deadline`` not a positive number of seconds, or an empty ``app``.
    """
    check_task(app, deadline)
    out = dict(config or {})
    configurable = dict(out.get("configurable") or {})
    configurable[TASK_KEY] = {"task_id": task_id or uuid.uuid4().hex, "app": app,
                              "deadline_at": time.time() + float(deadline)}
    out["configurable"] = configurable
    return out


def task_headers() -> dict[str, str]:
    """The ``x-jitflow-*`` headers of the LangGraph node running now (empty outside a run started with
    :func:`task_config`)."""
    try:
        from langgraph.config import get_config

        cfg = get_config()
    except (ImportError, RuntimeError):  # no LangGraph, or not inside a graph run
        return {}
    task = (cfg.get("configurable") or {}).get(TASK_KEY)
    if not isinstance(task, dict):
        return {}
    meta = cfg.get("metadata") or {}
    step = meta.get("langgraph_step")
    node = meta.get("langgraph_node")
    return task_context_headers(str(task["task_id"]), str(task["app"]), task["deadline_at"],
                                str(node) if node else None,
                                max(step - 1, 0) if isinstance(step, int) else None)  # steps count from 1


class JitflowTransport(HeaderTransport):
    """An httpx transport adding :func:`task_headers` to every request, then sending it with ``inner``
    (default ``httpx.HTTPTransport()``)."""

    def __init__(self, inner: httpx.BaseTransport | None = None) -> None:
        super().__init__(task_headers, inner)


class AsyncJitflowTransport(AsyncHeaderTransport):
    """Async twin of :class:`JitflowTransport`."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(task_headers, inner)


def http_client(**kwargs: Any) -> httpx.Client:
    """An ``httpx.Client`` with :class:`JitflowTransport` (``kwargs`` go to ``httpx.Client``; give
    ``timeout`` for long generations: the default is 600 s)."""
    return httpx.Client(transport=JitflowTransport(), **client_kwargs(kwargs))


def async_http_client(**kwargs: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` with :class:`AsyncJitflowTransport` (see :func:`http_client`)."""
    return httpx.AsyncClient(transport=AsyncJitflowTransport(), **client_kwargs(kwargs))
