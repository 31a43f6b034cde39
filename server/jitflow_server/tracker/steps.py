"""SLO tracker: measured engine step times -> per-token generation speed and prefill rate.

GMAX needs ``v_token`` (seconds per generated token of one request at the current
batch) and a prefill rate (tokens/s) to turn remaining lengths into generation
times (JITServe §4.2: "the per-token generation speed measured by the SLO tracker").
On a CPU the decode step time grows almost linearly with the batch size, so the
tracker keeps a small least-squares fit ``step = a + b·n_decode + c·prefill_tokens``
over a sliding window of measured steps, instead of constants.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

#: Columns of one entry of the engine's step log (``JitflowScheduler.step_log``,
#: ``GET /v1/jitflow/engine/steps``, ``steps.json``): unix time (s), period since the previous step
#: (s; None after idle), model execution (s), decoding requests, prefill tokens, summed context of
#: the decodes (tokens), coefficient of variation of the batch's context lengths.
STEP_FIELDS = ("t", "period_s", "forward_s", "n_decode", "prefill_tokens", "ctx_decode_tokens", "ctx_cv")


@dataclass(frozen=True)
class StepSample:
    """One measured engine step: wall duration (s), requests decoding, prefill tokens."""

    duration: float
    n_decode: int
    prefill_tokens: int


class StepTimeTracker:
    """Sliding-window model of engine step time (seconds) from measured steps.

    Args:
        window: number of recent steps kept.
        default_token_time: seconds per decode step used before any measurement.
        default_prefill_rate: prefill tokens per second used before any measurement.
    """

    def __init__(self, window: int = 512, default_token_time: float = 0.035,
                 default_prefill_rate: float = 2000.0) -> None:
        self.samples: deque[StepSample] = deque(maxlen=window)
        self.default_token_time = default_token_time
        self.default_prefill_rate = default_prefill_rate
        self._coef: tuple[float, float, float] | None = None
        self._dirty = False

    def record(self, duration: float, n_decode: int, prefill_tokens: int) -> None:
        """Add one measured step (``duration`` s; ignored if not positive)."""
        if duration > 0:
            self.samples.append(StepSample(duration, n_decode, prefill_tokens))
            self._dirty = True

    def _fit(self) -> tuple[float, float, float] | None:
        if not self._dirty:
            return self._coef
        self._dirty = False
        if len(self.samples) < 8:
            return self._coef
        import numpy as np

        x = np.array([[1.0, s.n_decode, s.prefill_tokens] for s in self.samples])
        y = np.array([s.duration for s in self.samples])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        a, b, c = (float(v) for v in coef)
        # Keep the model physical: non-negative marginal costs.
        self._coef = (max(a, 1e-4), max(b, 0.0), max(c, 0.0))
        return self._coef

    def step_time(self, n_decode: int, prefill_tokens: int = 0) -> float:
        """Predicted step time (s) for a batch of ``n_decode`` decoding requests plus prefill tokens."""
        coef = self._fit()
        if coef is None:
            return self.default_token_time * max(1.0, n_decode / 32) + prefill_tokens / self.default_prefill_rate
        a, b, c = coef
        return a + b * n_decode + c * prefill_tokens

    def token_time(self, batch: int) -> float:
        """``v_token``: seconds for one request to get one token when ``batch`` requests decode together.

        Never below half the median measured step: a least-squares fit over few or similar samples can
        extrapolate to ~0, which would make GMAX's frames (Δ·v_token) vanishingly short.
        """
        t = self.step_time(max(batch, 1))
        if len(self.samples) >= 8:
            import statistics

            t = max(t, 0.5 * statistics.median(s.duration for s in self.samples))
        return t

    def prefill_rate(self) -> float:
        """Prefill throughput (tokens/s) implied by the fit (default before measurements)."""
        coef = self._fit()
        if coef is None or coef[2] <= 0:
            return self.default_prefill_rate
        return 1.0 / coef[2]

    def summary(self) -> dict:
        """Plain-dict view (for RPC/metrics): samples, fitted coefficients, token time at 1/8/32."""
        coef = self._fit()
        return {
            "samples": len(self.samples),
            "coef": list(coef) if coef else None,
            "token_time_b1": self.token_time(1),
            "token_time_b8": self.token_time(8),
            "token_time_b32": self.token_time(32),
            "prefill_rate": self.prefill_rate(),
        }
