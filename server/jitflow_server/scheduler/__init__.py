"""jitflow_server.scheduler: the pure policy core (GMAX and baselines). Imports nothing from vLLM.

The same objects decide in the vLLM scheduler plug-in and in the simulator::

    from jitflow_server.scheduler import make_policy, RequestView, SchedContext, Kind
    policy = make_policy("gmax", delta_steps=50, p=0.95)
    if policy.needs_recompute(step, arrivals_or_finishes):
        decision = policy.schedule(views, ctx)   # decision.batch, decision.preempt

See ``docs/scheduling.md`` for the algorithm and parameters.
"""

from __future__ import annotations

from typing import Any

from jitflow_server.scheduler.adapt import CutoffAdapter
from jitflow_server.scheduler.baselines import (
    EDFPolicy,
    FCFSPolicy,
    LASPolicy,
    OrderPolicy,
    SarathiPolicy,
    SJFPolicy,
)
from jitflow_server.scheduler.gmax import GMAXPolicy, select_window
from jitflow_server.scheduler.gmax_estimates import estimate, on_time_tokens
from jitflow_server.scheduler.gmax_params import GMAXParams
from jitflow_server.scheduler.peer_common import PeerPolicy
from jitflow_server.scheduler.qlm import QLMPolicy
from jitflow_server.scheduler.replicas import best_replica, dummy_copies
from jitflow_server.scheduler.slos_serve import SLOsServePolicy
from jitflow_server.scheduler.snapshot import SchedulingInputError
from jitflow_server.scheduler.tempo import TempoPolicy
from jitflow_server.scheduler.types import Decision, Kind, Policy, RequestView, SchedContext, TokenTimeModel
from jitflow_server.scheduler.vllm_priority import VLLMPriorityPolicy

POLICY_NAMES = ("gmax", "gmax-paper", "fcfs", "sarathi", "edf", "sjf", "las", "oracle", "vllm-priority", "tempo",
                "qlm", "slos-serve")

_BASELINES: dict[str, type[OrderPolicy]] = {
    "fcfs": FCFSPolicy,
    "sarathi": SarathiPolicy,
    "edf": EDFPolicy,
    "sjf": SJFPolicy,
    "las": LASPolicy,
}

_PEERS: dict[str, type[PeerPolicy]] = {
    "vllm-priority": VLLMPriorityPolicy,
    "tempo": TempoPolicy,
    "qlm": QLMPolicy,
    "slos-serve": SLOsServePolicy,
}


def make_policy(name: str, **params: Any) -> Policy:
    """Build a policy by name: ``gmax`` (JIT-ranked GMAX, the default: docs/scheduling.md), ``gmax-paper``
    (the paper's ``goodput/t_gen`` ranking, window, stall pricing and token-only objective, JITServe §4.2:
    ``jit=False, free_pause=True, stall_value="tokens", window="paper", overrun=0, request_weight=0,
    compound_value="task", future_margin=1, batch_sizing="full", bound_share=1, deadline_soft_share=0,
    prefill_budget="fixed", kv_fit=False``),
    ``oracle`` (``gmax`` with ``true_len``), ``fcfs``, ``sarathi``, ``edf``, ``sjf``, ``las``, and the
    peer baselines ``vllm-priority`` (vLLM's priority scheduling with SLO-derived priorities),
    ``tempo`` (Tempo's service-density scheduling), ``qlm`` (QLM's request groups and virtual queue) and
    ``slos-serve`` (SLOs-Serve's dynamic-programming admission and soft admission control).

    ``params`` are :class:`GMAXParams` fields for the GMAX family, and ``best_effort_deadline``,
    ``delta_steps``, ``default_ttft``, ``default_tbt``, ``full_priorities`` for the baselines (``las``
    also takes ``quantum``, ``levels``, ``ratio``, ``starvation_ratio``, ``mlfq``: see :class:`LASPolicy`;
    each peer baseline its own, listed in its class's ``PARAMS``: :class:`VLLMPriorityPolicy`,
    :class:`TempoPolicy`, :class:`QLMPolicy`, :class:`SLOsServePolicy`).
    Raises ``ValueError`` naming the valid names/parameters for an unknown name or parameter, or
    for an invalid value.
    """
    key = name.strip().lower()
    if key in ("gmax", "gmax-paper", "oracle"):
        if key == "gmax-paper":
            params.setdefault("jit", False)
            params.setdefault("free_pause", True)
            params.setdefault("stall_value", "tokens")
            params.setdefault("window", "paper")
            params.setdefault("overrun", 0.0)
            params.setdefault("request_weight", 0.0)  # the paper's token-only objective
            params.setdefault("compound_value", "task")  # a stage unlocks its whole task (§4.2)
            params.setdefault("future_margin", 1.0)  # the analyzer's estimate of the later stages as is
            params.setdefault("batch_sizing", "full")  # Alg. 1 fills B
            params.setdefault("bound_share", 1.0)  # plans with the length upper bound (§4.1)
            params.setdefault("deadline_soft_share", 0.0)  # feasible by the bound or not at all
            params.setdefault("prefill_budget", "fixed")  # vLLM's chunked prefill as is
            params.setdefault("kv_fit", False)  # the engine alone checks the KV cache, one chunk at a time
        if key == "oracle":
            params.setdefault("use_true_len", True)
        return GMAXPolicy(name=key, **params)
    peer = _PEERS.get(key)
    if peer is not None:
        try:
            return peer(**params)
        except TypeError as exc:
            raise ValueError(
                f"invalid parameter for policy {key!r} ({exc}); valid: {', '.join(peer.PARAMS)}") from None
    cls = _BASELINES.get(key)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(
            f"invalid parameter for policy {key!r} ({exc}); valid: best_effort_deadline, delta_steps, "
            "default_ttft, default_tbt, full_priorities"
            + (", quantum, levels, ratio, starvation_ratio, mlfq" if key == "las" else "")
        ) from None


__all__ = [
    "POLICY_NAMES",
    "CutoffAdapter",
    "Decision",
    "EDFPolicy",
    "FCFSPolicy",
    "GMAXParams",
    "GMAXPolicy",
    "Kind",
    "LASPolicy",
    "OrderPolicy",
    "PeerPolicy",
    "Policy",
    "QLMPolicy",
    "RequestView",
    "SJFPolicy",
    "SLOsServePolicy",
    "SarathiPolicy",
    "SchedContext",
    "TokenTimeModel",
    "SchedulingInputError",
    "TempoPolicy",
    "VLLMPriorityPolicy",
    "best_replica",
    "dummy_copies",
    "estimate",
    "make_policy",
    "on_time_tokens",
    "select_window",
]
