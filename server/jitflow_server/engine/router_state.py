"""The router front end's plain state (``engine/remote.py``): its configuration, its counters, one
in-flight request, and the time by which a request must finish to count."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jitflow_server.scheduler.hints import SchedHints
from jitflow_server.scheduler.types import Kind


@dataclass
class RouterConfig:
    """The router front end: ``replicas`` base URLs; ``model`` the directory with the replicas' tokenizer
    (the demo variants are built locally); ``served_name`` the model id the replicas serve; ``router``
    a name of ``scheduler.routing.ROUTER_NAMES``; ``probe_period``/``probe_timeout`` the health probe
    (s); ``reroute_wait`` how long a request waits for any replica to be up (s); ``startup_timeout``
    how long :meth:`RemoteEngine.start` waits for the first replica (s); ``api_key`` sent to the
    replicas as a bearer token; ``handover_s``: a call that has produced no token this many seconds
    after reaching its replica moves, once, to the replica with the least work in flight when that one
    has ``handover_margin_s`` less (0: never; the front end's admission control rejects a call not
    started within its waiting time, and a call queued behind a burst on one replica would otherwise be
    rejected while another replica has room); admission control (JITServe §5) by default refuses a call
    that has no token by its waiting time, the only rule the front end can apply alone, since it sees
    tokens and not the replica's scheduler; ``engine_admission``: the replicas (running the jitflow
    plug-in) enforce each call's waiting time themselves, JITServe's rule (a call the replica never
    scheduled by then is removed there; ``engine/plugin_admission.py``), and the front end waits for each
    call's verdict (a first token or the refusal). Off by default: on one overloaded CPU replica it served
    7 % fewer goodput tokens than the token rule on the same arrivals (docs/deployment.md)."""

    replicas: Sequence[str]
    model: Path
    served_name: str
    router: str = "goodput"
    probe_period: float = 1.0
    probe_timeout: float = 2.0
    reroute_wait: float = 30.0
    startup_timeout: float = 300.0
    api_key: str | None = None
    seed: int = 0
    handover_s: float = 2.0
    handover_margin_s: float = 1.0
    engine_admission: bool = False


@dataclass
class Flight:
    """One call in flight at the front end (the event loop's own bookkeeping): ``rid`` its id,
    ``prompt_tokens`` and ``est_output`` (tokens: the length bound, capped by ``max_tokens``), ``urgent``
    for a latency request, ``deadline`` (unix s), the ``replica`` it is on (-1: none yet), the tokens
    ``generated`` so far, the ``queue`` of its current attempt, and the replicas of its ``attempts``;
    ``refused`` once its replica's admission control removed it; ``settled`` is set at its first token,
    that refusal or an abort, ``released`` at an abort."""

    rid: str
    prompt_tokens: int
    est_output: float
    urgent: bool
    deadline: float | None  # unix s by which it must finish to count; None: best effort
    start: float = 0.0  # unix s when the front end sent it on
    replica: int = -1
    generated: int = 0
    aborted: bool = False
    queue: asyncio.Queue | None = None
    attempts: list[int] = field(default_factory=list)
    handed_over: bool = False  # moved once already (RouterConfig.handover_s)
    prefer: int = -1  # the replica the next attempt goes to (a hand-over's target), -1: the router's pick
    refused: bool = False
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)


def slo_deadline(h: SchedHints, est_output: float, now: float) -> float | None:
    """Unix s by which a request must finish to meet its SLO (``None``: best effort)."""
    arrival = h.arrival if h.arrival is not None else now
    if h.kind is Kind.DEADLINE and h.deadline is not None:
        return arrival + h.deadline
    if h.kind is Kind.COMPOUND:
        rel = h.sub_deadline if h.sub_deadline is not None else h.deadline
        return None if rel is None else arrival + rel
    if h.kind is Kind.LATENCY and h.ttft is not None and h.tbt is not None:
        return arrival + h.ttft + max(est_output - 1, 0) * h.tbt
    return None


#: The replicas' clocks may run this far ahead of the front end's (s): a stream that ends with no token
#: this close to the call's admission deadline is read as the replica's refusal.
CLOCK_SLACK_S = 1.0
#: The longest a call refused by its replica waits for the API's admission check to claim it (s).
REFUSAL_HOLD_S = 30.0


def replica_hints(h: SchedHints, config: RouterConfig) -> SchedHints:
    """The hints sent to the replica: ``h``, asking it to enforce the waiting time itself
    (``RouterConfig.engine_admission``)."""
    return h.replace(engine_admission=True) if config.engine_admission and h.waiting_time else h


def refused_by_replica(h: SchedHints, f: Flight, config: RouterConfig) -> bool:
    """Whether a stream of call ``f`` (hints ``h``) that ended with no token is its replica's admission
    refusal: it asked the replica to enforce its waiting time, and the stream ended at or after the
    admission deadline (less :data:`CLOCK_SLACK_S`)."""
    if not (config.engine_admission and h.waiting_time):
        return False
    arrival = h.arrival if h.arrival is not None else f.start
    return time.time() >= arrival + h.waiting_time - CLOCK_SLACK_S


@dataclass
class RouterCounts:
    """What the router did since it started: calls ``routed`` to each replica (an attempt each),
    ``rerouted`` attempts that ended before a first token and were sent again, ``failed_streaming``
    calls failed after tokens were streamed (502), ``no_replica`` calls that found no replica up (503),
    ``hint_updates_dropped`` refined bounds not forwarded, ``handed_over`` calls moved to a less loaded
    replica before their first token (``RouterConfig.handover_s``), and the calls admission control
    refused at their waiting time: ``refused_by_replica`` (the replica never scheduled them) and
    ``refused_at_front`` (no token yet, with ``engine_admission=False``)."""

    routed: list[int]
    rerouted: int = 0
    failed_streaming: int = 0
    no_replica: int = 0
    hint_updates_dropped: int = 0
    handed_over: int = 0
    refused_by_replica: int = 0
    refused_at_front: int = 0
