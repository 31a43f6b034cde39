"""Plain data types shared by every scheduling policy (no vLLM import anywhere in ``scheduler/``).

The same policy objects decide inside the vLLM scheduler plug-in (``engine/``) and in the
simulator: both build a list of :class:`RequestView` snapshots plus one :class:`SchedContext`
per frame and apply the returned :class:`Decision`.

All times are seconds on one monotone clock shared by ``RequestView`` and ``SchedContext.now``;
all lengths are tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, runtime_checkable


class Kind(str, Enum):
    """SLO class of one LLM request (JITServe §3)."""

    LATENCY = "latency"  # TTFT + TBT timeline; goodput = on-time output tokens
    DEADLINE = "deadline"  # end-to-end deadline; goodput = input + output tokens if met
    COMPOUND = "compound"  # one call of a compound task (stage of a DAG) with a task deadline
    BEST_EFFORT = "best_effort"  # no SLO; gets a default completion deadline (JITServe §4.2)


@dataclass(frozen=True)
class SLOSpec:
    """The SLO of one request: the one server-side SLO type (seconds; ``None`` where the kind has none).

    ``kind`` is a :class:`Kind` (a string value is converted); ``deadline`` is relative to arrival;
    ``waiting_time`` is the admission deadline after arrival (JITServe §5). The API converts its
    ``slo`` request object into this, the simulator builds it from a workload, and goodput
    (``tracker.goodput.evaluate``) is judged on it. Raises ``ValueError`` for an unknown kind.
    """

    kind: Kind = Kind.BEST_EFFORT
    ttft: float | None = None
    tbt: float | None = None
    deadline: float | None = None
    waiting_time: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))


@dataclass(slots=True)
class RequestView:
    """Snapshot of one LLM request at ``SchedContext.now``.

    Lengths are tokens, times are seconds on the clock of ``SchedContext.now``.
    ``len_bound`` is the analyzer's upper bound on the TOTAL output length (JITServe §4.1);
    the remaining length is ``max(len_bound - generated, 1)``.
    For ``Kind.COMPOUND`` requests ``deadline`` is the task deadline and ``sub_deadline`` the
    stage's sub-deadline ``T0 + φ(s)·D`` from the analyzer; calls with the same
    ``(task_id, stage_index)`` form one *stage group* that shares a priority.
    ``task_rem_gen_time`` is the estimated time (s) of the task's stages after this one (each stage's
    recorded span in the matched history graph, or its longest chain of calls at the call-time model,
    summed over the stages); ``attained_service`` is the number of tokens the
    request's program/task has already received (engine-tracked, used by LAS).
    ``admit_by`` is the time by which a request that has never been scheduled must be admitted or
    the engine's admission control rejects it (``arrival + waiting_time``, JITServe §5); ``None``
    once it has been scheduled or when admission control is off. It is read only for waiting
    requests, every frame.
    ``true_len`` is only read by the ``oracle`` policy and only the simulator sets it (an engine never
    knows a true length; it is not part of :class:`~jitflow_server.scheduler.hints.SchedHints`). ``kv_tokens`` is read only when ``running``
    (a waiting request holds no KV; a paused one stays ``running``). Fields other than
    ``generated``, ``len_bound``, ``running``, ``kv_tokens``, ``admit_by``, ``sub_deadline``, ``task_tokens_est``,
    ``task_rem_gen_time`` and ``attained_service`` are read once per ``req_id`` and cached (call
    ``policy.invalidate(req_id)`` after changing one of them, e.g. a kind transition).
    """

    req_id: str
    kind: Kind
    arrival: float
    input_len: int
    generated: int
    len_bound: int
    running: bool
    kv_tokens: int = 0
    ttft: float | None = None
    tbt: float | None = None
    deadline: float | None = None
    sub_deadline: float | None = None
    task_id: str | None = None
    stage_index: int | None = None
    task_tokens_est: int | None = None
    task_rem_gen_time: float = 0.0
    attained_service: float = 0.0
    true_len: int | None = None
    max_tokens: int | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    admit_by: float | None = None


@dataclass(frozen=True, slots=True)
class TokenTimeModel:
    """Seconds per token of one request as a function of the number of requests decoding together:
    ``token_time(k) = max(base_s + per_request_s·k, floor_s)`` (wall time, from the SLO tracker's fit of
    measured steps, ``tracker/steps.py``). On a CPU the step time grows almost linearly with the batch
    (demo model, 2-core AVX-512: about 0.04 s alone and 0.18 s at k = 32), so the batch size trades
    throughput against every request's time between tokens."""

    base_s: float
    per_request_s: float
    floor_s: float = 0.0

    def token_time(self, k: int) -> float:
        """Seconds per token with ``k`` (≥ 1) requests decoding together."""
        return max(self.base_s + self.per_request_s * max(int(k), 1), self.floor_s, 1e-6)


