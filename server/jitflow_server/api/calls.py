"""One in-flight LLM call of the HTTP API: the engine stream, admission control and clean-up.

A :class:`LiveCall` owns exactly one background task, the producer that moves the engine's
:class:`~jitflow_server.engine.protocol.TokenDelta` stream into a queue; :meth:`LiveCall.close` aborts
the engine request if it has not finished and cancels the producer, so nothing outlives the HTTP
request (client disconnects included).
"""

from __future__ import annotations

import asyncio
import logging
import time

from jitflow_server.api.schemas import APIError
from jitflow_server.api.state import ServerState
from jitflow_server.engine.protocol import GenerateRequest, TokenDelta
from jitflow_server.tracker.metrics import RequestTiming

logger = logging.getLogger("jitflow.api")

#: Queue events: ``("out", TokenDelta, t)``, ``("end", None, t)``, ``("error", exception, t)``.
Event = tuple[str, object, float]


class LiveCall:
    """One engine request in flight (times unix s, lengths tokens).

    ``len_bound`` is the bound the engine was given and ``bound_source`` where it came from (see
    ``analyzer.advisor.resolve_len_bound``); only predictor bounds are refined while the call runs.
    """

    def __init__(self, state: ServerState, request: GenerateRequest, timing: RequestTiming,
                 waiting_time: float | None, *, prompt_text: str, len_bound: int, bound_source: str) -> None:
        self.state = state
        self.request = request
        self.rid = request.request_id
        self.timing = timing
        self.waiting_time = waiting_time
        self.prompt_text = prompt_text
        self.len_bound = len_bound
        self.bound_source = bound_source
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False
        self.finish_reason: str | None = None
        self.text: list[str] = []
        self._task: asyncio.Task | None = None

    @property
    def bound_refinable(self) -> bool:
        """True when the predictor may refine this call's length bound."""
        return self.bound_source in ("predictor", "max_tokens")

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

        Raises ``APIError(429)`` (``admission_rejected``, with ``Retry-After``) when the engine had not
        scheduled the request by ``arrival + waiting_time`` and removed it.
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
                    raise APIError(
                        429, f"request was not admitted within its waiting_time of {self.waiting_time:g} s",
                        type="admission_rejected", param="slo.waiting_time", code="admission_rejected",
                        headers={"Retry-After": str(max(1, round(self.waiting_time or 1)))},
                    ) from None
                deadline = None  # admitted: wait without a limit

    def absorb(self, ev: Event) -> tuple[str, list[int]]:
        """Apply one queue event to the timing; returns ``(delta text, delta token ids)``.

        Raises ``APIError(500)`` (``engine_error``) for an engine failure event.
        """
        kind, out, t = ev
        if kind == "error":
            self.finished = True
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
        """Ask the length predictor for a refined bound every ``refine_every`` tokens (JITServe §4.1)."""
        svc = self.state.length
        n = len(self.timing.token_times)
        if (svc is None or not self.bound_refinable or finished
                or n // svc.refine_every <= before // svc.refine_every):
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
