"""Compound tasks on the server: ``/v1/tasks`` telemetry, pattern matching and sub-deadlines.

The SDK registers a task (``POST /v1/tasks``), reports stage boundaries and tool nodes
(``POST /v1/tasks/{id}/events``) and the outcome (``POST /v1/tasks/{id}/complete``); every
LLM call of the task carries ``{"jitflow": {"task_id", "stage", "stage_index", "call_id",
"parents"}}``. On each call the server:

1. extends the task's partial pattern graph with the call (its stage is *open*),
2. asks the :class:`~jitflow_server.analyzer.advisor.CompoundAdvisor` (the same object the
   benchmarks and the simulator use) for the stage's advice: the best historical pattern of the
   same app (JITServe §4.1), the sub-deadline ``T0 + φ(s)·D`` with the accumulated share φ(s) =
   t≤s / t_total of the matched graph (fallback: equal shares over the app's typical stage
   count), the task's estimated tokens and remaining generation time for GMAX's compound
   priority, and a length bound from the matched stage,
3. returns it as a typed :class:`CallAdvice`, which the API turns into the request's
   ``SchedHints``.

``T0`` is the server's clock when the task was registered (or when its first call arrived):
a client's ``start_time`` is another machine's clock, kept only as reported metadata.

On completion the finished graph (LLM and tool nodes with times, and the outcome) goes into
the history store; the observed lengths go to the length predictor's telemetry file.
``GET /v1/tasks/{id}`` shows stages, sub-deadlines, the matched pattern and the outcome.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from jitflow_server.analyzer.advisor import AppStats, CompoundAdvisor
from jitflow_server.analyzer.budget import DEFAULT_ANALYZER_BUDGET, DEFAULT_ANALYZER_QUEUE, BudgetedAdvisor
from jitflow_server.analyzer.subdeadline import (
    DEFAULT_TIME_MODEL,
    PINNED_TIME_MODEL,
    CallTimeModel,
    call_time_model_from_rate,
    time_model_from_env,
)
from jitflow_server.api.auth import request_tenant, tenants
from jitflow_server.api.schemas import APIError
from jitflow_server.api.task_bodies import (  # noqa: F401  (re-exported: the endpoints' bodies)
    ABANDONED_AFTER_S,
    MAX_TASK_CALLS,
    OUTCOMES,
    CallEvent,
    StageEvent,
    TaskComplete,
    TaskCreate,
    TaskEvents,
)
from jitflow_server.api.task_state import CallAdvice, TaskNode, TaskState, tenant_key
from jitflow_server.scheduler.admission import ServiceRate
from jitflow_server.scheduler.types import Kind, SLOSpec
from jitflow_server.settings import env_settings

logger = logging.getLogger("jitflow.tasks")



def _with_client_start(body: TaskCreate) -> dict[str, Any]:
    """The task's metadata plus the client's reported ``start_time`` (another clock: reported only)."""
    meta = dict(body.metadata)
    if body.start_time is not None:
        meta.setdefault("client_start_time", body.start_time)
    return meta


class TaskManager:
    """Keeps running tasks, the history store and the matcher; computes sub-deadlines per call.

    Args:
        db_path: SQLite history store (``None``: ``$JITFLOW_HISTORY_DB`` or the user cache).
        patterns: JSONL corpora to import as initial history (each graph keeps its ``app``).
        telemetry_path: JSONL file receiving one record per finished LLM call of a task
            (``app, stage, model, input_len, output_len``) for the length predictor.
        max_tasks: finished tasks kept in memory for ``GET /v1/tasks/{id}``.
        tenants: tenants besides the default one (``api/auth.py``); each gets its own copy of ``patterns``
            as initial history (its applications are ``tenant/app`` in the store).
        analyzer_budget, analyzer_queue: the pattern match's time budget (s) and queue
            (:class:`~jitflow_server.analyzer.budget.BudgetedAdvisor`, which :attr:`budgeted` is).
        time_model, time_model_source: the analyzer's call-time model to start with and where it comes
            from: ``"built-in"`` (replaced by the engine's measured speed as soon as the engine reports it,
            :meth:`follow_engine_speed`) or :data:`PINNED_TIME_MODEL` (given by the operator, kept).
    Raises ``ValueError`` for an invalid budget or queue, or an unknown ``time_model_source``.
    """

    def __init__(self, db_path: str | Path | None = None, patterns: list[Path] | None = None,
                 telemetry_path: Path | None = None, max_tasks: int = 10_000,
                 time_model: CallTimeModel = DEFAULT_TIME_MODEL, tenants: list[str] | None = None,
                 analyzer_budget: float = DEFAULT_ANALYZER_BUDGET,
                 analyzer_queue: int = DEFAULT_ANALYZER_QUEUE, time_model_source: str = "built-in") -> None:
        from jitflow_server.analyzer.matcher import Matcher
        from jitflow_server.store.history import HistoryStore, default_db_path

        if time_model_source not in ("built-in", PINNED_TIME_MODEL):
            raise ValueError(f"time_model_source must be 'built-in' or {PINNED_TIME_MODEL!r}, got {time_model_source!r}")

        self.db_path = Path(db_path) if db_path else default_db_path()
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self.store = HistoryStore(self.db_path)
        if patterns:
            self._import(patterns, tenants or [])
        self.matcher = Matcher(self.store)
        self.advisor = CompoundAdvisor("pattern", matcher_for=lambda app: self.matcher, time_model=time_model,
                                       stats=AppStats(typical_stages=self.store.typical_stages))
        self.budgeted = BudgetedAdvisor(self.advisor, analyzer_budget, analyzer_queue)
        #: where the advisor's call-time model comes from: "built-in", "measured" (the engine's speed,
        #: :meth:`follow_engine_speed`) or PINNED_TIME_MODEL
        self.time_model_source = time_model_source
        self.tasks: dict[str, TaskState] = {}
        self.max_tasks = max_tasks
        self.telemetry_path = telemetry_path

    def follow_engine_speed(self, rate: ServiceRate) -> None:
        """Plan sub-deadlines and the later stages' time with the engine's measured speed ``rate``
        (:func:`~jitflow_server.analyzer.subdeadline.call_time_model_from_rate`) from now on, unless the
        time model was pinned (``$JITFLOW_TIME_MODEL``) or ``rate`` does not say at which batch it was
        measured. The built-in model is one machine's figures (the demo model on a 2-core CPU); another
        engine can be several times faster or slower, which shifts the shares between LLM and tool stages
        and how long GMAX expects a task's remaining stages to take."""
        if self.time_model_source == PINNED_TIME_MODEL:
            return
        tm = call_time_model_from_rate(rate)
        if tm is not None:
            self.advisor.time_model = tm  # one attribute, read whole by the analyzer thread
            self.time_model_source = "measured"

    def time_model_view(self) -> dict[str, Any]:
        """The analyzer's call-time model for ``GET /v1/jitflow/engine``: seconds per decode and prefill
        token and ``source`` (``built-in``, ``measured`` or ``JITFLOW_TIME_MODEL``)."""
        tm = self.advisor.time_model
        return {"decode_s_per_token": tm.decode_s_per_token, "prefill_s_per_token": tm.prefill_s_per_token,
                "source": self.time_model_source}

    def _import(self, paths: list[Path], tenants: list[str]) -> None:
        import copy

        from jitflow_server.store.jsonl import read_jsonl

        n = 0
        for p in paths:
            graphs = list(read_jsonl(p))
            self.store.insert_many(graphs)
            for tenant in tenants:  # each tenant's own copy, under its own application names
                copies = []
                for g in graphs:
                    c = copy.copy(g)
                    c.app = tenant_key(tenant, g.app)
                    copies.append(c)
                self.store.insert_many(copies)
            n += len(graphs)
        logger.info("imported %d pattern graphs from %s (for %d tenants besides the default)", n,
                    [str(p) for p in paths], len(tenants))

    # ----------------------------------------------------------------- tasks
    def create(self, body: TaskCreate, tenant: str = "") -> TaskState:
        """Register a task of ``tenant`` (idempotent for the same id). Raises ``APIError(409)`` if it
        already ended."""
        key = tenant_key(tenant, body.task_id)
        t = self.tasks.get(key)
        if t is not None:
            if t.outcome is not None:
                raise APIError(409, f"task {body.task_id!r} has already completed", param="task_id",
                               type="conflict")
            if t.implicit:  # first call arrived before registration: adopt the declared deadline
                t.deadline, t.implicit = body.deadline, False
                t.app = tenant_key(tenant, body.app)
                t.metadata = _with_client_start(body)
            return t
        t = TaskState(body.task_id, tenant_key(tenant, body.app), body.deadline, time.time(),
                      _with_client_start(body), tenant=tenant)
        self.tasks[key] = t
        self._trim()
        return t

    def _trim(self) -> None:
        """Keep at most ``max_tasks`` tasks: drop finished tasks first, then open tasks whose deadline passed
        more than :data:`ABANDONED_AFTER_S` ago (a client that never completed them), oldest first. Open
        tasks still within their deadline are never dropped."""
        if len(self.tasks) <= self.max_tasks:
            return
        done = [k for k, v in self.tasks.items() if v.outcome is not None]
        for k in done[: len(self.tasks) - self.max_tasks]:
            del self.tasks[k]
        excess = len(self.tasks) - self.max_tasks
        if excess > 0:
            now = time.time()
            stale = [k for k, v in self.tasks.items() if v.t0 + v.deadline + ABANDONED_AFTER_S < now]
            for k in stale[:excess]:
                logger.info("task %s dropped: its deadline passed and it was never completed", k)
                del self.tasks[k]

    def get(self, task_id: str, tenant: str = "") -> TaskState:
        """The task of ``tenant``; raises ``APIError(404)`` (also for another tenant's task)."""
        t = self.tasks.get(tenant_key(tenant, task_id))
        if t is None:
            raise APIError(404, f"task {task_id!r} not found", param="task_id", type="not_found_error")
        return t

    def events(self, task_id: str, events: list[StageEvent | CallEvent], tenant: str = "") -> int:
        """Apply SDK events (stage_start/stage_end/tool/llm); returns how many were applied. A call may not
        name itself as a parent (``APIError(400)``, param ``events[i].parents``)."""
        t = self.get(task_id, tenant)
        for i, ev in enumerate(events):
            if isinstance(ev, CallEvent) and ev.call_id is not None and ev.call_id in ev.parents:
                raise APIError(400, f"events[{i}]: a call cannot be its own parent", param=f"events[{i}].parents")
        times = {cid: (n.start, n.end) for cid, n in t.nodes.items()}  # checked before anything is applied
        for i, ev in enumerate(events):
            if isinstance(ev, CallEvent) and ev.call_id is not None:
                start, end = times.get(ev.call_id, (None, None))
                start = ev.start if ev.start is not None else start
                end = ev.end if ev.end is not None else end
                if start is not None and end is not None and end < start:
                    raise APIError(400, f"events[{i}]: call {ev.call_id!r} would end ({end}) before it started "
                                   f"({start})", param=f"events[{i}].end")
                times[ev.call_id] = (start, end)
        new_calls = {ev.call_id for ev in events if isinstance(ev, CallEvent)} - set(t.nodes)
        if len(t.nodes) + len(new_calls) > MAX_TASK_CALLS:
            raise APIError(400, f"a task may record at most {MAX_TASK_CALLS} calls", param="events")
        for ev in events:
            s = ev.stage_index
            if ev.stage:
                t.stage_names.setdefault(s, ev.stage)
            if isinstance(ev, StageEvent):
                if ev.time is not None:
                    t.stage_times.setdefault(s, {})[ev.type] = ev.time
                continue
            cid = ev.call_id or f"{ev.type}-{len(t.nodes)}"
            node = t.nodes.get(cid) or TaskNode(cid, ev.type, ev.name or ev.model or ev.type, s, list(ev.parents))
            node.start = ev.start if ev.start is not None else node.start
            node.end = ev.end if ev.end is not None else node.end
            node.error = ev.error or node.error
            if ev.type == "llm":
                node.input_len = ev.input_tokens or node.input_len or 0
                if ev.output_tokens is not None:
                    node.output_len = ev.output_tokens
            else:
                node.output_len = 0
            t.nodes[cid] = node
        return len(events)

    def complete(self, task_id: str, body: TaskComplete, tenant: str = "") -> TaskState:
        """Record the outcome and store the finished pattern graph in the history store."""
        t = self.get(task_id, tenant)
        if t.outcome is not None:
            return t
        t.outcome = body.outcome
        t.error = body.error
        t.end_time = body.end_time or time.time()
        if t.outcome == "succeeded" and t.end_time > t.t0 + t.deadline:
            t.outcome = "deadline_missed"
        graph = self._graph(t, final=True)
        if graph is not None and graph.n_stages > 0:
            try:
                t.stored_graph_id = self.store.insert(graph)
            except (ValueError, OverflowError) as exc:  # a graph the binary form cannot hold: not history
                logger.warning("task %s not stored: %s", task_id, exc)
        self._write_telemetry(t)
        return t

    def close_implicit(self, now: float | None = None, idle_s: float = 10.0) -> int:
        """Complete the implicit tasks (calls that named a task nobody registered, e.g. a plain OpenAI
        client sending task headers) once their deadline has passed and no call ran for ``idle_s``
        seconds (or :data:`ABANDONED_AFTER_S` after the deadline, whatever runs): ``succeeded`` when every
        call ended without error by the deadline, ``deadline_missed`` when one ended after it, ``failed``
        otherwise. Their graphs go into the history like a completed task's (under ``jitflow.app``).
        Returns how many were completed. Unix s."""
        now = time.time() if now is None else now
        closed = 0
        for t in [t for t in list(self.tasks.values()) if t.implicit and t.outcome is None]:
            due = t.t0 + t.deadline
            nodes = list(t.nodes.values())
            running = any(n.end is None for n in nodes)
            last = max([n.end or n.start or t.t0 for n in nodes], default=t.t0)
            if now < due or (now < due + ABANDONED_AFTER_S and (running or now - last < idle_s)):
                continue
            failed = running or any(n.error for n in nodes)
            t.auto_closed = True
            self.complete(t.task_id, TaskComplete(outcome="failed" if failed else "succeeded",
                                                  end_time=min(last, now)), t.tenant)
            closed += 1
        return closed

    # --------------------------------------------------------------- matching
    def _graph(self, t: TaskState, final: bool = False):
        from jitflow_server.store.graph import CallNode, PatternFormatError, PatternGraph

        try:  # a node or graph the client's events make invalid (e.g. a dependency cycle): not a pattern
            calls = []
            for n in t.nodes.values():
                out = n.output_len
                if final and out is None:
                    out = 0
                calls.append(CallNode(n.call_id, n.kind, n.name, int(n.input_len), out,
                                      None if n.start is None else n.start - t.t0,
                                      None if n.end is None else n.end - t.t0, None,
                                      [p for p in n.parents if p in t.nodes], n.stage))
            if not calls:
                return None
            # Stage indices must be contiguous for a pattern graph: renumber in order.
            order = sorted({c.stage for c in calls})
            remap = {s: i for i, s in enumerate(order)}
            for c in calls:
                c.stage = remap[c.stage]
            names = [t.stage_names.get(s, "") for s in order]
            return PatternGraph.from_calls(t.app, calls, stage_names=names,
                                           outcome=t.outcome if final else None, task_id=t.task_id)
        except PatternFormatError as exc:
            logger.warning("task %s has no valid pattern graph: %s", t.task_id, exc)
            return None

    async def advise_call(self, ctx, model: str, rid: str, prompt_tokens: int, max_tokens: int,
                          timing, tenant: str = "") -> CallAdvice:
        """Extend the task's partial graph with an LLM call and return the advice for its stage.

        ``ctx`` is the request's ``jitflow`` task context, ``timing`` its ``RequestTiming`` (arrival, unix
        s; SLO with the waiting time). The pattern match runs within the analyzer's time budget
        (:attr:`budgeted`; past it, the fallback advice and ``CallAdvice.analyzer`` says why). Raises
        ``APIError(400)`` for a call of an unregistered task without ``slo.deadline`` and ``APIError(409)``
        for a call of a completed task.
        """
        now = timing.arrival
        key = tenant_key(tenant, ctx.task_id)
        t = self.tasks.get(key)
        if t is None or t.auto_closed:
            # first call before (or without) registration: an implicit task (one that the server closed
            # after its deadline, see close_implicit, starts again)
            d = timing.slo.deadline
            if d is None:
                raise APIError(400, f"task {ctx.task_id!r} is not registered and the call has no slo.deadline",
                               param="jitflow.task_id")
            t = TaskState(ctx.task_id, tenant_key(tenant, ctx.app or "unknown"), d, now, implicit=True, tenant=tenant)
            self.tasks[key] = t
            self._trim()
        if t.outcome is not None:
            raise APIError(409, f"task {ctx.task_id!r} has already completed", param="jitflow.task_id",
                           type="conflict")
        s = int(ctx.stage_index)
        if ctx.stage:
            t.stage_names.setdefault(s, ctx.stage)
        cid = ctx.call_id or rid
        t.nodes[cid] = TaskNode(cid, "llm", model, s, list(ctx.parents), prompt_tokens, None, now, request_id=rid)
        stage_pos = sorted({n.stage for n in t.nodes.values()}).index(s)
        advice, analyzer = await self.budgeted.advise(t.app, self._graph(t), stage_pos, t.t0, t.deadline)
        t.sub_deadlines[s] = advice.sub_deadline
        t.matched = advice.matched
        remaining = max(1e-3, t.t0 + t.deadline - now)
        slo = SLOSpec(Kind.COMPOUND, None, None, remaining, timing.slo.waiting_time)
        bound = None
        if advice.len_bound is not None:
            bound = min(max_tokens, self.advisor.stage_calibrator.apply(t.app, stage_pos, 0, advice.len_bound))
        return CallAdvice(slo=slo, app=t.app, task_id=t.task_id, stage_index=s, sub_deadline=advice.sub_deadline,
                          task_tokens_est=advice.task_tokens_est if advice.matched else None,
                          task_rem_gen_time=advice.task_rem_gen_time, len_bound=bound,
                          len_samples=advice.len_samples if bound is not None else None, stage_pos=stage_pos,
                          analyzer=analyzer)

    def on_call_end(self, ctx, rid: str, timing, ok: bool, tenant: str = "") -> None:
        """Record the finished call's lengths and times in the task's graph."""
        t = self.tasks.get(tenant_key(tenant, ctx.task_id))
        if t is None:
            return
        cid = ctx.call_id or rid
        n = t.nodes.get(cid)
        if n is None:
            return
        n.output_len = len(timing.token_times)
        n.end = timing.token_times[-1] if timing.token_times else time.time()
        if not ok:
            n.error = n.error or "aborted"

    def _write_telemetry(self, t: TaskState) -> None:
        if self.telemetry_path is None:
            return
        try:
            with open(self.telemetry_path, "a") as fh:
                for n in t.nodes.values():
                    if n.kind == "llm" and n.output_len is not None:
                        fh.write(json.dumps({"app": t.app, "stage": t.stage_names.get(n.stage), "model": n.name,
                                             "input_len": n.input_len, "output_len": n.output_len}) + "\n")
        except OSError as exc:
            logger.warning("telemetry write failed: %s", exc)

    async def close(self) -> None:
        """Stop the analyzer thread and close the history store."""
        self.budgeted.close()
        self.store.close()


