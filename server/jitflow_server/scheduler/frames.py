"""The frame clock and snapshot plumbing shared by the baselines (``baselines.py``) and the peer baselines
(``vllm_priority.py``, ``tempo.py``, ``qlm.py``, ``slos_serve.py``); GMAX has its own (``gmax.py``).

A frame is recomputed on arrivals/finishes or every ``delta_steps`` decode steps; each frame starts by
validating the context and building the :class:`~jitflow_server.scheduler.snapshot.Snapshot` from the
per-request-id cache of static fields. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jitflow_server.scheduler.snapshot import Snapshot, SnapshotCache, validate_context
from jitflow_server.scheduler.types import RequestView, SchedContext


class FramedPolicy:
    """Frame clock, snapshot cache and the no-op feedback of a policy (the ``Policy`` protocol's plumbing).

    Subclasses set ``delta_steps`` (decode steps per frame, >= 1) and ``self._cache`` (a
    :class:`SnapshotCache`), then call :meth:`begin_frame` at the top of ``schedule``.
    """

    name = "framed"
    delta_steps: int = 1
    frame_id: int = 0
    _last_step: int | None = None
    _cache: SnapshotCache

    def needs_recompute(self, step: int, arrivals_or_finishes: bool) -> bool:
        """True on arrivals/finishes or once ``delta_steps`` decode steps passed since the last frame."""
        if arrivals_or_finishes or self._last_step is None or step - self._last_step >= self.delta_steps:
            self._last_step = step
            return True
        return False

    @property
    def reads_attained_service(self) -> bool:
        """True when frames read ``RequestView.attained_service`` (LAS); an engine may leave it stale otherwise."""
        return self._cache.need_attained

    def on_finished(self, req_id: str, goodput: float, now: float) -> None:
        """Goodput feedback is not used (subclasses may record what they learn from it)."""

    def invalidate(self, req_id: str) -> None:
        """Re-read ``req_id``'s static fields (kind, arrival, input_len, SLO, true_len, task/stage) at the
        next frame; call it when the engine changes one of them mid-request."""
        self._cache.invalidate(req_id)

    def begin_frame(self, views: Sequence[RequestView], ctx: SchedContext) -> Snapshot | None:
        """Validate ``ctx``, count the frame and build the snapshot of ``views``; ``None`` when there is
        nothing to schedule. Raises :class:`~jitflow_server.scheduler.snapshot.SchedulingInputError` on
        malformed input."""
        validate_context(ctx)
        self.frame_id += 1
        snap = self._cache.build(views)
        return snap if snap.n else None

    @staticmethod
    def kv_fits(snap: Snapshot, in_batch: np.ndarray, ctx: SchedContext) -> bool:
        """True when the KV of every running request plus the prefill of the batch's requests fits
        ``kv_capacity_tokens`` (tokens); then displaced running requests can be paused instead of preempted.
        False when the capacity is unknown."""
        if ctx.kv_capacity_tokens is None:
            return False
        held = float(snap.kv_tokens[snap.running].sum())
        new = float(np.maximum(snap.input_len + snap.generated - snap.kv_tokens, 0.0)[in_batch].sum())
        return held + new <= ctx.kv_capacity_tokens


def frame_order(n: int, *keys: np.ndarray) -> np.ndarray:
    """Stable lexicographic order of ``n`` requests (first key most significant; ties by position)."""
    return np.lexsort((np.arange(n), *reversed(keys)))
