"""What the simulator runs: jobs made of staged LLM calls (the benchmark workload builds them).

A :class:`Job` is one request (``latency``/``deadline``: one call) or one compound task (stages of
parallel calls with tool time between them), with its SLO and arrival time (s); a :class:`CallSpec`
one LLM call's input and output lengths (tokens). The true output length lives here, inside the
simulator's inputs, and never reaches a real engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CallSpec:
    """One LLM call: prompt and true output length (tokens)."""

    input_len: int
    output_len: int


@dataclass(slots=True)
class Job:
    """One request of the workload (a single call, or a compound task of sequential stages).

    ``arrival`` s from the workload start; ``stages[s]`` the parallel calls of stage s (one stage
    with one call for latency/deadline jobs); SLO fields in seconds (``deadline`` relative to
    arrival; for compound jobs the task deadline); ``tool_time`` s between consecutive stages.
    """

    job_id: str
    kind: str
    arrival: float
    app: str
    stages: list[list[CallSpec]]
    ttft: float | None = None
    tbt: float | None = None
    deadline: float | None = None
    tool_time: float = 0.0

    @property
    def n_calls(self) -> int:
        """Number of LLM calls."""
        return sum(len(s) for s in self.stages)

    @property
    def total_tokens(self) -> tuple[int, int]:
        """(input, output) tokens summed over the calls."""
        return (sum(c.input_len for s in self.stages for c in s), sum(c.output_len for s in self.stages for c in s))
