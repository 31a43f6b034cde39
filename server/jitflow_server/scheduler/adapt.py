"""Online adaptation of the GMAX cutoff ``p`` from measured goodput (JITServe §4.2, "GMAX automates
and continuously adapts p online by exploring different thresholds and converging to those that
maximize end-to-end goodput").
"""

from __future__ import annotations

import math


class CutoffAdapter:
    """Hill-climbing explorer for the cutoff ``p`` driven by finished-request goodput.

    The adapter runs *trials*: the incumbent ``p`` and its two neighbours ``p ± step`` (clipped to
    ``[p_min, p_max]``), each for ``epoch`` finished requests. A trial's score is its goodput rate,
    ``Σ goodput / (t_last_finish − t_trial_start)`` in tokens per second (the mean goodput per
    finished request when no time elapses). After a round of trials the incumbent moves to the best
    trial only if that trial beat the incumbent's own score ("explore neighbours, keep the better").

    ``current`` is the value the scheduler must use right now. With ``enabled=False`` it stays at
    ``p0``. Raises ``ValueError`` for ``p0`` outside ``(0, 1]`` or a non-positive ``step``/``epoch``.
    """

    def __init__(
        self,
        p0: float = 0.95,
        step: float = 0.05,
        p_min: float = 0.5,
        p_max: float = 1.0,
        epoch: int = 32,
        enabled: bool = True,
    ) -> None:
        if not 0.0 < p0 <= 1.0:
            raise ValueError(f"cutoff p must be in (0, 1], got {p0}")
        if step <= 0 or epoch < 1:
            raise ValueError(f"step must be > 0 and epoch >= 1, got step={step}, epoch={epoch}")
        if not 0.0 < p_min <= p_max <= 1.0:
            raise ValueError(f"need 0 < p_min <= p_max <= 1, got {p_min}, {p_max}")
        self.p = min(max(p0, p_min), p_max)
        self.step, self.p_min, self.p_max, self.epoch, self.enabled = step, p_min, p_max, epoch, enabled
        self.history: list[tuple[float, float]] = []  # (p tried, score) for inspection
        self._trials: list[float] = []
        self._scores: list[float] = []
        self._n = 0
        self._sum = 0.0
        self._t0: float | None = None
        self._t_last: float | None = None
        self._start_round()

    @property
    def current(self) -> float:
        """The cutoff the scheduler uses now (incumbent or the value under trial)."""
        return self._trials[len(self._scores)] if self.enabled else self.p

    def _start_round(self) -> None:
        cand = [self.p, self.p - self.step, self.p + self.step]
        trials: list[float] = []
        for c in cand:
            c = round(min(max(c, self.p_min), self.p_max), 6)
            if c not in trials:
                trials.append(c)
        self._trials, self._scores = trials, []

    def record(self, goodput: float, now: float) -> None:
        """Account one finished request's measured goodput (tokens) at time ``now`` (s)."""
        if not self.enabled:
            return
        if self._t0 is None:
            self._t0 = now
        self._t_last = now
        self._n += 1
        self._sum += goodput
        if self._n < self.epoch:
            return
        elapsed = (self._t_last - self._t0) if self._t_last is not None else 0.0
        score = self._sum / elapsed if elapsed > 1e-9 else self._sum / self._n
        tried = self._trials[len(self._scores)]
        self._scores.append(score)
        self.history.append((tried, score))
        self._n, self._sum, self._t0 = 0, 0.0, now
        if len(self._scores) == len(self._trials):
            best = max(range(len(self._trials)), key=lambda i: (self._scores[i], -abs(self._trials[i] - self.p)))
            if self._scores[best] > self._scores[0] and not math.isclose(self._scores[best], self._scores[0]):
                self.p = self._trials[best]
            self._start_round()
