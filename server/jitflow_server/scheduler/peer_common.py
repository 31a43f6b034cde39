"""Shared plumbing of the peer baselines ``vllm-priority``, ``tempo``, ``qlm`` and ``slos-serve`` (no vLLM import).

:class:`PeerPolicy` adds to the frame clock and snapshot cache of
:class:`~jitflow_server.scheduler.frames.FramedPolicy` (shared with ``baselines.py``) the validated
common parameters, the SLO columns with their defaults and the priorities of a plan order; the
``check_*`` helpers validate parameters. Times are seconds, lengths tokens.
"""

from __future__ import annotations

import math
from numbers import Real

import numpy as np

from jitflow_server.scheduler.frames import FramedPolicy
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


def check_bool(name: str, value: bool) -> bool:
    """``bool(value)`` if it is a bool (numpy's too), else ``ValueError`` naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_fraction(name: str, value: float, low_open: bool = False, high_open: bool = False) -> float:
    """``float(value)`` if it lies in [0, 1] (ends excluded when ``*_open``), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if value < 0 or value > 1 or (low_open and value == 0) or (high_open and value == 1):
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be in {lo}0, 1{hi}, got {value!r}")
    return float(value)


class PeerPolicy(FramedPolicy):
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

    def rank_priorities(self, order: np.ndarray, snap: Snapshot, ctx: SchedContext) -> dict[str, float]:
        """``Decision.priorities`` of a plan ``order`` (indices, first = most urgent): minus each shown
        request's position in it, so larger is more urgent."""
        shown = np.intersect1d(self.shown(order, snap, ctx), order)
        pos = np.empty(snap.n)
        pos[order] = np.arange(order.size)
        return dict(zip([snap.ids[i] for i in shown], (-pos[shown]).tolist(), strict=True))

    def shown(self, order: np.ndarray, snap: Snapshot, ctx: SchedContext) -> np.ndarray:
        """Indices whose priority goes into ``Decision.priorities``."""
        if self.full_priorities:
            return np.arange(snap.n)
        return np.union1d(order[: 2 * ctx.batch_size], np.flatnonzero(snap.running))
