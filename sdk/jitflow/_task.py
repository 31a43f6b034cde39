"""Compound tasks: ``@jitflow.agent``, ``client.task``, stages, ``@jitflow.tool``.

A *compound request* (JITServe §3) is a staged DAG of LLM and tool calls with one end-to-end
deadline ``D`` (seconds from task start ``T0``). Stage order defines dependencies: a call's
parents are the previous stage's calls unless given explicitly; calls inside one stage are
parallel siblings. The server turns ``D`` into per-stage sub-deadlines ``T0 + φ(s)·D``
(JITServe §4.1, accumulated share) using the telemetry this module reports.
"""

from __future__ import annotations

import math
import time
import uuid
import warnings
from typing import TYPE_CHECKING, Any, Literal

import anyio
from opentelemetry import context as otel_context
from opentelemetry import trace

from ._calls import CallRecord
from ._context import current_stage_var, current_task_var, get_tracer, mark_error
from ._exceptions import DeadlineExceededError, NoActiveTaskError
from ._telemetry import TaskTelemetry, TelemetryWarning

if TYPE_CHECKING:  # pragma: no cover
    from ._client import AsyncClient, AsyncStream
    from ._types import ChatCompletion, ChatCompletionChunk, Completion

__all__ = ["Task", "Stage", "TaskScope", "StageScope", "stage"]

OnDeadline = Literal["raise", "best_effort"]


def _check_deadline(deadline: Any, name: str = "deadline") -> float:
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(deadline).__name__}")
    if not math.isfinite(deadline) or deadline <= 0:
        raise ValueError(f"{name} must be a positive finite number of seconds, got {deadline!r}")
    return float(deadline)


def _check_waiting_time(waiting_time: Any) -> float | None:
    return None if waiting_time is None else _check_deadline(waiting_time, "waiting_time")


def _check_on_deadline(value: str) -> OnDeadline:
    if value not in ("raise", "best_effort"):
        raise ValueError(f"on_deadline must be 'raise' or 'best_effort', got {value!r}")
    return value  # type: ignore[return-value]


