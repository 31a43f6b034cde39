"""The life of one LLM request inside an engine, as one explicit state machine.

Both engine adapters (the vLLM plug-in and the simulator) keep a :class:`Lifecycle` per request and move
it only through :meth:`Lifecycle.to`, so the two tell the same story (what admission control, the
policies and the statistics read):

``WAITING`` → ``RUNNING`` (first scheduled: admitted) → ``PREEMPTED`` (KV freed, back in the queue) →
``RUNNING`` again → ``FINISHED`` (all tokens out) or ``ABORTED`` (cancelled, failed, cut off).
A request that admission control removes before it ever ran ends ``REJECTED`` (JITServe §5).
A running request that the policy leaves out of a frame's batch stays ``RUNNING``: it is *paused*
and keeps its KV cache.

Times are seconds on the adapter's one clock (``time.monotonic()`` in the plug-in, virtual time in
the simulator).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RequestState(str, Enum):
    """Where a request is in its life (see the module docstring)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"
    REJECTED = "rejected"


TERMINAL = frozenset({RequestState.FINISHED, RequestState.ABORTED, RequestState.REJECTED})

#: The allowed transitions: ``TRANSITIONS[a]`` holds every state ``a`` may move to.
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.WAITING: frozenset({RequestState.RUNNING, RequestState.ABORTED, RequestState.REJECTED}),
    RequestState.RUNNING: frozenset({RequestState.PREEMPTED, RequestState.FINISHED, RequestState.ABORTED}),
    RequestState.PREEMPTED: frozenset({RequestState.RUNNING, RequestState.ABORTED}),
    RequestState.FINISHED: frozenset(),
    RequestState.ABORTED: frozenset(),
    RequestState.REJECTED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A request was moved along a transition :data:`TRANSITIONS` does not allow (an adapter bug)."""


@dataclass(slots=True)
class Lifecycle:
    """State and milestones of one request (seconds on the adapter's clock).

    ``first_scheduled`` is when it was first admitted (``None`` while never scheduled: the only time
    admission control may reject it); ``preemptions`` counts ``RUNNING → PREEMPTED`` moves.
    """

    arrival: float
    state: RequestState = RequestState.WAITING
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    ended: float | None = None
    preemptions: int = 0

    @property
    def done(self) -> bool:
        """True in a terminal state."""
        return self.state in TERMINAL

    @property
    def ever_scheduled(self) -> bool:
        """True once the request has been admitted."""
        return self.first_scheduled is not None

    def admit_by(self, waiting_time: float | None) -> float | None:
        """The admission deadline ``arrival + waiting_time`` while never scheduled, else ``None``."""
        if waiting_time is None or self.first_scheduled is not None:
            return None
        return self.arrival + waiting_time

    def to(self, new: RequestState, now: float) -> None:
        """Move to ``new`` at time ``now``. Moving to the current state is a no-op.

        Raises :class:`IllegalTransition` for a transition :data:`TRANSITIONS` does not allow.
        """
        if new is self.state:
            return
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"request cannot go from {self.state.value} to {new.value}")
        if new is RequestState.RUNNING and self.first_scheduled is None:
            self.first_scheduled = now
        if new is RequestState.PREEMPTED:
            self.preemptions += 1
        if new in TERMINAL:
            self.ended = now
        self.state = new

    def tokens(self, now: float) -> None:
        """Record that the request emitted tokens at ``now``."""
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
