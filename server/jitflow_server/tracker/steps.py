"""SLO tracker: measured engine step times -> per-token generation speed and prefill rate.

GMAX needs ``v_token`` (seconds per generated token of one request at the current
batch) and a prefill rate (tokens/s) to turn remaining lengths into generation
times (JITServe §4.2: "the per-token generation speed measured by the SLO tracker").
On a CPU the decode step time grows almost linearly with the batch size, so the
tracker keeps a small least-squares fit ``step = a + b·n_decode + c·prefill_tokens``
over a sliding window of measured steps, instead of constants.

Two things keep the fit physical when the window holds one batch size only (an engine held at a full
batch by a burst). The coefficients are fitted non-negative (``scipy.optimize.nnls``), not fitted freely
and clipped afterwards; and the last :data:`STRATUM_STEPS` steps of every batch size that has left the
window are kept aside and join the fit while the window holds no step of that size, so that the slope
``b`` stays identified. They join only a window too narrow to fix the slope itself (its decoding batch
sizes span less than :data:`NARROW_SPAN` of the largest): they come from another time, another context
per request and another load on the host, and where they joined every window they tilted the slope
(in the simulator on the Mooncake conversation trace, GMAX met 16 % fewer requests than with the former
fit; see docs/scheduling.md). Measured on the demo model's GMAX server (AVX-512 EPYC, the demo's normal phase,
then its burst), replaying its 3 105 logged steps through both fits: the unconstrained, clipped fit over
the window alone put a full batch of 32 at 168-177 ms and a lone request at 47-56 ms during the burst
(measured: about 32 ms and 9-10 ms); in that machine's first demo, admission refused three deadline
requests of the normal phase (0.7× capacity), priced at 30.5-32.5 s for at most 192 tokens against a
20 s deadline (at least 150 ms per token alone: such a fit), where stock vLLM met every one. The fit
kept here stayed at 26-37 ms and 7-13 ms throughout, and its error on the next step's time fell from
0.54 to 0.20 (mean relative error, batches of 16-32) and from 0.24 to 0.23 (batches of 1-3).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

from jitflow_server.scheduler.admission import ServiceRate
from jitflow_server.scheduler.types import TokenTimeModel

#: Columns of one entry of the engine's step log (``JitflowScheduler.step_log``,
#: ``GET /v1/jitflow/engine/steps``, ``steps.json``): unix time (s), period since the previous step
#: (s; None after idle), model execution (s), decoding requests, prefill tokens, summed context of
#: the decodes (tokens), coefficient of variation of the batch's context lengths.
STEP_FIELDS = ("t", "period_s", "forward_s", "n_decode", "prefill_tokens", "ctx_decode_tokens", "ctx_cv")

#: Steps of one batch size kept aside after they leave the window (module docstring).
STRATUM_STEPS = 8

#: The kept steps join the fit only while the window's batch sizes span less than this share of its largest.
NARROW_SPAN = 0.25


class StepTimeTracker:
    """Sliding-window model of engine step time (seconds) from measured steps.

    Args:
        window: number of recent steps kept (``ValueError`` below 1).
        default_token_time: seconds per decode step used before any measurement.
        default_prefill_rate: prefill tokens per second used before any measurement.
    """

    def __init__(self, window: int = 512, default_token_time: float = 0.035,
                 default_prefill_rate: float = 2000.0) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        # the window's steps as numpy rows in a ring (1, n_decode, prefill_tokens, duration, period or NaN):
        # refitting from Python objects rebuilt a 512-row array at every frame (3 s of a 40 s simulation)
        self._ring = np.zeros((window, 5))
        self._next = 0
        # the last STRATUM_STEPS steps of each decoding batch size that left the window: one block of rows
        # per size in the order first seen (zero rows fit nothing)
        self._strata = np.zeros((0, 5))
        self._stratum_sizes = np.zeros(0, dtype=np.int64)
        self._stratum_slot: dict[int, int] = {}
        self._stratum_fill: list[int] = []
        self.default_token_time = default_token_time
        self.default_prefill_rate = default_prefill_rate
        self._coef: tuple[float, float, float] | None = None
        self._wall = 1.0
        self._dirty = False
        self._model: TokenTimeModel | None = None
        self._model_dirty = True

    def record(self, duration: float, n_decode: int, prefill_tokens: int, period: float | None = None) -> None:
        """Add one measured step (``duration`` s of model execution, ignored if not positive; ``period`` s of
        wall time since the previous step, if known)."""
        if duration > 0:
            i = self._next % len(self._ring)
            if self._next >= len(self._ring):
                self._set_aside(self._ring[i].copy())
            self._ring[i] = (1.0, n_decode, prefill_tokens, duration, np.nan if period is None else period)
            self._next += 1
            self._dirty = self._model_dirty = True

    def record_run(self, durations: list[float], n_decode: int, prefill_tokens: int) -> None:
        """Add steps that ran back to back with one plan (the simulator's macro-step): each step's period
        is its own duration, as the plug-in would measure it between two steps of a busy engine. Only the
        last ``window`` of them can stay in the window, so only those are recorded."""
        for d in durations[-len(self._ring):]:
            self.record(d, n_decode, prefill_tokens, d)

    def _set_aside(self, row: np.ndarray) -> None:
        """A step leaving the window: it becomes one of its batch size's kept steps."""
        n = int(row[1])
        slot = self._stratum_slot.get(n)
        if slot is None:
            slot = self._stratum_slot[n] = len(self._stratum_fill)
            self._stratum_fill.append(0)
            self._strata = np.concatenate((self._strata, np.zeros((STRATUM_STEPS, 5))))
            self._stratum_sizes = np.append(self._stratum_sizes, n)
        self._strata[slot * STRATUM_STEPS + self._stratum_fill[slot] % STRATUM_STEPS] = row
        self._stratum_fill[slot] += 1

    def _absent_strata(self, window: np.ndarray) -> np.ndarray:
        """The kept steps of the batch sizes ``window`` (the ring's rows) holds no step of."""
        absent = ~np.isin(self._stratum_sizes, window[:, 1])
        return self._strata[np.repeat(absent, STRATUM_STEPS)]

    @property
    def n_samples(self) -> int:
        """Steps in the window (at most ``window``)."""
        return min(self._next, len(self._ring))

    def wall_factor(self) -> float:
        """How much longer a decoding request waits per token than the fit of model execution says (≥ 1):
        ``Σ period / Σ (a + b·n_decode)`` over the window's steps with decodes and a known period. It
        covers the scheduler's own time between steps and the prefill chunks of other requests that
        lengthen the steps a request decodes in. Measured on the demo model at B = 16: 1.12 (a fitted
        0.031 s per full-batch step against 0.035 s between steps); about 3 on the same engine under the
        mixed workload at 6 requests/s, where prefill is two thirds of the model time. The simulator
        records each step's duration as its period (its steps run back to back), so a policy sees the
        same figure there as on the plug-in; 1 where no period is recorded."""
        self._fit()
        return self._wall

    def _fit(self) -> tuple[float, float, float] | None:
        if not self._dirty:
            return self._coef
        self._dirty = False
        if self.n_samples < 8:
            return self._coef
        size = len(self._ring)
        cut = self._next % size
        rows = self._ring if self._next <= size else np.concatenate((self._ring[cut:], self._ring[:cut]))
        rows = rows[: self.n_samples]  # oldest first
        sizes = rows[rows[:, 1] > 0, 1]  # decoding steps' batch sizes
        narrow = not sizes.size or sizes.max() - sizes.min() < NARROW_SPAN * sizes.max()
        # the kept steps come from another time (another context per request, another load on the host): they
        # join only a window too narrow to fix the slope itself
        fit = np.concatenate((rows, self._absent_strata(rows))) if narrow and len(self._strata) else rows
        # non-negative least squares: fitting freely and clipping a negative coefficient afterwards left
        # the others fitted to it (module docstring); nnls is also faster than lstsq here (9 against 18 µs for 700 steps)
        coef, _ = nnls(fit[:, :3], fit[:, 3])
        a, b, c = (float(v) for v in coef)
        self._coef = a, b, _c = (max(a, 1e-4), b, c)
        walled = rows[~np.isnan(rows[:, 4]) & (rows[:, 1] > 0)]
        if len(walled) >= 8:
            self._wall = max(1.0, float(walled[:, 4].sum() / (a + b * walled[:, 1]).sum()))
        return self._coef

    def _median_duration(self) -> float:
        """Median measured step (s) over the window (the ring's duration column; order does not matter)."""
        col = self._ring[: self.n_samples, 3]
        lo, hi = (len(col) - 1) // 2, len(col) // 2
        part = np.partition(col, (lo, hi))  # np.median's result (mean of the middle two) at a third of its cost
        return float((part[lo] + part[hi]) / 2.0)

    def step_time(self, n_decode: int, prefill_tokens: int = 0) -> float:
        """Predicted step time (s) for a batch of ``n_decode`` decoding requests plus prefill tokens."""
        coef = self._fit()
        if coef is None:
            return self.default_token_time * max(1.0, n_decode / 32) + prefill_tokens / self.default_prefill_rate
        a, b, _c = coef
        # prefill_rate(): c = 0 means the window held no prefill to fit it from, not free prefill
        return a + b * n_decode + prefill_tokens / self.prefill_rate()

    def token_time(self, batch: int) -> float:
        """``v_token``: seconds for one request to get one token when ``batch`` requests decode together: the
        fitted step times :meth:`wall_factor` (wall time, not only model execution).

        Never below half the median measured step: a least-squares fit over few or similar samples can
        extrapolate to ~0, which would make GMAX's frames (Δ·v_token) vanishingly short.
        """
        model = self.token_time_model()
        if model is not None:
            return model.token_time(batch)
        return self.step_time(max(batch, 1)) * self.wall_factor()

    def token_time_model(self) -> TokenTimeModel | None:
        """:meth:`token_time` as a line in the batch size, ``(a + b·k)·wall_factor`` floored at half the
        median measured step (for policies that choose the batch size, and for :meth:`token_time`), or
        ``None`` before 8 steps were measured."""
        if not self._model_dirty:  # kept until the next step is recorded (policies ask several times a frame)
            return self._model
        self._model_dirty = False
        coef = self._fit()
        if coef is None or self.n_samples < 8:
            self._model = None
        else:
            a, b, _c = coef
            w = self.wall_factor()
            self._model = TokenTimeModel(a * w, b * w, 0.5 * self._median_duration())
        return self._model

    def prefill_rate(self) -> float:
        """Prefill throughput (tokens/s) implied by the fit (default before measurements)."""
        coef = self._fit()
        if coef is None or coef[2] <= 0:
            return self.default_prefill_rate
        return 1.0 / coef[2]

    def service_rate(self, batch_size: int) -> ServiceRate | None:
        """The step model as a :class:`~jitflow_server.scheduler.admission.ServiceRate` for deadline
        admission, or ``None`` before 8 steps were measured (admission then falls back to the waiting
        time alone)."""
        coef = self._fit()
        if coef is None or self.n_samples < 8:
            return None
        a, b, c = coef
        b_max = max(int(batch_size), 1)
        return ServiceRate(base_s=a, per_decode_s=b, per_prefill_token_s=c, wall_factor=self._wall,
                           min_step_s=0.5 * self._median_duration(), batch_size=b_max,
                           decode_batch=self.decode_batch(b_max), lone_step_s=self.lone_step())

    def lone_step(self) -> float | None:
        """The fastest wall time (s) between two decoding steps in the window: the 5th percentile of the
        measured periods of the steps that decode (their durations where no period is known), ``None``
        when none decodes. A request decoding alone takes no longer per token (``ServiceRate.lone_step_s``)."""
        rows = self._ring[: self.n_samples]
        rows = rows[rows[:, 1] > 0]
        if not len(rows):
            return None
        wall = rows[:, 4]
        t = np.where(np.isnan(wall), rows[:, 3], wall)
        return float(np.percentile(t, 5))

    def decode_batch(self, batch_size: int) -> int | None:
        """The 90th percentile of the decoding requests per step over the window's steps that decode (at
        most ``batch_size``), or ``None`` when none of them decodes: how many requests the engine runs
        together when it is busy, where its fit was measured."""
        n = self._ring[: self.n_samples, 1]
        n = n[n > 0]
        if not n.size:
            return None
        return int(min(max(round(float(np.percentile(n, 90))), 1), batch_size))

    def summary(self) -> dict:
        """Plain-dict view (for RPC/metrics): samples, fitted coefficients, token time at 1/8/32."""
        coef = self._fit()
        return {
            "samples": self.n_samples,
            "coef": list(coef) if coef else None,
            "token_time_b1": self.token_time(1),
            "token_time_b8": self.token_time(8),
            "token_time_b32": self.token_time(32),
            "wall_factor": self.wall_factor(),
            "prefill_rate": self.prefill_rate(),
        }
