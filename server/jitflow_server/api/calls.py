"""One in-flight LLM call of the HTTP API: the engine stream, admission control and clean-up.

A :class:`LiveCall` owns exactly one background task, the producer that moves the engine's
:class:`~jitflow_server.engine.protocol.TokenDelta` stream into a queue; :meth:`LiveCall.close` aborts
the engine request if it has not finished and cancels the producer, so nothing outlives the HTTP
request (client disconnects included).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from jitflow_server.analyzer.advisor import resolve_len_bound
from jitflow_server.analyzer.stage_length import StageLengthSamples
from jitflow_server.api.schemas import APIError
from jitflow_server.api.state import ServerState
from jitflow_server.engine.protocol import GenerateRequest, TokenDelta, UpstreamError
from jitflow_server.scheduler.admission import AdmissionDeadline
from jitflow_server.tracker.metrics import RequestTiming

logger = logging.getLogger("jitflow.api")

#: Queue events: ``("out", TokenDelta, t)``, ``("end", None, t)``, ``("error", exception, t)``.
Event = tuple[str, object, float]


def deadline_infeasible(deadline: float | None, service_time: float | None, reason: str | None = None) -> APIError:
    """The 429 of deadline admission (``scheduler/admission.py``): the deadline can no longer be met at the
    engine's measured speed (``too_late``), or not without breaking what was promised to the requests
    already admitted (``overcommitted``), or it waited past its latest feasible start (``not_started``)."""
    if reason == "overcommitted":
        why = ("the requests already admitted leave no room to finish this one by then (it needs about "
               f"{service_time:.1f} s at the engine's measured speed)")
    elif reason == "not_started":
        why = (f"the engine did not start it by its latest feasible start (it needs about {service_time:.1f} s "
               "at the engine's measured speed)")
    else:
        why = f"the engine needs about {service_time:.1f} s for this request at its measured speed and load"
    return APIError(429, f"deadline of {deadline:g} s cannot be met: {why}; retry later or with a longer "
                         "slo.deadline", type="admission_rejected", param="slo.deadline", code="deadline_infeasible",
                    headers={"Retry-After": str(max(1, math.ceil(service_time or 1)))})


class LiveCall:
    """One engine request in flight (times unix s, lengths tokens).

    ``len_bound`` is the bound the engine was given and ``bound_source`` where it came from (see
    ``analyzer.advisor.resolve_len_bound``). Predictor and ``max_tokens`` bounds are refined by the
    length service; a ``pattern`` bound of a compound call from its ``stage_samples`` (the matched
    graphs' past lengths of the stage at position ``stage_pos``, calibrated per app and stage), every
    ``refine_every`` generated tokens (JITServe §4.1).
    """

    def __init__(self, state: ServerState, request: GenerateRequest, timing: RequestTiming,
                 waiting_time: float | None, *, prompt_text: str, len_bound: int, bound_source: str,
                 app: str | None = None, stage_samples: StageLengthSamples | None = None,
                 stage_pos: int = 0, admission: AdmissionDeadline | None = None) -> None:
        self.state = state
        self.request = request
        self.rid = request.request_id
        self.timing = timing
        self.waiting_time = waiting_time
        self.admission = admission
        self.prompt_text = prompt_text
        self.len_bound = len_bound
        self.bound_source = bound_source
        self.app = app
        self.stage_samples = stage_samples
        self.stage_pos = stage_pos
        #: (generated tokens, bound) of every calibrated pattern bound issued, the first at 0 (calibrator input)
        self.stage_issued: list[tuple[int, int]] = [(0, len_bound)] if stage_samples is not None else []
        self._stage_bound: int | None = len_bound if stage_samples is not None else None
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False
        self.finish_reason: str | None = None
        self.text: list[str] = []
        self._task: asyncio.Task | None = None

    @property
    def bound_refinable(self) -> bool:
        """True when the predictor may refine this call's length bound."""
        return self.bound_source in ("predictor", "max_tokens")

    @property
    def stage_bound(self) -> int | None:
        """The latest pattern bound (tokens) of a compound call refined from its stage samples, else ``None``
        (``max_tokens`` once no history length of the stage exceeds the generated count)."""
        return self._stage_bound

    def clamp_bound(self, bound: int) -> int:
        """``bound`` within ``[1, max_tokens]``."""
        return max(1, min(int(bound), self.request.max_tokens))

    def start(self) -> None:
        """Submit the request to the engine (raises ``InvalidRequestError`` at once) and start the producer."""
        stream = self.state.engine.generate(self.request)
        self._task = asyncio.create_task(self._produce(stream), name=f"engine-stream-{self.rid}")

    async def _produce(self, stream) -> None:
        try:
            async for delta in stream:
                self.queue.put_nowait(("out", delta, time.time()))
            self.queue.put_nowait(("end", None, time.time()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # engine failure
            self.queue.put_nowait(("error", exc, time.time()))

    async def first(self) -> Event:
        """Wait for the first event, enforcing admission control (``waiting_time``, JITServe §5).

        Raises ``APIError(429)`` (``admission_rejected``, with ``Retry-After``: the waiting time, at most the
        server's default, since a compound call may have waited until its sub-deadline) when the engine had
        not scheduled the request by ``arrival + waiting_time`` and removed it.
        """
        deadline = self.timing.arrival + self.waiting_time if self.waiting_time else None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.time())
            try:
                return await asyncio.wait_for(self.queue.get(), timeout)
            except asyncio.TimeoutError:
                rejected = await self.state.engine.reject_waiting([self.rid])
                if self.rid in rejected:
                    await self.state.engine.abort(self.rid)
                    self.finished = True
                    adm = self.admission
                    if adm is not None and adm.binding == "deadline":
                        self.state.deadline_rejections += 1
                        raise deadline_infeasible(self.timing.slo.deadline, adm.service_time, "not_started") from None
                    raise APIError(
                        429, f"request was not admitted within its waiting_time of {self.waiting_time:g} s",
                        type="admission_rejected", param="slo.waiting_time", code="admission_rejected",
                        headers={"Retry-After": str(max(1, round(min(self.waiting_time or 1,
                                                                      self.state.settings.default_waiting_time))))},
                    ) from None
                deadline = None  # admitted: wait without a limit

    def absorb(self, ev: Event) -> tuple[str, list[int]]:
        """Apply one queue event to the timing; returns ``(delta text, delta token ids)``.

        Raises ``APIError(500)`` (``engine_error``) for an engine failure event.
        """
        kind, out, t = ev
        if kind == "error":
            self.finished = True
            if isinstance(out, UpstreamError):  # a replica behind the router: its own clear message
                logger.warning("replica failure on %s: %s", self.rid, out)
                headers = {"Retry-After": str(out.retry_after)} if out.retry_after else None
                raise APIError(out.status, str(out), type="upstream_error", code="replica_failed", headers=headers)
            logger.error("engine failure on %s: %s", self.rid, out)
            raise APIError(500, "the engine failed while serving this request", type="engine_error")
        if kind == "end":
            self.finished = True
            return "", []
        assert isinstance(out, TokenDelta)
        ids = list(out.token_ids)
        if ids:
            before = len(self.timing.token_times)
            self.timing.add_tokens(len(ids), t)
            self.text.append(out.text)
            self._maybe_refine(before, finished=out.finished)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason or "stop"
        return out.text, ids

    def _maybe_refine(self, before: int, *, finished: bool) -> None:
        """Refine the length bound every ``refine_every`` tokens (JITServe §4.1): a pattern bound from its stage
        samples (``StageLengthSamples.bound`` × the stage calibrator, through ``resolve_len_bound``), any
        other refinable bound by the length predictor."""
        svc = self.state.length
        n = len(self.timing.token_times)
        every = svc.refine_every if svc is not None else 50
        if finished or n // every <= before // every:
            return
        if self.stage_samples is not None and self.state.tasks is not None:
            raw = self.stage_samples.bound(n)
            cal = None if raw is None else self.state.tasks.advisor.stage_calibrator.apply(
                self.app, self.stage_pos, n, raw)
            # no history length above n: the stage samples say nothing more and the bound is max_tokens
            self._stage_bound, _ = resolve_len_bound(self.request.max_tokens, pattern=cal, generated=n)
            if cal is not None:
                self.stage_issued.append((n, self._stage_bound))
            self.state.bounds_changed()
            return
        if svc is None or not self.bound_refinable:
            return
        svc.submit(self.rid, self.prompt_text, model=self.state.model_name, max_tokens=self.request.max_tokens,
                   generated_text="".join(self.text), generated_tokens=n)
        self.state.bounds_changed()

    async def next(self) -> Event:
        """The next queue event."""
        return await self.queue.get()

    async def close(self) -> None:
        """Abort the engine request if it is still running and stop the producer (no leaks)."""
        if not self.finished:
            self.state.event(time.time(), "abort", self.rid, f"tokens={len(self.timing.token_times)}")
            try:
                await self.state.engine.abort(self.rid)
            except Exception:  # engine already gone
                logger.debug("abort of %s failed", self.rid, exc_info=True)
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
