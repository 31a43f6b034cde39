"""Service-level objectives attached to a request (JITServe §3).

Each SLO class is a frozen pydantic model whose ``model_dump`` / :meth:`SLO.to_wire` is the
wire ``slo`` object: ``{"kind": ..., "ttft": s, "tbt": s, "deadline": s, "waiting_time": s}``
(only the fields the kind uses; all times are seconds, positive and finite).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter

__all__ = ["SLO", "Latency", "Deadline", "BestEffort", "Compound", "AnySLO", "parse_slo"]


def _reject_non_numbers(v: Any) -> Any:
    # pydantic's lax mode would coerce True -> 1.0 and "2" -> 2.0; an SLO must be a real number.
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be a number of seconds")
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError("must be finite")
    return v


Seconds = Annotated[float, BeforeValidator(_reject_non_numbers), Field(gt=0, allow_inf_nan=False)]
"""A positive, finite number of seconds."""


class SLO(BaseModel):
    """Base class of the SLO kinds. Do not instantiate directly.

    Attributes:
        kind: wire discriminator (``"latency"``, ``"deadline"``, ``"compound"``, ``"best_effort"``).
        waiting_time: optional admission bound in seconds: the server drops the request with an
            ``admission_rejected`` error if it is not scheduled within this time (JITServe §4.2).

    Raises:
        pydantic.ValidationError (a ``ValueError``): a time is missing, not a number, <= 0 or not
            finite.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    waiting_time: Seconds | None = None

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready wire object (``None`` fields omitted)."""
        return self.model_dump(exclude_none=True)

    def with_waiting_time(self, waiting_time: float | None) -> SLO:
        """A copy with ``waiting_time`` replaced (validated)."""
        if waiting_time is None:
            return self
        return type(self).model_validate({**self.model_dump(), "waiting_time": waiting_time})


class Latency(SLO):
    """Latency-sensitive request: token *i* (1-based) is on time if emitted by
    ``arrival + ttft + (i-1)·tbt`` (JITServe §3).

    Args:
        ttft: time-to-first-token target in seconds.
        tbt: time-between-tokens target in seconds.
    """

    kind: Literal["latency"] = "latency"
    ttft: Seconds
    tbt: Seconds

    def __init__(self, ttft: float | None = None, tbt: float | None = None, /, **data: Any) -> None:
        if ttft is not None:
            data["ttft"] = ttft
        if tbt is not None:
            data["tbt"] = tbt
        super().__init__(**data)


class Deadline(SLO):
    """Deadline-sensitive request: goodput only if the last token arrives within ``deadline``
    seconds of arrival (end-to-end latency, E2EL).

    Args:
        deadline: seconds, relative to the request's arrival at the server.
    """

    kind: Literal["deadline"] = "deadline"
    deadline: Seconds

    def __init__(self, deadline: float | None = None, /, **data: Any) -> None:
        if deadline is not None:
            data["deadline"] = deadline
        super().__init__(**data)


class Compound(SLO):
    """A call that belongs to a compound request (a staged DAG of calls with one deadline).

    Inside ``client.task(...)`` / ``@jitflow.agent`` the SDK sends this automatically with the
    task context; ``deadline`` (seconds from arrival) is then the time left to the task deadline.
    Outside a registered task the server needs ``deadline``.
    """

    kind: Literal["compound"] = "compound"
    deadline: Seconds | None = None

    def __init__(self, deadline: float | None = None, /, **data: Any) -> None:
        if deadline is not None:
            data["deadline"] = deadline
        super().__init__(**data)


class BestEffort(SLO):
    """No SLO: the server gives it a default completion deadline so it never starves."""

    kind: Literal["best_effort"] = "best_effort"


AnySLO = Annotated[Union[Latency, Deadline, Compound, BestEffort], Field(discriminator="kind")]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(AnySLO)


def parse_slo(value: SLO | dict[str, Any]) -> SLO:
    """Validate a wire ``slo`` dict (or pass through an :class:`SLO` instance).

    Raises:
        pydantic.ValidationError: unknown ``kind``, missing or invalid fields.
        TypeError: ``value`` is neither a dict nor an SLO.
    """
    if isinstance(value, SLO):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"slo must be a jitflow SLO or a dict, not {type(value).__name__}")
    return _ADAPTER.validate_python(value)