class Stage:
    """One stage of a compound task (a Tempo super-node): a set of parallel sibling calls.

    Attributes:
        task: the owning :class:`Task`.
        name: stage name (part of the pattern-graph identity the server matches on).
        index: 0-based position in the task (order of stage start).
        start, end: unix seconds (``end`` None while open).
        best_effort: True if the stage opened after the task deadline with
            ``on_deadline="best_effort"``; its calls then default to ``slo=BestEffort()``.
        implicit: True for the one-call stage the SDK opens for a call made in a task outside any
            explicit stage (named after the model / tool).
        calls: the :class:`CallRecord` of every LLM/tool call made in this stage.
        sub_deadline: the latest sub-deadline (unix s) the server reported for this stage.
    """

    def __init__(self, task: Task, name: str, index: int, *, implicit: bool, best_effort: bool) -> None:
        self.task = task
        self.name = name
        self.index = index
        self.implicit = implicit
        self.best_effort = best_effort
        self.start = time.time()
        self.end: float | None = None
        self.calls: list[CallRecord] = []
        self.sub_deadline: float | None = None
        self._span: trace.Span | None = None

    def __repr__(self) -> str:
        return f"<Stage {self.index}:{self.name!r} calls={len(self.calls)}>"

    @property
    def call_ids(self) -> list[str]:
        """Ids of this stage's calls in start order."""
        return [c.call_id for c in self.calls]

    def _add_call(self, record: CallRecord) -> None:
        self.calls.append(record)

    async def chat(
        self, messages: list[dict[str, Any]], *, model: str | None = None, **kwargs: Any
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        """``client.chat.completions.create(...)`` bound to this stage (same arguments; ``model``
        defaults to the task's / client's model, else the server's first model)."""
        token = current_stage_var.set(self)
        try:
            return await self.task.client.chat.completions.create(
                messages=messages, model=model or self.task.model, **kwargs
            )
        finally:
            current_stage_var.reset(token)

    async def complete(
        self, prompt: str, *, model: str | None = None, **kwargs: Any
    ) -> Completion | AsyncStream[Completion]:
        """``client.completions.create(...)`` bound to this stage."""
        token = current_stage_var.set(self)
        try:
            return await self.task.client.completions.create(
                prompt=prompt, model=model or self.task.model, **kwargs
            )
        finally:
            current_stage_var.reset(token)


class Task:
    """A running compound task (created by :meth:`AsyncClient.task` / ``@jitflow.agent``).

    Attributes:
        client: the :class:`jitflow.AsyncClient` used for calls and telemetry.
        task_id: unique id (sent as ``jitflow.task_id`` with every call).
        app: application name (history is matched per app).
        deadline: end-to-end deadline D in seconds, relative to ``start_time``.
        start_time: T0, unix seconds.
        deadline_at: ``start_time + deadline`` (unix s).
        model: default model for ``stage.chat`` (None = client default / server's first model).
        on_deadline: ``"raise"`` (DeadlineExceededError when a stage starts after the deadline)
            or ``"best_effort"`` (continue, with ``slo=BestEffort()``).
        waiting_time: admission bound (s) for each of the task's LLM calls that sets none itself
            (JITServe §5: the server rejects a call not started within it); None = the server's default.
        stages: stages in start order.
        outcome: ``"succeeded" | "failed" | "deadline_missed"`` after exit, else None.
        error: ``"ExcType: message"`` if the task body raised.
        registered: whether the server acknowledged ``POST /v1/tasks`` at task start.
    """

    def __init__(
        self,
        client: AsyncClient,
        app: str,
        deadline: float,
        *,
        model: str | None = None,
        on_deadline: OnDeadline = "raise",
        metadata: dict[str, Any] | None = None,
        task_id: str | None = None,
        waiting_time: float | None = None,
    ) -> None:
        if not isinstance(app, str) or not app:
            raise ValueError("app must be a non-empty string")
        self.waiting_time = _check_waiting_time(waiting_time)
        self.client = client
        self.app = app
        self.deadline = _check_deadline(deadline)
        self.on_deadline = _check_on_deadline(on_deadline)
        self.model = model
        self.metadata = dict(metadata or {})
        self.task_id = task_id or uuid.uuid4().hex
        self.start_time = time.time()
        self.deadline_at = self.start_time + self.deadline
        self.end_time: float | None = None
        self.stages: list[Stage] = []
        self.outcome: str | None = None
        self.error: str | None = None
        self.registered = False
        self._span: trace.Span | None = None
        self._telemetry = TaskTelemetry(
            client,
            self.task_id,
            max_buffer=client._telemetry_buffer,
            retries=client._telemetry_retries,
            backoff=client._telemetry_backoff,
        )

    def __repr__(self) -> str:
        return f"<Task {self.app}:{self.task_id} stages={len(self.stages)} outcome={self.outcome}>"

    def remaining(self) -> float:
        """Seconds left until the task deadline (negative once it has passed)."""
        return self.deadline_at - time.time()

    def stage(self, name: str) -> StageScope:
        """Async context manager opening stage ``name`` of this task (yields a :class:`Stage`).

        Raises (on enter):
            DeadlineExceededError: the deadline has passed and ``on_deadline == "raise"``.
        """
        return StageScope(name, task=self)

    async def view(self) -> dict[str, Any]:
        """``GET /v1/tasks/{id}``: the server's view (stages, sub-deadlines, matched pattern, outcome)."""
        return await self.client.get_task(self.task_id)

    # ------------------------------------------------------------------ internals
    def _post_event(self, event: dict[str, Any]) -> None:
        self._telemetry.post_event(event)

    def _open_stage(self, name: str, *, implicit: bool = False) -> Stage:
        if not isinstance(name, str) or not name:
            raise ValueError("stage name must be a non-empty string")
        now = time.time()
        best_effort = False
        if now > self.deadline_at:
            if self.on_deadline == "raise":
                raise DeadlineExceededError(self.task_id, self.app, self.deadline, now - self.start_time, name)
            best_effort = True
        st = Stage(self, name, len(self.stages), implicit=implicit, best_effort=best_effort)
        self.stages.append(st)
        if not implicit:
            st._span = get_tracer(self.client._tracer_provider).start_span(
                f"stage {name}",
                kind=trace.SpanKind.INTERNAL,
                attributes={
                    "jitflow.app": self.app,
                    "jitflow.task_id": self.task_id,
                    "jitflow.stage": name,
                    "jitflow.stage_index": st.index,
                    "jitflow.stage.best_effort": best_effort,
                },
            )
        self._post_event({"type": "stage_start", "stage": name, "stage_index": st.index, "time": st.start})
        return st

    def _close_stage(self, st: Stage, error: BaseException | None = None) -> None:
        if st.end is not None:
            return
        st.end = time.time()
        if st._span is not None:
            if st.sub_deadline is not None:
                st._span.set_attribute("jitflow.sub_deadline", st.sub_deadline)
            if error is not None:
                mark_error(st._span, error)
            st._span.end()
        self._post_event({"type": "stage_end", "stage": st.name, "stage_index": st.index, "time": st.end})

    def _parents_for(self, st: Stage) -> list[str]:
        for prev in reversed(self.stages[: st.index]):
            if prev.calls:
                return prev.call_ids
        return []


class StageScope:
    """Async context manager for one stage (``task.stage(name)`` / ``jitflow.stage(name)``).

    Sets the stage as current (contextvars) and as the current OpenTelemetry span for the body;
    emits ``stage_start`` / ``stage_end`` telemetry.

    Raises (on enter):
        NoActiveTaskError: ``jitflow.stage`` outside a task.
        DeadlineExceededError: the task deadline passed and ``on_deadline == "raise"``.
    """

    def __init__(self, name: str, *, task: Task | None = None) -> None:
        self._name = name
        self._task = task
        self._stage: Stage | None = None
        self._tokens: tuple[Any, Any] | None = None

    async def __aenter__(self) -> Stage:
        task = self._task or current_task_var.get()
        if task is None:
            raise NoActiveTaskError(
                f"jitflow.stage({self._name!r}) used outside a compound task; "
                "use @jitflow.agent or `async with client.task(...)`"
            )
        st = task._open_stage(self._name)
        self._stage = st
        otel_token = otel_context.attach(trace.set_span_in_context(st._span)) if st._span else None
        self._tokens = (current_stage_var.set(st), otel_token)
        return st

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        st = self._stage
        if st is None or self._tokens is None:
            return
        stage_token, otel_token = self._tokens
        self._tokens = None
        try:
            current_stage_var.reset(stage_token)
        except ValueError:  # entered in another context; nothing to restore
            pass
        if otel_token is not None:
            otel_context.detach(otel_token)
        st.task._close_stage(st, exc)
        if exc is None and any(c.type == "tool" for c in st.calls):
            # Tool nodes travel only as telemetry: give them a bounded chance to reach the server
            # before the next stage's calls are matched against history (never raises).
            await st.task._telemetry.drain(STAGE_DRAIN_TIMEOUT)


#: Seconds a stage exit waits for its tool-node telemetry to be delivered (bounded; see ``drain``).
STAGE_DRAIN_TIMEOUT = 0.25


def stage(name: str) -> StageScope:
    """Open stage ``name`` of the current compound task (async context manager yielding
    :class:`Stage`). See :class:`StageScope`."""
    return StageScope(name)


class TaskScope:
    """Async context manager behind :meth:`AsyncClient.task` and ``@jitflow.agent``.

    On enter: if a task is already active in this context it is reused (nested use); otherwise a
    new :class:`Task` is created, its telemetry sender started in an anyio task group owned by
    this scope, the ``invoke_workflow {app}`` span started, and ``POST /v1/tasks`` awaited for at
    most ``client``'s ``telemetry_register_timeout`` seconds (failure is counted, warned and
    retried in the background; it never fails the agent).

    On exit: the outcome is ``failed`` if the body raised (``deadline_missed`` for
    :class:`DeadlineExceededError` or when it finished after the deadline), else ``succeeded``;
    ``POST /v1/tasks/{id}/complete`` is queued and the buffer flushed within
    ``telemetry_flush_timeout`` seconds; the body's exception propagates unchanged.
    """

    def __init__(self, client: AsyncClient, app: str, deadline: float, **kwargs: Any) -> None:
        self._client = client
        self._app = app
        self._deadline = _check_deadline(deadline)
        self._kwargs = kwargs
        if "on_deadline" in kwargs:
            _check_on_deadline(kwargs["on_deadline"])
        _check_waiting_time(kwargs.get("waiting_time"))
        self._task: Task | None = None
        self._reused = False
        self._tg: Any = None
        self._tokens: tuple[Any, Any] | None = None

    async def __aenter__(self) -> Task:
        existing = current_task_var.get()
        if existing is not None:
            self._reused = True
            return existing
        task = Task(self._client, self._app, self._deadline, **self._kwargs)
        self._task = task
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(task._telemetry.run)
        task._span = get_tracer(self._client._tracer_provider).start_span(
            f"invoke_workflow {task.app}",
            kind=trace.SpanKind.INTERNAL,
            attributes={
                "gen_ai.operation.name": "invoke_workflow",
                # the workflow's name: semantic conventions 1.41 (gen_ai.workflow.name) and later (agent.name)
                "gen_ai.workflow.name": task.app,
                "gen_ai.agent.name": task.app,
                "jitflow.app": task.app,
                "jitflow.task_id": task.task_id,
                "jitflow.deadline": task.deadline,
                "jitflow.deadline_at": task.deadline_at,
            },
        )
        self._tokens = (
            current_task_var.set(task),
            otel_context.attach(trace.set_span_in_context(task._span)),
        )
        try:
            await self._register(task)
        except BaseException as e:  # e.g. cancelled while registering: leave nothing behind
            await self.__aexit__(type(e), e, e.__traceback__)
            raise
        return task

    async def _register(self, task: Task) -> None:
        body = {
            "task_id": task.task_id,
            "app": task.app,
            "deadline": task.deadline,
            "start_time": task.start_time,
            "metadata": task.metadata,
        }
        client = self._client
        outcome = "timeout"
        with anyio.move_on_after(client._telemetry_register_timeout):
            outcome = await task._telemetry._attempt("/v1/tasks", body)
        if outcome == "ok":
            task.registered = True
            client.telemetry.sent += 1
            return
        client.telemetry.registration_failures += 1
        client.telemetry.failed_attempts += 1
        warnings.warn(
            f"jitflow: could not register task {task.task_id} with {client.base_url} ({outcome}); "
            "continuing, telemetry will be retried in the background",
            TelemetryWarning,
            stacklevel=3,
        )
        if outcome != "fatal":
            task._telemetry.post_register(body)
        else:
            client.telemetry.dropped += 1

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self._reused:
            return False
        task = self._task
        assert task is not None and self._tokens is not None
        try:
            task.end_time = time.time()
            if exc is not None:
                task.error = f"{type(exc).__name__}: {exc}"[:500]
                task.outcome = "deadline_missed" if isinstance(exc, DeadlineExceededError) else "failed"
            elif task.end_time > task.deadline_at:
                task.outcome = "deadline_missed"
            else:
                task.outcome = "succeeded"
            for st in task.stages:  # stages left open by a crashed body
                task._close_stage(st, exc)
            task._telemetry.post_complete(
                {"outcome": task.outcome, "end_time": task.end_time, "error": task.error}
            )
            await task._telemetry.flush(self._client._telemetry_flush_timeout)
        finally:
            task._telemetry.stop()
            self._tg.cancel_scope.cancel()
            try:
                # The body's exception is deliberately not passed to the task group: it must
                # propagate unchanged (not wrapped in an ExceptionGroup).
                await self._tg.__aexit__(None, None, None)
            finally:
                span = task._span
                if span is not None:
                    span.set_attribute("jitflow.outcome", task.outcome or "failed")
                    if exc is not None:
                        mark_error(span, exc)
                    span.end()
                task_token, otel_token = self._tokens
                self._tokens = None
                otel_context.detach(otel_token)
                try:
                    current_task_var.reset(task_token)
                except ValueError:  # pragma: no cover - exited in another context
                    pass
        return False
