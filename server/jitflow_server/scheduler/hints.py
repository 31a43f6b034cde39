"""The scheduling hints of one LLM request: the only data that crosses from the API into the engine.

The API (and the compound advisor behind it) decides what the scheduler should know about a request:
its SLO class and parameters, its compound task and stage, the stage's sub-deadline and the analyzer's
output-length upper bound. That travels as one :class:`SchedHints` value, versioned and validated on
both sides. In vLLM it rides in ``SamplingParams.extra_args`` under the single key :data:`HINTS_KEY`
as a JSON string (vLLM's OpenAI server accepts it in ``vllm_xargs`` too, so a front end in front of
``vllm serve`` sends the same thing); the simulator builds :class:`SchedHints` directly.

Times: ``arrival`` is the unix time (s) at which the request reached the front end; every other time
is seconds *relative to arrival*. The engine maps them onto its own monotonic clock once, when the
request is added, so nothing downstream mixes clocks. Lengths are tokens.

A true output length is never part of the hints: it exists only inside the simulator.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jitflow_server.scheduler.types import Kind, SLOSpec

#: The ``extra_args`` / ``vllm_xargs`` key that carries the hints (a JSON object as a string).
HINTS_KEY = "jitflow_hints"
#: Wire version. A reader rejects any other version instead of guessing what its fields mean.
HINTS_VERSION = 1
#: ``vllm_xargs`` keys reserved for jitflow. The jitflow API rejects them from clients (400): only the
#: server decides a request's hints, so no client can raise its own priority.
RESERVED_PREFIXES = (HINTS_KEY, "jf_", "jitflow")
#: Policies that need a request's true output length, which no hint carries: simulator only.
SIMULATOR_ONLY = frozenset({"oracle"})


class HintsError(ValueError):
    """Invalid scheduling hints; ``field`` names the offending field (``None`` for the whole object)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _seconds(name: str, v: Any, *, allow_zero: bool = False, allow_negative: bool = False) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise HintsError(f"{name} must be a number of seconds, got {type(v).__name__}", name)
    f = float(v)
    if not math.isfinite(f):
        raise HintsError(f"{name} must be finite, got {v!r}", name)
    if not allow_negative and (f < 0 or (f == 0 and not allow_zero)):
        raise HintsError(f"{name} must be {'>= 0' if allow_zero else '> 0'} seconds, got {v!r}", name)
    return f


def _tokens(name: str, v: Any, *, minimum: int) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise HintsError(f"{name} must be an integer number of tokens, got {v!r}", name)
    i = int(v)
    if i < minimum or i > 2**31:
        raise HintsError(f"{name} must be in [{minimum}, 2**31] tokens, got {v!r}", name)
    return i