async def attach_tasks(app: FastAPI, state) -> None:
    """Create the ``TaskManager`` (history DB from ``$JITFLOW_HISTORY_DB``, initial patterns from
    ``$JITFLOW_PATTERNS``, call telemetry to ``$JITFLOW_TELEMETRY``, sub-deadline time model from
    ``$JITFLOW_TIME_MODEL``) and attach it to ``state``."""
    env = env_settings()
    pinned = time_model_from_env()
    state.tasks = await asyncio.to_thread(TaskManager, None, env.pattern_files(), env.telemetry, 10_000,
                                          pinned or DEFAULT_TIME_MODEL, tenants(state.settings.api_keys),
                                          state.settings.analyzer_budget,
                                          time_model_source="built-in" if pinned is None else PINNED_TIME_MODEL)


def register_task_routes(app: FastAPI, state) -> None:
    """Add the ``/v1/tasks`` routes (they answer 503 until the ``TaskManager`` is attached)."""

    def mgr() -> TaskManager:
        if state.tasks is None:
            raise APIError(503, "task manager not ready", type="unavailable")
        return state.tasks

    @app.post("/v1/tasks", status_code=201)
    async def create_task(body: TaskCreate, request: Request):
        return mgr().create(body, request_tenant(request)).view()

    @app.post("/v1/tasks/{task_id}/events")
    async def task_events(task_id: str, body: TaskEvents, request: Request):
        return {"applied": mgr().events(task_id, body.events, request_tenant(request))}

    @app.post("/v1/tasks/{task_id}/complete")
    async def complete_task(task_id: str, body: TaskComplete, request: Request):
        m, tenant = mgr(), request_tenant(request)
        return await asyncio.to_thread(lambda: m.complete(task_id, body, tenant).view())

    @app.get("/v1/tasks/{task_id}")
    async def get_task(task_id: str, request: Request):
        return mgr().get(task_id, request_tenant(request)).view()
