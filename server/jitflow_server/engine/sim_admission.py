"""Admission control and clients that give up, as methods of :class:`~jitflow_server.engine.sim_run.SimRun`.

A call never scheduled within its waiting time is rejected (JITServe §5; with ``compound_waiting=
"sub_deadline"`` a compound call's waiting time can run to its stage's sub-deadline,
:func:`~jitflow_server.scheduler.admission.compound_waiting_time`),
and the client of a deadline request or a compound task stops waiting ``give_up_after`` s past its
deadline. Both are heaps of (time, seq, call) read lazily: an entry whose call was scheduled or ended
since is dropped when it reaches the top, so each check is O(log n) per call.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

from jitflow_server.scheduler.lifecycle import RequestState

if TYPE_CHECKING:
    from jitflow_server.engine.sim import _Call


class AdmissionClocks:
    """Admission deadlines and give-up times of a run (``SimRun`` sets every attribute below)."""

    t: float
    unsched: dict[str, _Call]  # calls never scheduled
    admit_heap: list[tuple[float, int, _Call]]  # (arrival + waiting time, seq, call)
    give_up_heap: list[tuple[float, int, _Call]]  # (time its client gives up, seq, call)
    abandoned: int  # calls aborted because their client gave up

    def finish_call(self, c: _Call, now: float, ok: bool, end: RequestState | None = None) -> None:
        """End a call (``SimRun.finish_call``)."""
        raise NotImplementedError

    def expire_unadmitted(self) -> None:
        """Admission control (JITServe §5): reject calls never scheduled within their waiting time."""
        heap = self.admit_heap
        while heap and heap[0][0] < self.t:
            c = heapq.heappop(heap)[2]
            if self.unsched.get(c.rid) is c:
                self.finish_call(c, self.t, False, RequestState.REJECTED)

    def next_admit_deadline(self) -> float:
        """The earliest admission deadline of a call still never scheduled (inf: none)."""
        heap = self.admit_heap
        while heap and self.unsched.get(heap[0][2].rid) is not heap[0][2]:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def abandon(self) -> None:
        """Abort the calls whose client gave up (``give_up_after`` s past the deadline; a compound call's
        task fails with it). Checked once per (macro-)step, so a call may end up to one macro-step late."""
        heap = self.give_up_heap
        while heap and heap[0][0] < self.t:
            c = heapq.heappop(heap)[2]
            if not c.life.done:
                self.abandoned += 1
                self.finish_call(c, self.t, False)
