"""Non-blocking task telemetry: a bounded buffer drained by a background sender.

The agent only ever calls :meth:`TaskTelemetry.post` (never awaits the network). A sender task,
started in the compound task's own anyio task group, POSTs the buffered records in order, batching
consecutive events, retrying transient failures with exponential backoff. Records that cannot be
delivered (buffer full, retries exhausted, flush timeout at task exit) are dropped and counted in
:class:`TelemetryStats` (``client.telemetry``). Nothing outlives the task scope.
"""

from __future__ import annotations

import collections
import logging
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import httpx

if TYPE_CHECKING:  # pragma: no cover
    from ._client import AsyncClient

__all__ = ["TelemetryStats", "TelemetryWarning", "TaskTelemetry"]

logger = logging.getLogger("jitflow.telemetry")

MAX_EVENTS_PER_POST = 200


class TelemetryWarning(RuntimeWarning):
    """Emitted (once per task) when telemetry to the server fails; the agent keeps running."""


@dataclass
class TelemetryStats:
    """Client-wide telemetry counters (``client.telemetry``); all counts are records.

    A *record* is one event (``stage_start``/``stage_end``/``tool``/``llm``), one task
    registration or one task completion.

    Attributes:
        sent: records delivered (HTTP 2xx).
        dropped: records given up on: buffer overflow, retries exhausted, a 4xx answer, or still
            queued when the task-exit flush timed out.
        failed_attempts: HTTP attempts that failed (connection error, timeout or non-2xx).
        registration_failures: task registrations that did not succeed within the brief
            synchronous wait at task start (they are then retried in the background).
    """

    sent: int = 0
    dropped: int = 0
    failed_attempts: int = 0
    registration_failures: int = 0


@dataclass
class _Item:
    kind: str  # "register" | "event" | "complete"
    path: str
    body: dict[str, Any]


