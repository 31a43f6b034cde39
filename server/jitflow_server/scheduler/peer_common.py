"""Shared plumbing of the peer baselines ``vllm-priority``, ``tempo`` and ``qlm`` (no vLLM import).

:class:`PeerPolicy` holds what the three have in common with the key-ordered baselines of
``baselines.py``: the frame clock (recompute on arrivals/finishes or every ``delta_steps`` decode
steps), the per-request-id cache of static fields (:class:`SnapshotCache`), the validated common
parameters and the SLO columns with their defaults. Times are seconds, lengths tokens.
"""

from __future__ import annotations

import math
from numbers import Real

import numpy as np

from jitflow_server.scheduler.snapshot import (
    BEST_EFFORT,
    COMPOUND,
    DEADLINE,
    LATENCY,
    Snapshot,
    SnapshotCache,
)
from jitflow_server.scheduler.types import SchedContext

COMMON_PARAMS = ("best_effort_deadline", "delta_steps", "default_ttft", "default_tbt", "full_priorities")


def check_positive(name: str, value: float, unit: str = "") -> float:
    """``float(value)`` if it is a finite number > 0, else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0{unit}, got {value!r}")
    return float(value)


def check_int(name: str, value: int, low: int) -> int:
    """``int(value)`` if it is an integer >= ``low``, else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or int(value) != value \
            or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_fraction(name: str, value: float, low_open: bool = False, high_open: bool = False) -> float:
    """``float(value)`` if it lies in [0, 1] (ends excluded when ``*_open``), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if value < 0 or value > 1 or (low_open and value == 0) or (high_open and value == 1):
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be in {lo}0, 1{hi}, got {value!r}")
    return float(value)


class PeerPolicy:
    """Base of the peer baselines.

    ``best_effort_deadline`` (s after arrival, > 0): the completion deadline given to best-effort
    requests; ``delta_steps`` (>= 1): frame length in decode steps; ``default_ttft`` /
    ``default_tbt`` (s, > 0): used for latency requests that carry no TTFT/TBT;
    ``full_priorities``: fill ``Decision.priorities`` for every request (default: the first 2·B in
    plan order and the running ones). ``ValueError`` on a bad value.
    """

    name = "peer"
    PARAMS: tuple[str, ...] = COMMON_PARAMS
    need_admit_by = False  # read RequestView.admit_by of waiting requests (Snapshot.admit_by)

    def __init__(self, best_effort_deadline: float = 60.0, delta_steps: int = 1, default_ttft: float = 2.0,
                 default_tbt: float = 0.1, full_priorities: bool = False) -> None:
        self.best_effort_deadline = check_positive("best_effort_deadline", best_effort_deadline, " s")
        self.delta_steps = check_int("delta_steps", delta_steps, 1)
        self.default_ttft = check_positive("default_ttft", default_ttft, " s")
        self.default_tbt = check_positive("default_tbt", default_tbt, " s")
        self.full_priorities = bool(full_priorities)
        self.frame_id = 0
        self._last_step: int | None = None
        self._cache = SnapshotCache(need_attained=False, need_admit_by=self.need_admit_by)

    # ------------------------------------------------------------------ Policy protocol
    def needs_recompute(self, step: int, arrivals_or_finishes: bool) -> bool:
        """True on arrivals/finishes or every ``delta_steps`` decode steps."""
        if arrivals_or_finishes or self._last_step is None or step - self._last_step >= self.delta_steps:
            self._last_step = step
            return True
        return False

    def on_finished(self, req_id: str, goodput: float, now: float) -> None:
        """Goodput feedback is not used (subclasses may record lengths)."""

    def invalidate(self, req_id: str) -> None:
        """Re-read ``req_id``'s static fields at the next frame (after a kind/SLO change)."""
        self._cache.invalidate(req_id)

    # ------------------------------------------------------------------ helpers
    def slo_columns(self, snap: Snapshot) -> tuple[np.ndarray, np.ndarray]:
        """``(ttft, tbt)`` (s) with the defaults where a view has none."""
        ttft = np.where(np.isnan(snap.ttft), self.default_ttft, snap.ttft)
        tbt = np.where(np.isnan(snap.tbt), self.default_tbt, snap.tbt)
        return ttft, tbt

    def completion_due(self, snap: Snapshot) -> np.ndarray:
        """Absolute completion deadline (s) of the deadline-like kinds: ``deadline``; compound calls
        ``sub_deadline`` else the task ``deadline``; best-effort (and anything without one)
        ``arrival + best_effort_deadline``. Latency requests get ``arrival + ttft`` here (callers
        that model the token timeline override it)."""
        ttft, _ = self.slo_columns(snap)
        default = snap.arrival + self.best_effort_deadline
        comp = np.where(np.isnan(snap.sub_deadline), snap.deadline, snap.sub_deadline)
        k = snap.kind
        due = np.select([k == LATENCY, k == DEADLINE, k == COMPOUND, k == BEST_EFFORT],
                        [snap.arrival + ttft, snap.deadline, comp, default], default)
        return np.where(np.isnan(due), default, due)

    def shown(self, order: np.ndarray, snap: Snapshot, ctx: SchedContext) -> np.ndarray:
        """Indices whose priority goes into ``Decision.priorities``."""
        if self.full_priorities:
            return np.arange(snap.n)
        return np.union1d(order[: 2 * ctx.batch_size], np.flatnonzero(snap.running))

    @staticmethod
    def kv_fits(snap: Snapshot, in_batch: np.ndarray, ctx: SchedContext) -> bool:
        """True when the KV of every running request plus the batch's new tokens fit ``kv_capacity_tokens``
        (then displaced running requests are only paused, as the baselines of ``baselines.py`` do)."""
        if ctx.kv_capacity_tokens is None:
            return False
        held = float(snap.kv_tokens[snap.running].sum())
        new = float(np.maximum(snap.input_len + snap.generated - snap.kv_tokens, 0.0)[in_batch].sum())
        return held + new <= ctx.kv_capacity_tokens


def frame_order(n: int, *keys: np.ndarray) -> np.ndarray:
    """Stable lexicographic order (first key most significant; ties by position)."""
    return np.lexsort((np.arange(n), *reversed(keys)))
