"""What the simulator runs: jobs made of staged LLM calls (the benchmark workload builds them).

A :class:`Job` is one request (``latency``/``deadline``: one call) or one compound task (stages of
parallel calls with tool time between them), with its SLO and arrival time (s); a :class:`CallSpec`
one LLM call's input and output lengths (tokens), and optionally the ids of its prompt's
:data:`PREFIX_BLOCK_TOKENS`-token blocks (``prefix_ids``, from a trace's ``hash_ids``), which drive the
simulator's cross-request prefix cache. The true output length lives here, inside the simulator's
inputs, and never reaches a real engine.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Tokens per prefix block named by :attr:`CallSpec.prefix_ids` (the Mooncake trace's ``hash_ids`` block size).
PREFIX_BLOCK_TOKENS = 512

#: Seconds after its deadline that the client of a deadline request or compound task gives up and cancels it
#: (the demo's clients and the simulator's, the same rule for every policy): by then the SLO is missed whatever
#: happens, and a real client stops waiting. Without it a policy that starves admitted calls keeps them to the
#: end of a run (Tempo held about 240 such calls per frame at 5 000 requests on ``a100-llama8b`` at 2.6 req/s).
GIVE_UP_AFTER_S = 5.0


@dataclass(slots=True)
class CallSpec:
    """One LLM call: prompt and true output length (tokens).

    ``prefix_ids``: ids of the prompt's consecutive :data:`PREFIX_BLOCK_TOKENS`-token blocks (the last one
    may be partial); calls whose ids agree on a leading run share that prefix (tokens), so the
    simulator's prefix cache can skip its prefill. ``None``: no sharing information (no cross-request hits).
    """

    input_len: int
    output_len: int
    prefix_ids: tuple[int, ...] | None = None


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
