"""Server-wide state of the HTTP API: settings, the engine, metrics and the in-flight calls.

Times are unix seconds on the API's clock (what responses report); the engine gets relative times in
each request's :class:`~jitflow_server.scheduler.hints.SchedHints`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jitflow_server.analyzer.budget import DEFAULT_ANALYZER_BUDGET
from jitflow_server.api.auth import APIKey
from jitflow_server.api.limits import DEFAULT_MAX_BODY_BYTES
from jitflow_server.engine.protocol import Engine
from jitflow_server.scheduler.admission import (
    DEFAULT_WAITING_TIME_S,
    Commitment,
    ServiceRate,
    check_compound_waiting,
)
from jitflow_server.scheduler.hints import HintUpdate
from jitflow_server.scheduler.types import Kind
from jitflow_server.tracker.metrics import ServerMetrics

if TYPE_CHECKING:
    from jitflow_server.analyzer.length_service import LengthService
    from jitflow_server.api.calls import LiveCall
    from jitflow_server.api.tasks import TaskManager

logger = logging.getLogger("jitflow.api")


@dataclass
class ServerSettings:
    """Server-level defaults.

    ``default_waiting_time``: admission control for requests with an SLO that give no ``waiting_time``
    (s, JITServe §5); ``best_effort_waiting_time``: the same for best-effort requests (``None``: never
    rejected); ``default_max_tokens``: output cap when a request gives none (tokens);
    ``length_predictor``: run the output-length predictor (QRF, JITServe §4.1); ``bound_push_period``:
    the longest a refined length bound waits before it is sent to the engine (s; it is sent at once
    when the predictor publishes it); ``max_body_bytes``: the largest request body (bytes; larger ones
    get 413 before they are parsed, ``api/limits.py``); ``api_keys``: the accepted keys with their
    tenants and scopes (empty: no authentication, ``api/auth.py``); ``deadline_admission``: hold
    E2EL-deadline requests to their latest feasible start (``scheduler/admission.py``), with the service
    time estimate multiplied by ``admission_safety``; ``service_poll_period``: how often the engine's
    measured speed is read for it and for the analyzer's call-time model (s); ``analyzer_budget``: the
    longest a compound call waits for its pattern match (s, ``analyzer/budget.py``);
    ``compound_waiting``: ``"waiting_time"`` holds a compound call to its waiting time, ``"sub_deadline"``
    lets it wait for its start until its stage's sub-deadline when that is later
    (``scheduler/admission.py``, :func:`~jitflow_server.scheduler.admission.compound_waiting_time`).
    """

    default_waiting_time: float = DEFAULT_WAITING_TIME_S
    default_max_tokens: int = 256
    best_effort_waiting_time: float | None = None
    length_predictor: bool = True
    bound_push_period: float = 0.1
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_keys: dict[str, APIKey] = field(default_factory=dict)
    deadline_admission: bool = True
    admission_safety: float = 1.0
    service_poll_period: float = 0.5
    analyzer_budget: float = DEFAULT_ANALYZER_BUDGET
    compound_waiting: str = "waiting_time"

    def __post_init__(self) -> None:
        check_compound_waiting(self.compound_waiting)


class ServerState:
    """Everything a request handler needs: the engine, metrics, settings, the task manager and the
    length service (both attached by the app's lifespan), and the in-flight calls."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics()
        self.waiting_first_token = 0
        self.in_flight = 0
        self.tasks: TaskManager | None = None
        self.length: LengthService | None = None
        self.live: dict[str, LiveCall] = {}
        self._pushed: dict[str, int] = {}
        #: Recent request lifecycle events seen by the HTTP server ``(unix s, event, request id, detail)``:
        #: arrive / first_token / done / abort (diagnostics, bounded; ``GET /v1/jitflow/engine/events``).
        self.events: deque[tuple[float, str, str, str]] = deque(maxlen=256)
        self._bounds_ready = asyncio.Event()
        #: The engine's measured speed (deadline admission), refreshed by :meth:`poll_service`.
        self.service: ServiceRate | None = None
        #: Requests refused or removed by deadline admission (``scheduler/admission.py``).
        self.deadline_rejections = 0

    def attach_length_service(self, svc: LengthService) -> None:
        """Use ``svc`` for length bounds and wake the bound pusher whenever it publishes new ones."""
        loop = asyncio.get_running_loop()
        self.length = svc
        svc.on_published = lambda: loop.call_soon_threadsafe(self._bounds_ready.set)

    def bounds_changed(self) -> None:
        """Wake the bound pusher (a bound may have changed on this thread, e.g. the fallback's)."""
        self._bounds_ready.set()

    @property
    def model_name(self) -> str:
        """The model id clients must name."""
        return self.engine.served_name

    def forget(self, request_id: str) -> None:
        """Drop a finished request from the in-flight table."""
        self.live.pop(request_id, None)
        self._pushed.pop(request_id, None)

    def refined_bounds(self) -> dict[str, int]:
        """Length bounds of in-flight calls refined since they were last pushed: by the predictor, or from
        a compound call's stage samples."""
        upd: dict[str, int] = {}
        for rid, call in list(self.live.items()):
            sb = call.stage_bound
            if sb is not None:
                if self._pushed.get(rid, call.len_bound) != sb:
                    upd[rid] = sb
                continue
            if self.length is None or not call.bound_refinable:
                continue
            b = self.length.latest(rid)
            if b is not None:
                b = call.clamp_bound(b)
                if self._pushed.get(rid, call.len_bound) != b:
                    upd[rid] = b
        return upd

    async def push_bounds(self) -> None:
        """Background task (owned by the app's lifespan): send refined length bounds to the scheduler.

        The length predictor runs off the scheduling path (JITServe §4.1); the scheduler uses the latest
        bound it was given and never waits for a prediction.
        """
        while True:
            try:
                await asyncio.wait_for(self._bounds_ready.wait(), self.settings.bound_push_period)
            except asyncio.TimeoutError:
                pass
            self._bounds_ready.clear()
            upd = self.refined_bounds()
            if not upd:
                continue
            try:
                await self.engine.update_hints(HintUpdate(len_bound=upd))
                self._pushed.update(upd)
            except Exception:
                logger.debug("bound push failed", exc_info=True)

    async def poll_service(self) -> None:
        """Background task (owned by the app's lifespan): keep :attr:`service` current from the engine's
        stats every ``service_poll_period`` s, for deadline admission and for the analyzer's call-time
        model (:meth:`~jitflow_server.api.tasks.TaskManager.follow_engine_speed`). An engine that reports
        no step model (stock vLLM, a fake stepped by hand, a plug-in before its first 8 steps) leaves it
        ``None``: no deadline admission, and the analyzer keeps its time model."""
        while True:
            try:
                self.service = ServiceRate.from_dict((await self.engine.stats()).get("service"))
                if self.service is not None and self.tasks is not None:
                    self.tasks.follow_engine_speed(self.service)
            except Exception:
                logger.debug("engine stats failed", exc_info=True)
            await asyncio.sleep(self.settings.service_poll_period)

    def commitments(self, rate: ServiceRate) -> list[Commitment]:
        """The work promised to the in-flight calls that have a finish time (``scheduler/admission.py``):
        deadline requests by their deadline, latency requests by their last token's time, compound calls by
        their sub-deadline; best-effort calls promise nothing. Unix s, slot-seconds at ``rate``."""
        step = rate.step_time(rate.batch_size)
        out = []
        for rid, call in list(self.live.items()):
            t = call.timing
            slo = t.slo
            generated = len(t.token_times)
            bound = self._pushed.get(rid, call.len_bound)
            if slo.kind is Kind.DEADLINE and slo.deadline is not None:
                due = t.arrival + slo.deadline
            elif slo.kind is Kind.LATENCY and slo.ttft is not None and slo.tbt is not None:
                due = t.arrival + slo.ttft + max(bound - 1, 0) * slo.tbt
            elif slo.kind is Kind.COMPOUND and (t.sub_deadline is not None or slo.deadline is not None):
                due = t.sub_deadline if t.sub_deadline is not None else t.arrival + slo.deadline
            else:
                continue
            work = max(bound - generated, 1) * step
            if generated == 0:
                work += rate.per_prefill_token_s * t.prompt_tokens
            out.append(Commitment(due, work))
        return out

    def event(self, t: float, kind: str, request_id: str, detail: str = "") -> None:
        """Record one server-side lifecycle event (diagnostics)."""
        self.events.append((t, kind, request_id, detail))

    def stats(self) -> dict[str, Any]:
        """Server-side counters merged into ``GET /v1/jitflow/engine``."""
        out: dict[str, Any] = {"server_in_flight": self.in_flight,
                               "deadline_admission": {"enabled": self.settings.deadline_admission,
                                                      "rate": self.service.to_dict() if self.service else None,
                                                      "rejected": self.deadline_rejections}}
        if self.length is not None:
            pred = self.length.predictor
            out["length_predictor"] = {"model": pred is not None, "version": getattr(pred, "version", None),
                                       **self.length.stats}
        if self.tasks is not None:
            b = self.tasks.budgeted
            out["analyzer"] = {"budget_s": b.budget, "pending": b.pending, **b.stats,
                               "time_model": self.tasks.time_model_view()}
        return out
