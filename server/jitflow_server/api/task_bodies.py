"""Typed bodies of the compound-task endpoints (``POST /v1/tasks``, ``/events``, ``/complete``) and their
limits: hostile telemetry gets a 400 naming the field instead of poisoning the task or the pattern history.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

OUTCOMES = ("succeeded", "failed", "deadline_missed", "cancelled")

#: Most calls one task may record.
MAX_TASK_CALLS = 10_000
#: An open task whose deadline passed this long ago (s) may be dropped when the task table is full.
ABANDONED_AFTER_S = 60.0
#: Largest ``metadata`` of a task (bytes of JSON).
MAX_TASK_METADATA_BYTES = 16 * 1024

class TaskCreate(BaseModel):
    """``POST /v1/tasks`` body."""

    model_config = ConfigDict(extra="ignore")

    task_id: str = Field(min_length=1, max_length=200)
    app: str = Field(min_length=1, max_length=200)
    deadline: float
    start_time: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("deadline")
    @classmethod
    def _pos(cls, v: float) -> float:
        if not math.isfinite(v) or v <= 0:
            raise ValueError("deadline must be a positive finite number of seconds")
        return v

    @field_validator("start_time")
    @classmethod
    def _finite_start(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("start_time must be a finite unix time in seconds")
        return v

    @field_validator("metadata")
    @classmethod
    def _small(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            size = len(json.dumps(v, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata must be plain JSON: {exc}") from None
        if size > MAX_TASK_METADATA_BYTES:
            raise ValueError(f"metadata is {size} bytes; the limit is {MAX_TASK_METADATA_BYTES}")
        return v


#: Largest token count one telemetry event may report.
MAX_EVENT_TOKENS = 10_000_000
#: Highest stage index of a task.
MAX_STAGE_INDEX = 10_000
_Name = Annotated[str, Field(min_length=1, max_length=200)]


#: Latest accepted unix time (s): 2286-11-20. Times past it cannot be real, and the history's binary
#: form stores node times relative to the task start as float32 (a fuzzed 1e300 made a 500).
MAX_UNIX_TIME = 1e10


def _finite_time(v: float | None) -> float | None:
    if v is not None and not (math.isfinite(v) and 0 <= v <= MAX_UNIX_TIME):
        raise ValueError(f"must be a finite unix time in seconds between 0 and {MAX_UNIX_TIME:.0e}")
    return v


class _EventBase(BaseModel):
    model_config = ConfigDict(extra="ignore")

    stage_index: int = Field(0, ge=0, le=MAX_STAGE_INDEX)
    stage: str | None = Field(None, max_length=200)


class StageEvent(_EventBase):
    """A stage boundary: ``{"type": "stage_start"|"stage_end", "stage_index", "stage", "time"}`` (unix s)."""

    type: Literal["stage_start", "stage_end"]
    time: float | None = None

    _t = field_validator("time")(_finite_time)


class CallEvent(_EventBase):
    """A finished call: ``{"type": "llm"|"tool", "call_id", "model"|"name", "stage_index", "stage",
    "parents", "start", "end", "error", "input_tokens", "output_tokens"}`` (unix s, tokens)."""

    type: Literal["llm", "tool"]
    call_id: _Name | None = None
    name: _Name | None = None
    model: _Name | None = None
    parents: list[_Name] = Field(default_factory=list, max_length=256)
    start: float | None = None
    end: float | None = None
    error: str | None = Field(None, max_length=2000)
    input_tokens: int | None = Field(None, ge=0, le=MAX_EVENT_TOKENS)
    output_tokens: int | None = Field(None, ge=0, le=MAX_EVENT_TOKENS)

    _t = field_validator("start", "end")(_finite_time)

    @model_validator(mode="after")
    def _ends_after_start(self) -> CallEvent:
        if self.start is not None and self.end is not None and self.end < self.start:
            raise ValueError(f"end ({self.end}) is before start ({self.start})")
        return self


TaskEvent = Annotated[StageEvent | CallEvent, Field(discriminator="type")]


class TaskEvents(BaseModel):
    """``POST /v1/tasks/{id}/events`` body: at most 10 000 typed events (:class:`StageEvent`,
    :class:`CallEvent`); token counts are bounded by :data:`MAX_EVENT_TOKENS`, stage indexes by
    :data:`MAX_STAGE_INDEX`, times must be finite."""

    events: list[TaskEvent] = Field(max_length=10_000)


class TaskComplete(BaseModel):
    """``POST /v1/tasks/{id}/complete`` body."""

    outcome: Literal["succeeded", "failed", "deadline_missed", "cancelled"]
    end_time: float | None = None
    error: str | None = Field(None, max_length=2000)

    _t = field_validator("end_time")(_finite_time)