class TaskTelemetry:
    """Per-task telemetry buffer and sender.

    Args:
        client: the owning :class:`jitflow.AsyncClient` (its HTTP pool and ``telemetry`` stats).
        task_id: the compound task id (used in the endpoint paths).
        max_buffer: maximum queued records; further records are dropped and counted.
        retries: extra attempts per POST after the first (transient errors only).
        backoff: first retry delay in seconds (doubles per retry, capped at 1 s).
        attempt_timeout: per-attempt HTTP timeout in seconds.
    """

    def __init__(
        self,
        client: AsyncClient,
        task_id: str,
        *,
        max_buffer: int = 1024,
        retries: int = 3,
        backoff: float = 0.05,
        attempt_timeout: float = 5.0,
    ) -> None:
        self._client = client
        self.task_id = task_id
        self._max_buffer = max_buffer
        self._retries = retries
        self._backoff = backoff
        self._attempt_timeout = attempt_timeout
        self._queue: collections.deque[_Item] = collections.deque()
        self._lock = threading.Lock()
        self._wake: anyio.Event | None = None
        self._loop_thread: int | None = None
        self._inflight = 0
        self._closed = False
        self._server_down = False
        self._warned = False
        self._stopped = False
        self._scope: anyio.CancelScope | None = None

    @property
    def stats(self) -> TelemetryStats:
        """The owning client's counters."""
        return self._client.telemetry

    # ---------------------------------------------------------------- producer side (never blocks)
    def post_event(self, event: dict[str, Any]) -> bool:
        """Queue one event for ``POST /v1/tasks/{id}/events``; returns False if it was dropped."""
        return self._put(_Item("event", f"/v1/tasks/{self.task_id}/events", event))

    def post_register(self, body: dict[str, Any], *, front: bool = True) -> bool:
        """Queue a (retried) task registration for ``POST /v1/tasks``."""
        return self._put(_Item("register", "/v1/tasks", body), front=front)

    def post_complete(self, body: dict[str, Any]) -> bool:
        """Queue the task completion for ``POST /v1/tasks/{id}/complete``."""
        return self._put(_Item("complete", f"/v1/tasks/{self.task_id}/complete", body))

    def _put(self, item: _Item, *, front: bool = False) -> bool:
        with self._lock:
            if self._closed or len(self._queue) >= self._max_buffer:
                self.stats.dropped += 1
                return False
            if front:
                self._queue.appendleft(item)
            else:
                self._queue.append(item)
        # anyio events are not thread-safe: only wake from the event-loop thread; records posted
        # from worker threads are picked up by the sender's periodic poll.
        wake = self._wake
        if wake is not None and threading.get_ident() == self._loop_thread:
            wake.set()
        return True

    # ---------------------------------------------------------------- sender side
    async def run(self, *, poll_interval: float = 0.25) -> None:
        """Sender loop; runs until :meth:`stop`. Never raises.

        The loop runs in a shielded cancel scope so that a task body cancelled from outside (e.g.
        an enclosing ``anyio.move_on_after``) still gets its completion delivered during the
        bounded flush; the owning task scope always calls :meth:`stop` on exit.
        """
        if self._stopped:
            return
        self._loop_thread = threading.get_ident()
        with anyio.CancelScope(shield=True) as scope:
            self._scope = scope
            await self._loop(poll_interval)

    def stop(self) -> None:
        """Cancel the sender (idempotent; safe before it started)."""
        self._stopped = True
        if self._scope is not None:
            self._scope.cancel()

    async def _loop(self, poll_interval: float) -> None:
        while True:
            if not self._queue:
                self._wake = anyio.Event()
                with anyio.move_on_after(poll_interval):
                    await self._wake.wait()
                continue
            batch = self._take_batch()
            self._inflight = len(batch)
            try:
                await self._deliver(batch)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception:  # pragma: no cover - defensive: the sender must never crash the agent
                logger.exception("jitflow telemetry sender error")
                self.stats.dropped += len(batch)
            finally:
                self._inflight = 0

    def _take_batch(self) -> list[_Item]:
        with self._lock:
            first = self._queue.popleft()
            batch = [first]
            if first.kind == "event":
                while (
                    self._queue and self._queue[0].kind == "event" and len(batch) < MAX_EVENTS_PER_POST
                ):
                    batch.append(self._queue.popleft())
        return batch

    async def _deliver(self, batch: list[_Item]) -> None:
        first = batch[0]
        body = {"events": [it.body for it in batch]} if first.kind == "event" else first.body
        attempts = 1 if self._server_down else 1 + self._retries
        delay = self._backoff
        for attempt in range(attempts):
            outcome = await self._attempt(first.path, body)
            if outcome == "ok":
                self._server_down = False
                self.stats.sent += len(batch)
                return
            self.stats.failed_attempts += 1
            if outcome == "fatal":
                break
            if attempt + 1 < attempts:
                await anyio.sleep(delay)
                delay = min(1.0, delay * 2)
        else:
            self._server_down = True
        self.stats.dropped += len(batch)
        self._warn(f"telemetry for task {self.task_id} could not be delivered ({len(batch)} record(s) dropped)")

    async def _attempt(self, path: str, body: dict[str, Any]) -> str:
        """One POST; returns "ok", "retry" (transient) or "fatal" (4xx other than 408/429)."""
        try:
            r = await self._client._http.post(path, json=body, timeout=self._attempt_timeout)
        except (httpx.HTTPError, OSError) as e:
            logger.debug("telemetry POST %s failed: %r", path, e)
            return "retry"
        if r.status_code < 300:
            return "ok"
        logger.debug("telemetry POST %s -> HTTP %s", path, r.status_code)
        if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
            return "fatal"
        return "retry"

    async def drain(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the buffered records to be delivered, without
        closing the buffer (used at stage boundaries so the server sees a stage's tool nodes
        before the next stage's calls). Never raises; undelivered records stay queued."""
        with anyio.move_on_after(timeout):
            if self._wake is not None:
                self._wake.set()
            while self._queue or self._inflight:
                await anyio.sleep(0.002)

    async def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds, shielded from outer cancellation) until the buffer is
        delivered; then refuse new records and count whatever is left as dropped."""
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(timeout):
                if self._wake is not None:
                    self._wake.set()
                while self._queue or self._inflight:
                    await anyio.sleep(0.005)
        with self._lock:
            self._closed = True
            left = len(self._queue) + self._inflight
            self._queue.clear()
        if left:
            self.stats.dropped += left
            self._warn(f"telemetry flush for task {self.task_id} timed out ({left} record(s) dropped)")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(message, TelemetryWarning, stacklevel=2)
