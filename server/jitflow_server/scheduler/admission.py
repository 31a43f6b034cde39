"""Deadline admission: admit a deadline request only while its deadline is still feasible.

JITServe §5 rejects a request that is not scheduled within its ``waiting_time``. That alone does not keep
promises under overload: a request scheduled after 4.9 s of a 5 s waiting time may need 15 s more to
generate its tokens and miss a 10 s deadline (measured before this module existed: under a 10× burst on
the real engine, 68 % of the admitted deadline requests missed). Deadline admission tightens the
admission deadline of an E2EL-deadline request to its *latest feasible start*:

    latest_start = deadline − safety · service_time
    service_time = prefill_time(prompt) + len_bound · token_time(n)

where ``token_time(n)`` is the measured wall time of one engine step with ``n`` requests decoding and
``len_bound`` the request's output-length bound (a q-quantile, JITServe §4.1). The API prices the
request alone (``n = 1``): the latest start is the last moment at which the deadline can still be met
at all (JITServe App. C's filter), and whether the engine has room for it is the overcommitment test
below, at full-batch throughput. Two earlier estimates were measured on the demo's mixed load against
stock vLLM: ``n = B`` priced a 192-token request at 20.8 s at 0.7× capacity and refused requests stock
vLLM served in 6 s; ``n = requests in flight + 1`` (the batch the request joins) refused the late
requests of a burst whose batch then thinned (stock vLLM served them in 24 s, 5 of 6) and left the
admitted ones no slack to be started in (27.2 s of work against a 28.6 s deadline: refused 1.4 s
later), while a policy that sizes its batch (GMAX with ``batch_sizing="goodput"``) can serve an
admitted request faster than a full batch would. The engine keeps the
request only while it can still start by ``arrival + latest_start``; if it has not started by then, it is
removed and the client gets 429 with ``Retry-After``, as for the waiting time. A request whose
``latest_start`` has already passed when it arrives is refused at once. Every policy gets the same rule
(it lives in the API, outside the policies); stock vLLM, which reports no step model, gets none.

The latest start alone is not enough either. A policy may start a request (one prefill step and a first
token: it is admitted) and then pause it for others: measured with GMAX under a 10× burst of deadline
requests, 436 requests were admitted within 3 s of arriving and 94 % of them finished 30-70 s later, far
past their 8.5 s deadline. So a deadline request is also admitted only if the work already promised still
fits (:func:`fits_commitments`): every in-flight request with a finish time (deadline requests, latency
requests' last token, compound calls' sub-deadlines) is a :class:`Commitment` of ``work_s``
slot-seconds due by ``finish_by``, and with B slots the promises ordered by due time (EDF) must all fit,

    for every k with due_k ≥ due_new:  Σ_{j: due_j ≤ due_k} work_j ≤ B · (due_k − now),

and the new request alone must fit its own deadline (the latest-start rule above).
A promise due after the new request's deadline that
was already late before it arrived does not refuse it (the new request cannot save it); everything due
before the new request's deadline counts, late or not. This is the fluid relaxation of EDF feasibility on B parallel slots: it
admits no more than B slots can finish in time, whatever order the policy then runs them in.

What it does not cover: a request whose output is longer than its bound (about 1 − q of them) can still
miss, and a policy that lets admitted work wait while it serves later arrivals can still make it miss. Compound calls are not held to this rule: their deadline
belongs to the task, and a rejected stage fails the whole task.

No engine imports: the API (``api/serving.py``) and the engine adapters exchange :class:`ServiceRate` as a
plain dict inside the engine's stats.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

#: JITServe §5's admission control: a request with an SLO that its engine has not started within this many
#: seconds is rejected. The default of the server (``ServerSettings.default_waiting_time``), of the
#: simulator and benchmarks (the same admission for every policy) and of the demo's SLOs as set.
DEFAULT_WAITING_TIME_S = 5.0


#: How long a compound call may wait for its start: ``"waiting_time"`` (the default) its waiting time,
#: ``"sub_deadline"`` until its stage's sub-deadline when that is later than its waiting time.
COMPOUND_WAITING = ("sub_deadline", "waiting_time")


def check_compound_waiting(mode: str) -> str:
    """``mode`` if it is one of :data:`COMPOUND_WAITING`; raises ``ValueError`` naming the choices otherwise."""
    if mode not in COMPOUND_WAITING:
        raise ValueError(f"compound_waiting must be one of {COMPOUND_WAITING}, got {mode!r}")
    return mode


def compound_waiting_time(waiting_time: float | None, sub_deadline: float | None,
                          mode: str = "waiting_time") -> float | None:
    """The admission deadline (s after arrival) of a compound call whose waiting time is ``waiting_time``.

    A compound call's deadline is its stage's sub-deadline (JITServe §4.2), and GMAX starts such calls
    just in time. A waiting time shorter than the sub-deadline rejects them before their deadline, and a
    rejected call fails its whole task; ``"sub_deadline"`` lets them wait. It is not the default: in the
    simulator (``a100-llama8b``, seeds 0–2, the same rule for every policy) it raised GMAX's token
    goodput by 4.8 % at 1.9× capacity on the default workload, but cost GMAX up to 16 % of its tokens and
    11–28 % of its requests on the replayed Mooncake traces, and on the Azure code replay it helped the
    other policies more than GMAX (docs/scheduling.md, "Letting agent calls wait until their
    sub-deadline").

    Args:
        waiting_time: the call's waiting time (s), ``None`` for no admission control (returned as is).
        sub_deadline: the stage's sub-deadline, s after the call's arrival (``None``: no analyzer).
        mode: one of :data:`COMPOUND_WAITING`.
    Raises:
        ValueError: for an unknown ``mode``.
    """
    if check_compound_waiting(mode) == "waiting_time" or waiting_time is None or sub_deadline is None:
        return waiting_time
    return max(waiting_time, sub_deadline)


@dataclass(frozen=True)
class ServiceRate:
    """Measured engine speed for admission decisions.

    One engine step (s) with ``n`` decoding requests and ``p`` prefill tokens takes
    ``(base_s + per_decode_s·n + per_prefill_token_s·p) · wall_factor``: the SLO tracker's fit of model
    execution (``tracker/steps.py``) scaled to the wall time a decoding request sees per token (the
    scheduler's own time and other requests' prefill chunks; measured 1.12 on the demo model at B = 16).
    ``min_step_s`` floors the fit (a least-squares fit over similar samples can extrapolate to ~0).
    ``lone_step_s`` (``None``: not reported) caps the step of a request decoding alone: the fastest wall
    time between two decoding steps the engine measured (the 5th percentile over its window). A lone
    request never waits longer per token than a step the engine ran with others, and without the cap a
    window of prefill-heavy full batches priced it at the floor times the wall factor, both of which
    already count the others' prefill: replaying the real engine's step log under the mixed load at 8
    and 16 requests/s (demo model, 2-core AMD EPYC with AVX-512), 0.36 and 1.4 s per token (medians)
    where a lone step took 17 ms, and in a `make demo` on that machine deadline admission refused five
    deadline requests of the normal phase (0.7× capacity) as needing 22.6–29.2 s for a 20 s deadline.
    ``batch_size``: B, the most requests that decode together. ``decode_batch``: how many requests the
    engine decodes together in its busier steps (the 90th percentile over the tracker's window, at most
    B; ``None``: not reported), so that a reader of the fit can evaluate it where it was measured instead
    of extrapolating it to B (the analyzer's call-time model,
    :func:`~jitflow_server.analyzer.subdeadline.call_time_model_from_rate`).
    """

    base_s: float
    per_decode_s: float
    per_prefill_token_s: float
    wall_factor: float
    min_step_s: float
    batch_size: int
    decode_batch: int | None = None
    lone_step_s: float | None = None

    def step_time(self, n_decode: int, prefill_tokens: int = 0) -> float:
        """Wall time (s) of one step with ``n_decode`` decoding requests and ``prefill_tokens`` (at most
        ``lone_step_s`` for a request decoding alone)."""
        t = self.base_s + self.per_decode_s * n_decode + self.per_prefill_token_s * prefill_tokens
        t = max(t, self.min_step_s) * self.wall_factor
        if n_decode <= 1 and prefill_tokens == 0 and self.lone_step_s is not None:
            return min(t, self.lone_step_s)
        return t

    def service_time(self, prompt_tokens: int, len_bound: int, batch: int | None = None) -> float:
        """Seconds to prefill ``prompt_tokens`` and generate ``len_bound`` tokens in a batch of ``batch``
        decoding requests (default and at most B)."""
        n = self.batch_size if batch is None else min(max(int(batch), 1), self.batch_size)
        prefill = self.per_prefill_token_s * max(prompt_tokens, 0)
        return prefill + max(len_bound, 1) * self.step_time(n)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (crosses the engine's control channel inside its stats)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> ServiceRate | None:
        """The rate in ``d`` (an engine's ``stats()["service"]``), or ``None`` if absent or malformed.
        ``decode_batch`` may be missing (an engine that does not report it)."""
        if not isinstance(d, dict):
            return None
        try:
            r = cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except TypeError:  # a required field missing (unknown ones were left out above)
            return None
        vals = (r.base_s, r.per_decode_s, r.per_prefill_token_s, r.wall_factor, r.min_step_s)
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in vals):
            return None
        if r.wall_factor < 1:
            return None
        if not isinstance(r.batch_size, int) or r.batch_size < 1:
            return None
        if r.decode_batch is not None and (not isinstance(r.decode_batch, int) or isinstance(r.decode_batch, bool)
                                           or r.decode_batch < 1):
            return None
        if r.lone_step_s is not None and (not isinstance(r.lone_step_s, (int, float)) or isinstance(r.lone_step_s, bool)
                                          or not math.isfinite(r.lone_step_s) or r.lone_step_s <= 0):
            return None
        return r


@dataclass(frozen=True)
class AdmissionDeadline:
    """A request's admission deadline.

    ``waiting_time``: seconds after arrival by which the engine must have started the request (``None``:
    never rejected); ``binding``: ``"waiting_time"`` (the request's or the server's waiting time) or
    ``"deadline"`` (deadline admission made it shorter); ``service_time``: the estimate used (s) or
    ``None``. A ``waiting_time`` ≤ 0 means: refuse now, for the ``reason`` given.
    """

    waiting_time: float | None
    binding: str
    service_time: float | None = None
    reason: str | None = None

    @property
    def refuse_now(self) -> bool:
        """True when the deadline cannot be met even if the request started at once."""
        return self.waiting_time is not None and self.waiting_time <= 0


def admission_deadline(kind: str, deadline: float | None, waiting_time: float | None, *,
                       prompt_tokens: int, len_bound: int, rate: ServiceRate | None,
                       safety: float = 1.0, held: list[Commitment] | None = None,
                       now: float = 0.0, batch: int | None = None) -> AdmissionDeadline:
    """The admission deadline of one request arriving at ``now`` (module docstring).

    Args:
        kind: the request's SLO kind; only ``"deadline"`` is tightened.
        deadline: its E2EL deadline (s after arrival) or ``None``.
        waiting_time: its waiting time (s after arrival) or ``None``.
        prompt_tokens, len_bound: prompt length and output-length bound (tokens).
        rate: the engine's measured speed; ``None`` leaves the waiting time as it is.
        safety: multiplies the service time (≥ 1 is more conservative).
        held: the in-flight requests' :class:`Commitment` s (same clock as ``now``); ``None`` skips the
            overcommitment test.
        batch: the batch the request is expected to decode in (the requests in flight with it; default
            and at most B), for its own service time. The overcommitment test always counts full-batch
            slot-seconds.
    A refusal (``refuse_now``) says why in ``reason``: ``"too_late"`` or ``"overcommitted"``.
    """
    if kind != "deadline" or deadline is None or rate is None:
        return AdmissionDeadline(waiting_time, "waiting_time")
    service = safety * rate.service_time(prompt_tokens, len_bound, batch)
    latest = deadline - service
    if latest <= 0:
        return AdmissionDeadline(latest, "deadline", service, "too_late")
    work = safety * rate.service_time(prompt_tokens, len_bound)  # slot-seconds at full-batch throughput
    if held is not None and not fits_commitments(now, Commitment(now + deadline, work), held, rate.batch_size):
        return AdmissionDeadline(0.0, "deadline", service, "overcommitted")
    if waiting_time is not None and waiting_time <= latest:
        return AdmissionDeadline(waiting_time, "waiting_time", service)
    return AdmissionDeadline(latest, "deadline", service)


@dataclass(frozen=True)
class Commitment:
    """Work promised to one in-flight request: ``work_s`` slot-seconds (prefill plus remaining tokens at
    the full-batch step time) due by ``finish_by`` (s, on the caller's clock)."""

    finish_by: float
    work_s: float


def fits_commitments(now: float, new: Commitment, held: list[Commitment], batch_size: int) -> bool:
    """True when ``new`` can be promised next to ``held`` on ``batch_size`` slots (module docstring: the
    fluid EDF test; promises due after ``new`` that are late without it are not held against it).
    O(n log n)."""
    jobs = sorted([(c.finish_by, c.work_s, False) for c in held] + [(new.finish_by, new.work_s, True)])
    before = 0.0  # work due by the current due time, without the new request
    for due, work, is_new in jobs:
        if not is_new:
            before += work
        if due < new.finish_by:
            continue
        cap = batch_size * max(due - now, 0.0)
        if before + new.work_s > cap and (is_new or before <= cap):
            return False
    return True