@dataclass(frozen=True, slots=True)
class SchedHints:
    """What the scheduler knows about one request (see the module docstring for clocks and units).

    Attributes:
        kind: SLO class (JITServe §3).
        request_id: the front end's id of the request (the engine's own id when ``None``).
        arrival: unix s when the request reached the front end (``None``: the engine's arrival time).
        ttft, tbt: latency SLO (s); both required for ``Kind.LATENCY``.
        deadline: end-to-end deadline, s after arrival (``Kind.DEADLINE``; for ``Kind.COMPOUND`` the
            time left until the task deadline).
        sub_deadline: the compound stage's sub-deadline ``T0 + φ(s)·D`` (JITServe §4.1), s after arrival
            (negative when the stage is already late).
        waiting_time: admission control (JITServe §5): a request never scheduled by
            ``arrival + waiting_time`` is rejected.
        engine_admission: the engine enforces ``waiting_time`` itself: at ``arrival + waiting_time`` it
            removes the request if it never scheduled it and ends it with no output (finish reason
            ``abort``). Set by a front end that cannot ask the engine whether a request started (the
            router over remote replicas with ``engine_admission`` on, ``engine/remote.py``); the embedded
            engine's front end asks instead (``EngineCall.REJECT_WAITING``). Sent only when true.
        task_id, stage_index: the compound task and stage; calls with the same pair share a priority.
        len_bound: upper bound on the total output length (tokens, ≥ 1; JITServe §4.1).
        task_tokens_est: estimated input + output tokens of the whole task (tokens).
        task_rem_gen_time: estimated time of the task's later stages (s: each stage's recorded span or longest chain of calls).
        version: wire version (:data:`HINTS_VERSION`).

    Raises:
        HintsError: on construction with an invalid field (names the field).
    """

    kind: Kind = Kind.BEST_EFFORT
    request_id: str | None = None
    arrival: float | None = None
    ttft: float | None = None
    tbt: float | None = None
    deadline: float | None = None
    sub_deadline: float | None = None
    waiting_time: float | None = None
    task_id: str | None = None
    stage_index: int | None = None
    len_bound: int | None = None
    task_tokens_est: int | None = None
    task_rem_gen_time: float = 0.0
    engine_admission: bool = False
    version: int = HINTS_VERSION

    def __post_init__(self) -> None:
        if self.version != HINTS_VERSION:
            raise HintsError(f"hints version {self.version!r} is not supported (this engine reads "
                             f"version {HINTS_VERSION})", "version")
        try:
            kind = Kind(self.kind)
        except ValueError:
            raise HintsError(f"kind must be one of {[k.value for k in Kind]}, got {self.kind!r}", "kind") from None
        object.__setattr__(self, "kind", kind)
        for name in ("request_id", "task_id"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v or len(v) > 256):
                raise HintsError(f"{name} must be a non-empty string of at most 256 characters", name)
        object.__setattr__(self, "arrival", _seconds("arrival", self.arrival))
        for name in ("ttft", "tbt", "deadline", "waiting_time"):
            object.__setattr__(self, name, _seconds(name, getattr(self, name)))
        object.__setattr__(self, "sub_deadline", _seconds("sub_deadline", self.sub_deadline, allow_negative=True))
        object.__setattr__(self, "task_rem_gen_time",
                           _seconds("task_rem_gen_time", self.task_rem_gen_time, allow_zero=True) or 0.0)
        object.__setattr__(self, "stage_index", _tokens("stage_index", self.stage_index, minimum=0))
        object.__setattr__(self, "len_bound", _tokens("len_bound", self.len_bound, minimum=1))
        object.__setattr__(self, "task_tokens_est", _tokens("task_tokens_est", self.task_tokens_est, minimum=0))
        if not isinstance(self.engine_admission, bool):
            raise HintsError(f"engine_admission must be true or false, got {self.engine_admission!r}",
                             "engine_admission")
        if kind is Kind.LATENCY and (self.ttft is None or self.tbt is None):
            raise HintsError("a latency request needs ttft and tbt", "ttft" if self.ttft is None else "tbt")
        if kind is Kind.DEADLINE and self.deadline is None:
            raise HintsError("a deadline request needs deadline", "deadline")

    @property
    def slo(self) -> SLOSpec:
        """The request's SLO (kind, TTFT, TBT, deadline, waiting time) as the one server-side SLO type."""
        return SLOSpec(self.kind, self.ttft, self.tbt, self.deadline, self.waiting_time)

    # ------------------------------------------------------------------------------------- wire
    def to_dict(self) -> dict[str, Any]:
        """The hints as a JSON-ready dict (``None`` fields and a false ``engine_admission`` left out;
        ``kind`` as its string value)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["kind"] = self.kind.value
        if not self.engine_admission:
            del d["engine_admission"]
        return {k: v for k, v in d.items() if v is not None}

    def to_json(self) -> str:
        """Compact JSON of :meth:`to_dict`."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_extra_args(self) -> dict[str, str]:
        """``{HINTS_KEY: json}``: what goes into ``SamplingParams.extra_args`` or ``vllm_xargs``."""
        return {HINTS_KEY: self.to_json()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SchedHints:
        """Validate a decoded hints object. Raises :class:`HintsError` naming an unknown or bad field."""
        if not isinstance(d, Mapping):
            raise HintsError("hints must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise HintsError(f"unknown hints field {unknown[0]!r}", unknown[0])
        if "version" not in d:
            raise HintsError("hints carry no version", "version")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str | bytes) -> SchedHints:
        """Parse and validate :meth:`to_json` output. Raises :class:`HintsError`."""
        try:
            d = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise HintsError(f"hints are not valid JSON: {exc}") from None
        return cls.from_dict(d)

    @classmethod
    def from_extra_args(cls, extra_args: Mapping[str, Any] | None) -> SchedHints | None:
        """The hints in ``SamplingParams.extra_args`` (``None`` when the key is absent).

        Raises :class:`HintsError` when the key is present but invalid.
        """
        if not extra_args or HINTS_KEY not in extra_args:
            return None
        raw = extra_args[HINTS_KEY]
        if isinstance(raw, Mapping):
            return cls.from_dict(raw)
        if not isinstance(raw, (str, bytes)):
            raise HintsError(f"{HINTS_KEY} must be a JSON string")
        return cls.from_json(raw)

    def replace(self, **changes: Any) -> SchedHints:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def reserved_keys(extra: Mapping[str, Any] | None) -> list[str]:
    """The keys of a client's ``vllm_xargs`` that are reserved for jitflow (sorted)."""
    return sorted(k for k in (extra or {}) if k.startswith(RESERVED_PREFIXES))


@dataclass(frozen=True, slots=True)
class HintUpdate:
    """Refined hints for requests already in the engine, keyed by :attr:`SchedHints.request_id`.

    ``len_bound``: new output-length bounds (tokens); ``sub_deadline``: new sub-deadlines (s after
    each request's arrival); ``finished``: ``(request_id, goodput tokens)`` of finished requests,
    fed to the policy (cutoff-p adaptation, JITServe §4.2).
    """

    len_bound: Mapping[str, int] = dataclasses.field(default_factory=dict)
    sub_deadline: Mapping[str, float] = dataclasses.field(default_factory=dict)
    finished: tuple[tuple[str, float], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for the engine's utility call)."""
        return {"len_bound": dict(self.len_bound), "sub_deadline": dict(self.sub_deadline),
                "finished": [list(f) for f in self.finished]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HintUpdate:
        """Validate the dict form. Raises :class:`HintsError` naming the bad entry."""
        lb = {str(k): _tokens(f"len_bound[{k}]", v, minimum=1) for k, v in (d.get("len_bound") or {}).items()}
        sd = {str(k): _seconds(f"sub_deadline[{k}]", v, allow_negative=True)
              for k, v in (d.get("sub_deadline") or {}).items()}
        fin = tuple((str(r), float(_seconds("finished", g, allow_zero=True) or 0.0))
                    for r, g in (d.get("finished") or []))
        return cls(lb, sd, fin)  # type: ignore[arg-type]
