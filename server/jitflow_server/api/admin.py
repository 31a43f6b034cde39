"""Operational routes: ``/health``, ``/v1/models``, ``/metrics`` and the ``/v1/jitflow/*`` engine routes
(scheduler stats, policy switch, pause/resume, diagnostics). See ``docs/api.md``."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from jitflow_server.api.schemas import APIError
from jitflow_server.api.state import ServerState
from jitflow_server.engine.protocol import PolicySpec
from jitflow_server.tracker.steps import STEP_FIELDS

logger = logging.getLogger("jitflow.api")


def register_admin_routes(app: FastAPI, state: ServerState) -> None:
    """Add the operational routes to ``app``."""
    eng = state.engine

    @app.get("/health")
    async def health():
        if not eng.alive:
            return JSONResponse({"status": "engine_dead"}, status_code=503)
        return {"status": "ok", "model": state.model_name}

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "jitflow",
                "max_model_len": eng.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {state.model_name!r}",
                           type="invalid_request_error", param="model", code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        try:
            st = await eng.stats()
            state.metrics.engine_waiting.set(st["waiting"])
            state.metrics.engine_running.set(st["running"])
        except Exception:
            logger.debug("stats call failed", exc_info=True)
        state.metrics.queue.set(state.waiting_first_token)
        state.metrics.in_flight.set(state.in_flight)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/jitflow/engine")
    async def engine_stats():
        """Scheduler and engine counters (policy, frames, unfinished requests)."""
        st = await eng.stats()
        st["frontend_unfinished"] = eng.num_unfinished_frontend()
        st["dtype"] = eng.dtype
        st.update(state.stats())
        return st

    @app.post("/v1/jitflow/engine/pause")
    async def engine_pause():
        """Stop scheduling without losing work: running requests keep their KV cache, new requests queue
        (admission control still rejects those whose ``waiting_time`` passes). For maintenance and for
        setting up reproducible scenarios; undo with ``/v1/jitflow/engine/resume``."""
        await eng.pause()
        return {"paused": await eng.is_paused()}

    @app.post("/v1/jitflow/engine/resume")
    async def engine_resume():
        """Resume scheduling after ``/v1/jitflow/engine/pause``."""
        await eng.resume()
        return {"paused": await eng.is_paused()}

    @app.get("/v1/jitflow/engine/events")
    async def engine_events():
        """Recent request lifecycle events (diagnostics), oldest first, each ``[unix s, event, request id,
        detail]``: ``engine`` from the scheduler plug-in (add, first_sched, preempt, finish, reject) and
        ``server`` from the HTTP layer (arrive, first_token, done, abort)."""
        return {"engine": await eng.events(), "server": [list(e) for e in state.events]}

    @app.get("/v1/jitflow/engine/steps")
    async def engine_steps(since: str = "0"):
        """The engine's step log (step-time model fits, simulator fidelity): steps after unix time
        ``since`` (s), oldest first, each ``[unix s, period s, forward s, n_decode, prefill tokens,
        context tokens of the decodes, cv of the batch's context lengths]``. ``period`` is the time since
        the previous step (null after the engine was idle); ``forward`` the model execution alone."""
        try:
            t = float(since)
        except ValueError:
            raise APIError(400, "since must be a number (unix seconds)", param="since") from None
        if not math.isfinite(t):
            raise APIError(400, "since must be finite", param="since")
        return {"fields": list(STEP_FIELDS), "steps": await eng.steps(t)}

    @app.get("/v1/jitflow/engine/plan")
    async def engine_plan():
        """The scheduler's last decision (diagnostics): the chosen batch, the preemptions and every
        request it ranked with its kind, state, priority and deadlines; ``{}`` before the first frame."""
        return await eng.plan()

    @app.post("/v1/jitflow/policy")
    async def set_policy(body: dict):
        """Switch the scheduling policy at run time: ``{"name": "gmax", "params": {...}, "batch_size": B}``.
        The ``oracle`` policy is refused: it needs true output lengths, which only the simulator has."""
        from jitflow_server.scheduler import POLICY_NAMES, make_policy

        name = body.get("name")
        if name not in (*POLICY_NAMES, "vllm"):
            raise APIError(400, f"name must be one of {list(POLICY_NAMES)}", param="name")
        params = body.get("params") or {}
        if not isinstance(params, dict):
            raise APIError(400, "params must be an object", param="params")
        b = body.get("batch_size")
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise APIError(400, "batch_size must be a positive integer", param="batch_size")
        if name not in ("fcfs", "vllm"):
            try:
                make_policy(name, **params)
            except (TypeError, ValueError) as exc:
                raise APIError(400, str(exc), param="params") from None
        try:
            return await eng.set_policy(PolicySpec(name, params, b))
        except Exception as exc:
            raise APIError(400, f"policy not applied: {exc}", param="params") from None
