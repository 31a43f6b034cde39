"""The state the task manager keeps per compound task (``api/tasks.py``): its calls and tool nodes, the
stages' sub-deadlines, and the advice it hands the API for each call.
Times are unix seconds on the server's clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jitflow_server.analyzer.stage_length import StageLengthSamples
from jitflow_server.scheduler.types import SLOSpec


@dataclass(frozen=True)
class CallAdvice:
    """What the task manager tells the API about one compound call (unix s, tokens).

    ``slo``: the call's SLO (kind compound, the time left until the task deadline); ``sub_deadline``:
    the stage's absolute sub-deadline; ``task_tokens_est``/``task_rem_gen_time``: task estimates of
    the matched graph (``None``/fallback without a match); ``len_bound``: the matched stages' length
    bound, calibrated and capped at ``max_tokens`` (``None`` without a match); ``len_samples``: what the
    bound is refined from while the call runs (``None`` without a match); ``stage_pos``: the stage's
    position among the task's stages (the key of the stage calibrator); ``analyzer``: ``"ok"``, or why
    the call got the fallback advice (``analyzer/budget.py``).
    """

    slo: SLOSpec
    app: str
    task_id: str
    stage_index: int
    sub_deadline: float
    task_tokens_est: int | None
    task_rem_gen_time: float
    len_bound: int | None
    len_samples: StageLengthSamples | None = None
    stage_pos: int = 0
    analyzer: str = "ok"


@dataclass
class TaskNode:
    """One node of a task's pattern graph: an LLM call (``kind="llm"``, token counts) or a tool call,
    in stage ``stage`` after ``parents`` (call ids); ``start``/``end`` unix s, ``end`` None while it runs."""

    call_id: str
    kind: str  # llm | tool
    name: str
    stage: int
    parents: list[str]
    input_len: int = 0
    output_len: int | None = None
    start: float | None = None
    end: float | None = None
    error: str | None = None
    request_id: str | None = None


def tenant_key(tenant: str, name: str) -> str:
    """The internal name of a task id or application name of ``tenant`` (``tenant/name``; unchanged for
    the default tenant ``""``). Tenant names cannot contain ``/`` (``api/auth.py``), so keys never collide."""
    return f"{tenant}/{name}" if tenant else name


@dataclass
class TaskState:
    """Server-side state of one compound task (times are unix seconds)."""

    task_id: str
    app: str
    deadline: float  # D, seconds
    t0: float
    metadata: dict[str, Any] = field(default_factory=dict)
    nodes: dict[str, TaskNode] = field(default_factory=dict)
    stage_names: dict[int, str] = field(default_factory=dict)
    sub_deadlines: dict[int, float] = field(default_factory=dict)
    stage_times: dict[int, dict[str, float]] = field(default_factory=dict)
    matched: dict[str, Any] | None = None
    outcome: str | None = None
    error: str | None = None
    end_time: float | None = None
    implicit: bool = False
    auto_closed: bool = False  # an implicit task the server completed (close_implicit)
    stored_graph_id: int | None = None
    tenant: str = ""

    @property
    def public_app(self) -> str:
        """The application name as the tenant sent it (``app`` is kept as ``tenant/app`` internally)."""
        return self.app[len(self.tenant) + 1:] if self.tenant and self.app.startswith(self.tenant + "/") else self.app

    def view(self) -> dict:
        """JSON view for ``GET /v1/tasks/{id}``."""
        stages = []
        by_stage: dict[int, list[TaskNode]] = {}
        for n in self.nodes.values():  # one pass: the view is linear in the task's calls
            by_stage.setdefault(n.stage, []).append(n)
        for s in sorted(set(self.stage_names) | set(by_stage) | set(self.sub_deadlines)):
            calls = [
                {"call_id": n.call_id, "kind": n.kind, "name": n.name, "parents": n.parents,
                 "input_tokens": n.input_len, "output_tokens": n.output_len, "start": n.start, "end": n.end,
                 "error": n.error, "request_id": n.request_id}
                for n in by_stage.get(s, [])
            ]
            ends = [c["end"] for c in calls if c["end"] is not None]
            stages.append({"index": s, "name": self.stage_names.get(s), "sub_deadline": self.sub_deadlines.get(s),
                           "end": max(ends) if ends else None, "calls": calls,
                           **self.stage_times.get(s, {})})
        return {"task_id": self.task_id, "app": self.public_app, "deadline": self.deadline, "start_time": self.t0,
                "absolute_deadline": self.t0 + self.deadline, "outcome": self.outcome, "error": self.error,
                "end_time": self.end_time, "metadata": self.metadata, "stages": stages, "matched": self.matched,
                "stored_graph_id": self.stored_graph_id, "implicit": self.implicit}
