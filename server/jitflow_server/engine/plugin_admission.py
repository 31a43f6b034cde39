"""Admission control inside the engine, for requests whose hints ask for it (JITServe §5).

The embedded engine's front end asks the plug-in, at a request's admission deadline, whether it ever
scheduled the request (``EngineCall.REJECT_WAITING``). A router front end over remote replicas cannot:
it sees a replica only through the OpenAI API, where "no token yet" is all it knows, and a call that the
replica has scheduled and is prefilling also has no token. With ``jitflow serve --engine-admission`` the
router sets :attr:`~jitflow_server.scheduler.hints.SchedHints.engine_admission`, and the replica's
plug-in enforces the waiting time itself (not the default: docs/deployment.md has the measured
reason). At ``arrival + waiting_time`` (the engine's monotonic clock, hints mapped as in
``engine/plugin_state.py``) a request it never scheduled is removed, and the client is told with an
output that carries no token and the finish reason ``abort`` (vLLM's OpenAI server then ends the stream
with no token; ``engine/remote.py`` reads that as the replica's refusal).

The rule is the same as the embedded front end's (never scheduled by its admission deadline), checked at
the start of every engine step, so for every policy alike, the pass-through FCFS included.
"""

from __future__ import annotations

import heapq

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request


class EngineAdmission:
    """The admission deadlines the plug-in watches, and the refusals it still has to report.

    :meth:`watch` a request at arrival; :meth:`due` returns, once each, the ids whose deadline has
    passed (the plug-in removes those it never scheduled and passes them to :meth:`refused`);
    :meth:`report` adds one ``abort`` output per refusal to the step's outputs. Memory: one heap entry per
    watched request until its deadline, one pending output per refusal until the next step's outputs.
    """

    def __init__(self) -> None:
        self._due: list[tuple[float, str]] = []
        self._refused: list[Request] = []
        self.n_refused = 0

    def watch(self, req_id: str, admit_by: float) -> None:
        """Watch ``req_id`` until ``admit_by`` (monotonic s)."""
        heapq.heappush(self._due, (admit_by, req_id))

    def due(self, now: float) -> list[str]:
        """The watched ids whose admission deadline is at or before ``now`` (monotonic s), each once."""
        out = []
        while self._due and self._due[0][0] <= now:
            out.append(heapq.heappop(self._due)[1])
        return out

    def refused(self, request: Request) -> None:
        """``request`` was removed (never scheduled by its deadline): report it with the next outputs."""
        self._refused.append(request)
        self.n_refused += 1

    def report(self, outputs: dict[int, EngineCoreOutputs]) -> dict[int, EngineCoreOutputs]:
        """Add one output per pending refusal (no token, finish reason ``abort``) to ``outputs``, the
        dict of per-client outputs ``Scheduler.update_from_output`` returns; returns it."""
        for r in self._refused:
            eco = outputs.get(r.client_index)
            if eco is None:
                eco = outputs[r.client_index] = EngineCoreOutputs()
            eco.outputs = [*eco.outputs, EngineCoreOutput(request_id=r.request_id, new_token_ids=[],
                                                          finish_reason=FinishReason.ABORT,
                                                          trace_headers=r.trace_headers)]
        self._refused.clear()
        return outputs

    def pending(self) -> int:
        """Requests still watched (diagnostics)."""
        return len(self._due)