@dataclass(slots=True)
class SchedContext:
    """Engine state a policy needs for one frame.

    ``batch_size`` is B (max requests per batch). ``token_time`` is the measured seconds per decode
    step per request at the current batch (``v_token``, from the SLO tracker); ``prefill_rate`` the
    measured prefill tokens per second; ``swap_rate`` the KV swap bandwidth in tokens/s (``None``:
    preemption recomputes, as vLLM v1 on CPU); ``kv_capacity_tokens`` the KV cache size in tokens
    (``None``: unknown, the engine manages memory); ``max_running`` the number of requests the engine
    can hold running at once, paused ones included (vLLM's ``max_num_seqs``; ``None``: unlimited);
    ``prefix_caching`` whether the engine keeps freed KV blocks in a prefix cache (vLLM's automatic
    prefix caching, on by default in v1): a request preempted by recompute then gets its prefix back
    unless other allocations evicted it, so its recompute stall is only a risk. ``kv_block_size`` is
    the KV block in tokens (``None``: unknown): a prefix-cache hit covers only whole blocks within
    the first ``n − 1`` tokens, so the tail of a displaced request is recomputed in any case.
    ``token_time_model`` (``None``: unknown) gives the token time at any batch size, for policies
    that choose how many requests to run (GMAX's ``batch_sizing``).
    """

    now: float
    batch_size: int
    token_time: float
    prefill_rate: float
    swap_rate: float | None = None
    kv_capacity_tokens: int | None = None
    replica: int = 0
    max_running: int | None = None
    prefix_caching: bool = False
    kv_block_size: int | None = None
    token_time_model: TokenTimeModel | None = None

    def resized(self, batch_size: int, token_time: float) -> SchedContext:
        """This context with another batch size (requests) and token time (s per token): what
        ``dataclasses.replace`` gives, at a fifth of its cost (GMAX sizes its batch by scoring several
        sizes every frame)."""
        return SchedContext(self.now, batch_size, token_time, self.prefill_rate, self.swap_rate,
                            self.kv_capacity_tokens, self.replica, self.max_running, self.prefix_caching,
                            self.kv_block_size, self.token_time_model)


@dataclass(slots=True)
class Decision:
    """Output of one scheduling frame.

    ``batch``: req_ids to run this frame in the order the engine should run/admit them
    (``len(batch) <= batch_size``). ``preempt``: running req_ids whose KV must be freed
    (never in ``batch``). Running requests in neither list are *paused* (keep KV, not run this
    frame); waiting requests in ``batch`` are admitted. ``priorities`` maps every req_id the policy
    scored to its priority (for logging/inspection; larger = more urgent for every policy).
    ``reject``: waiting req_ids that were never scheduled and that the policy's own admission
    control refuses (SLOs-Serve's and QLM's admission; never in ``batch``): the engine ends them
    ``REJECTED`` as it does for the shared ``waiting_time`` admission (JITServe §5). Ids that are
    running or were scheduled before are ignored.
    """

    batch: list[str]
    preempt: list[str]
    priorities: dict[str, float]
    frame_id: int = 0
    info: dict = field(default_factory=dict)
    reject: list[str] = field(default_factory=list)


@runtime_checkable
class Policy(Protocol):
    """Interface every scheduling policy implements (GMAX and the baselines).

    Optional: ``reads_attained_service`` (bool, default True when absent) tells an engine whether the
    policy reads :attr:`RequestView.attained_service`; the simulator skips updating it when False.
    ``paces_prefill`` (bool, default False when absent) asks the engine to cap every step's prefill
    tokens by the slack of its decoding latency requests (:mod:`~jitflow_server.scheduler.prefill_budget`);
    ``prefill_ttft_share`` (float, default 0 when absent) then caps every paced step at that share of the
    smallest TTFT SLO seen.
    """

    name: str

    def schedule(self, views: Sequence[RequestView], ctx: SchedContext) -> Decision:
        """Choose the batch (≤ ``ctx.batch_size`` ids) and the preemptions for one frame."""
        ...

    def on_finished(self, req_id: str, goodput: float, now: float) -> None:
        """Feed back the measured goodput (tokens) of a finished request (drives cutoff-p adaptation)."""
        ...

    def needs_recompute(self, step: int, arrivals_or_finishes: bool) -> bool:
        """True when a new frame must be computed (every Δ decode steps, or on arrivals/finishes)."""
        ...
