"""Lifecycle of one LLM or tool call: task/stage binding, SLO defaults, spans, telemetry records.

Shared by the async and sync clients and by ``@jitflow.tool``; contains no I/O.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from ._context import current_stage_var, current_task_var, get_tracer, mark_error
from ._slo import SLO, BestEffort, Compound, parse_slo

if TYPE_CHECKING:  # pragma: no cover
    from ._task import Stage, Task
    from ._types import Timing, Usage

__all__ = ["CallRecord", "LLMCall", "ToolCall"]

#: ``gen_ai.provider.name`` of the calls' spans (OpenTelemetry GenAI conventions: the provider as the
#: instrumentation identifies it; the jitflow server is an OpenAI-compatible API of its own).
PROVIDER_NAME = "jitflow"


@dataclass
class CallRecord:
    """One node of the task's pattern graph as recorded by the SDK.

    Attributes:
        call_id: SDK-generated id (sent to the server as ``jitflow.call_id``).
        type: ``"llm"`` or ``"tool"``.
        name: model id (llm) or tool name (tool).
        parents: call ids this call depends on.
        start, end: unix seconds (``end`` is None while running).
        input_tokens, output_tokens: token counts (llm only).
        error: ``"ExcType: message"`` if the call raised, else None.
    """

    call_id: str
    type: str
    name: str
    parents: list[str]
    start: float
    end: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    sub_deadline: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _new_call_id() -> str:
    return uuid.uuid4().hex[:16]


def _bind(name: str) -> tuple[Task | None, Stage | None, bool]:
    """Find the active task/stage; open an implicit one-call stage for calls made in a task but
    outside any stage. Returns (task, stage, implicit)."""
    stage = current_stage_var.get()
    task = stage.task if stage is not None else current_task_var.get()
    if task is not None and stage is None:
        return task, task._open_stage(name, implicit=True), True
    return task, stage, False


def _parent_context(stage: Stage | None) -> otel_context.Context:
    ctx = otel_context.get_current()
    if stage is not None and stage._span is not None:
        if not trace.get_current_span(ctx).get_span_context().is_valid:
            ctx = trace.set_span_in_context(stage._span, ctx)
    elif stage is not None and stage.task._span is not None:
        if not trace.get_current_span(ctx).get_span_context().is_valid:
            ctx = trace.set_span_in_context(stage.task._span, ctx)
    return ctx


class LLMCall:
    """One ``chat`` / ``text_completion`` call (OpenTelemetry GenAI client span + task node).

    Args:
        operation: ``"chat"`` or ``"text_completion"`` (``gen_ai.operation.name``).
        model: requested model id.
        slo: explicit SLO (instance or wire dict) or None for the default (compound inside a task,
            none outside).
        waiting_time: admission bound in seconds merged into the SLO (inside a task whose
            ``waiting_time`` is set, the task's when neither this nor the SLO gives one).
        parents: explicit parent call ids (default: the previous stage's calls).
        tracer_provider: OpenTelemetry provider (None = global).
        server_attrs: ``server.address`` / ``server.port``.
        request_attrs: extra request attributes (``gen_ai.request.*``).

    Raises (from :meth:`begin`):
        ValueError / pydantic.ValidationError: invalid SLO or ``waiting_time`` without an SLO.
        jitflow.DeadlineExceededError: implicit stage opened after the task deadline.
    """

    def __init__(
        self,
        *,
        operation: str,
        model: str,
        slo: SLO | dict[str, Any] | None,
        waiting_time: float | None,
        parents: Sequence[str] | None,
        tracer_provider: trace.TracerProvider | None,
        server_attrs: dict[str, Any],
        request_attrs: dict[str, Any],
    ) -> None:
        self.operation = operation
        self.model = model
        self._slo_arg = slo
        self._waiting_time = waiting_time
        self._parents_arg = list(parents) if parents is not None else None
        self._tracer_provider = tracer_provider
        self._server_attrs = server_attrs
        self._request_attrs = request_attrs
        self.call_id = _new_call_id()
        self.task: Task | None = None
        self.stage: Stage | None = None
        self.record: CallRecord | None = None
        self.slo: SLO | None = None
        self._implicit = False
        self._span: trace.Span | None = None
        self._finished = False

    def begin(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, str]]:
        """Bind to the task/stage, start the span. Returns (slo wire, jitflow ctx, trace headers)."""
        slo = parse_slo(self._slo_arg) if self._slo_arg is not None else None
        if self._waiting_time is not None:
            if slo is None and current_task_var.get() is None and current_stage_var.get() is None:
                raise ValueError("waiting_time needs an slo (e.g. slo=jitflow.BestEffort())")
            if slo is not None:
                slo = slo.with_waiting_time(self._waiting_time)
        task, stage, implicit = _bind(self.model)
        self.task, self.stage, self._implicit = task, stage, implicit
        jf: dict[str, Any] | None = None
        if task is not None and stage is not None:
            try:
                if slo is None:
                    if stage.best_effort:
                        slo = BestEffort()
                    else:
                        remaining = task.deadline_at - time.time()
                        slo = Compound(remaining) if remaining > 0 and math.isfinite(remaining) else Compound()
                    if self._waiting_time is not None:
                        slo = slo.with_waiting_time(self._waiting_time)
                if task.waiting_time is not None and slo.waiting_time is None:  # the task's default
                    slo = slo.with_waiting_time(task.waiting_time)
            except Exception:
                if implicit:
                    task._close_stage(stage)
                raise
            parents = self._parents_arg if self._parents_arg is not None else task._parents_for(stage)
            self.record = CallRecord(self.call_id, "llm", self.model, parents, time.time())
            stage._add_call(self.record)
            jf = {
                "task_id": task.task_id,
                "stage": stage.name,
                "stage_index": stage.index,
                "call_id": self.call_id,
                "parents": parents,
            }
        self.slo = slo
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.provider.name": PROVIDER_NAME,
            "gen_ai.request.model": self.model,
            **self._server_attrs,
            **{k: v for k, v in self._request_attrs.items() if v is not None},
            "jitflow.call_id": self.call_id,
        }
        if slo is not None:
            attrs["jitflow.slo.kind"] = slo.kind
            for key in ("ttft", "tbt", "deadline", "waiting_time"):
                val = getattr(slo, key, None)
                if val is not None:
                    attrs[f"jitflow.slo.{key}"] = float(val)
        if task is not None and stage is not None:
            attrs.update(
                {
                    "jitflow.app": task.app,
                    "jitflow.task_id": task.task_id,
                    "jitflow.stage": stage.name,
                    "jitflow.stage_index": stage.index,
                }
            )
        tracer = get_tracer(self._tracer_provider)
        self._span = tracer.start_span(
            f"{self.operation} {self.model}",
            context=_parent_context(stage),
            kind=trace.SpanKind.CLIENT,
            attributes=attrs,
        )
        headers: dict[str, str] = {}
        propagate.inject(headers, context=trace.set_span_in_context(self._span))
        return (slo.to_wire() if slo is not None else None), jf, headers

    def finish(
        self,
        *,
        error: BaseException | None = None,
        timing: Timing | None = None,
        usage: Usage | None = None,
        response_id: str | None = None,
        response_model: str | None = None,
        finish_reasons: Sequence[str] = (),
        output_tokens: int | None = None,
    ) -> None:
        """End the span and record the task node (idempotent)."""
        if self._finished:
            return
        self._finished = True
        end = time.time()
        in_tok = usage.prompt_tokens if usage is not None else (timing.prompt_tokens if timing else 0)
        if usage is not None:
            out_tok = usage.completion_tokens
        elif timing is not None:
            out_tok = timing.output_tokens
        else:
            out_tok = output_tokens or 0
        span = self._span
        if span is not None:
            if response_id:
                span.set_attribute("gen_ai.response.id", response_id)
            if response_model:
                span.set_attribute("gen_ai.response.model", response_model)
            if finish_reasons:
                span.set_attribute("gen_ai.response.finish_reasons", list(finish_reasons))
            if usage is not None or timing is not None or output_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", int(in_tok))
                span.set_attribute("gen_ai.usage.output_tokens", int(out_tok))
            if timing is not None:
                for key in ("request_id", "ttft", "tbt_max", "tbt_mean", "e2el", "slo_met",
                            "sub_deadline", "len_bound"):
                    val = getattr(timing, key)
                    if val is not None:
                        span.set_attribute(f"jitflow.{key}", val)
            if error is not None:
                mark_error(span, error)
            span.end()
        rec = self.record
        if rec is not None and self.task is not None and self.stage is not None:
            rec.end = end
            rec.input_tokens = int(in_tok)
            rec.output_tokens = int(out_tok)
            if error is not None:
                rec.error = f"{type(error).__name__}: {error}"[:500]
            if timing is not None and timing.sub_deadline is not None:
                rec.sub_deadline = timing.sub_deadline
                self.stage.sub_deadline = timing.sub_deadline
            self.task._post_event(
                {
                    "type": "llm",
                    "call_id": rec.call_id,
                    "model": self.model,
                    "stage": self.stage.name,
                    "stage_index": self.stage.index,
                    "parents": rec.parents,
                    "start": rec.start,
                    "end": end,
                    "input_tokens": rec.input_tokens,
                    "output_tokens": rec.output_tokens,
                }
            )
            if self._implicit:
                self.task._close_stage(self.stage)


class ToolCall:
    """One ``@jitflow.tool`` execution: ``execute_tool {name}`` span + tool node.

    Args:
        name: tool name (``gen_ai.tool.name``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.call_id = _new_call_id()
        self.task: Task | None = None
        self.stage: Stage | None = None
        self.record: CallRecord | None = None
        self._implicit = False
        self._span: trace.Span | None = None
        self._token: object | None = None

    def begin(self) -> None:
        """Bind to the task/stage and start the span (made current for the tool's body)."""
        task, stage, implicit = _bind(self.name)
        self.task, self.stage, self._implicit = task, stage, implicit
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": self.name,
            "gen_ai.tool.call.id": self.call_id,
            "jitflow.call_id": self.call_id,
        }
        if task is not None and stage is not None:
            parents = task._parents_for(stage)
            self.record = CallRecord(self.call_id, "tool", self.name, parents, time.time())
            stage._add_call(self.record)
            attrs.update(
                {
                    "jitflow.app": task.app,
                    "jitflow.task_id": task.task_id,
                    "jitflow.stage": stage.name,
                    "jitflow.stage_index": stage.index,
                }
            )
        provider = task.client._tracer_provider if task is not None else None
        self._span = get_tracer(provider).start_span(
            f"execute_tool {self.name}", context=_parent_context(stage), kind=trace.SpanKind.INTERNAL,
            attributes=attrs,
        )
        self._token = otel_context.attach(trace.set_span_in_context(self._span))

    def finish(self, error: BaseException | None) -> None:
        """End the span and record the tool node with its duration and error (if any)."""
        end = time.time()
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            self._token = None
        if self._span is not None:
            if error is not None:
                mark_error(self._span, error)
            self._span.end()
        rec = self.record
        if rec is not None and self.task is not None and self.stage is not None:
            rec.end = end
            if error is not None:
                rec.error = f"{type(error).__name__}: {error}"[:500]
            self.task._post_event(
                {
                    "type": "tool",
                    "call_id": rec.call_id,
                    "name": self.name,
                    "stage": self.stage.name,
                    "stage_index": self.stage.index,
                    "parents": rec.parents,
                    "start": rec.start,
                    "end": end,
                    "error": rec.error,
                }
            )
            if self._implicit:
                self.task._close_stage(self.stage)
