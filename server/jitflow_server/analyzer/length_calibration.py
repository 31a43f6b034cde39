"""Length bounds at serving time: finalising a raw bound, the online calibrator that keeps coverage at q,
and the running-quantile fallback used before a model exists (JITServe §4.1)."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence

import numpy as np

#: Default target coverage q of the bounds.
DEFAULT_QUANTILE = 0.9
#: k-buckets of the online calibrator (a bound issued at k uses the bucket of the largest edge <= k).
CALIBRATION_BUCKETS: tuple[int, ...] = (0, 50, 100, 200, 400)
#: Bound used by the fallback when nothing has been observed yet and the request has no max_tokens.
DEFAULT_FALLBACK_TOKENS = 1024


def finalize_bound(raw: float, k: int, max_tokens: int | None) -> int:
    """Turn a raw bound (float tokens) into the served bound: ceil, cap by ``max_tokens``, never below ``k``.

    Result ``>= k + 1`` while ``k < max_tokens`` (the request is still running), ``<= max_tokens``.
    """
    b = int(math.ceil(raw)) if math.isfinite(raw) else (max_tokens or DEFAULT_FALLBACK_TOKENS)
    floor = k + 1
    if max_tokens is not None and max_tokens > 0:
        b = min(b, int(max_tokens))
        floor = min(floor, int(max_tokens))
    return max(b, floor, 1)


# --------------------------------------------------------------------------------------------------
# Online calibration and fallback
# --------------------------------------------------------------------------------------------------


def calibration_bucket(k: int) -> int:
    """Calibration bucket of a bound issued after ``k`` generated tokens (largest edge <= k)."""
    b = 0
    for edge in CALIBRATION_BUCKETS:
        if k >= edge:
            b = edge
    return b


class OnlineCalibrator:
    """Adaptive conformal inference on the bound, per (app, kind, model, k-bucket). Thread-safe.

    The served bound is ``raw · exp(θ_g · spread)``, where ``spread`` is the predictor's own
    ``log(bound / median)`` for that request (:meth:`LengthPredictor.predict_bounds`; 1.0 for a
    predictor without spreads): offsets are normalised conformal scores, so a request the forest is
    sure of moves less than one it is not. After each finished request, for every bound it was issued
    (one per k-bucket), ``θ_g ← θ_g + γ·(1[len > bound] − (1 − q))`` (Gibbs & Candès 2021, online
    quantile tracking): the long-run miss rate of every group tends to ``1 − q`` whatever the
    distribution shift, with error ``O(1/(γT))``. A new group starts from the θ of the global group of
    its k-bucket (which is updated by every observation), so an unseen model/app/kind inherits what was
    learned so far. ``step`` γ is in spread units (0.05 ≈ 5 % of the spread).

    Why not a conformal library: crepes' Mondrian ``ConformalRegressor`` gives per-group bounds, but by
    split conformal over an exchangeable calibration set; it does not track a shifting distribution
    (a new application, a new model), and refitting it per observation costs 0.3 ms at 1 000 residuals
    and 1.2 ms at 10 000 (crepes 0.9.1, measured on the 2-core Xeon) where the update here is one addition.
    MAPIE's adaptive conformal inference (its time-series regressor) wraps one estimator over one series,
    with no groups and no k-buckets. The method here is the ACI update itself, a few lines.
    """

    def __init__(self, quantile: float = DEFAULT_QUANTILE, step: float = 0.05, max_abs: float = 3.0) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        if step <= 0:
            raise ValueError("step must be > 0")
        self.quantile = quantile
        self.step = step
        self.max_abs = max_abs
        self._theta: dict[tuple[str, str, str, int], float] = {}
        self._n: dict[tuple[str, str, str, int], int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(app: str | None, model: str | None, k: int, kind: str | None) -> tuple[str, str, str, int]:
        return (str(app) if app is not None else "", str(kind) if kind is not None else "",
                str(model) if model is not None else "", calibration_bucket(k))

    def theta(self, app: str | None, model: str | None, k: int, *, kind: str | None = None) -> float:
        """Current offset of the group, in spread units (inherits the global one for an unseen group)."""
        key = self._key(app, model, k, kind)
        with self._lock:
            if key in self._theta:
                return self._theta[key]
            return self._theta.get(("*", "*", "*", key[3]), 0.0)

    def factor(self, app: str | None, model: str | None, k: int, *, kind: str | None = None,
               spread: float = 1.0) -> float:
        """Multiplicative factor ``exp(θ · spread)`` applied to the raw bound (``spread`` in log units)."""
        return math.exp(self.theta(app, model, k, kind=kind) * spread)

    def update(self, app: str | None, model: str | None, k: int, issued_bound: float, true_len: int, *,
               kind: str | None = None) -> None:
        """Record that a bound ``issued_bound`` (as served, tokens) given after ``k`` tokens saw ``true_len``."""
        miss = 1.0 if true_len > issued_bound else 0.0
        delta = self.step * (miss - (1.0 - self.quantile))
        key = self._key(app, model, k, kind)
        gkey = ("*", "*", "*", key[3])
        with self._lock:
            g = self._theta.get(gkey, 0.0)
            cur = self._theta.get(key, g)
            self._theta[key] = float(np.clip(cur + delta, -self.max_abs, self.max_abs))
            self._n[key] = self._n.get(key, 0) + 1
            if key != gkey:
                self._theta[gkey] = float(np.clip(g + delta, -self.max_abs, self.max_abs))
                self._n[gkey] = self._n.get(gkey, 0) + 1

    def observe(self, app: str | None, model: str | None, issued: Sequence[tuple[int, float]], true_len: int, *,
                kind: str | None = None) -> None:
        """A request finished with ``true_len`` tokens; ``issued`` are the ``(k, served bound)`` pairs it was
        given, in issue order. :meth:`update` runs once per k-bucket, with the first bound of the bucket
        issued below ``true_len`` (later refinements in the same bucket would count one request twice)."""
        seen: set[int] = set()
        for k, bound in issued:
            bucket = calibration_bucket(k)
            if bucket in seen or k >= true_len:
                continue
            seen.add(bucket)
            self.update(app, model, k, bound, true_len, kind=kind)

    def state(self) -> dict[str, dict[str, float]]:
        """Snapshot ``{"app|kind|model|bucket": {"theta", "n"}}`` (for metrics/debugging)."""
        with self._lock:
            return {"|".join(map(str, k)): {"theta": v, "n": self._n.get(k, 0)} for k, v in self._theta.items()}


#: A truncated observation in :class:`RunningQuantileFallback`: longer than any bound (capped by ``max_tokens``).
CENSORED = 2**31 - 1


class RunningQuantileFallback:
    """Bound without a model: running q-quantile of observed lengths per app, capped by ``max_tokens``.

    Keeps the last ``window`` observed total lengths per app (and overall). For a request after
    ``k`` tokens the bound is the q-quantile of the app's observed lengths that exceed ``k`` (the
    overall history if the app has fewer than ``min_count`` of them), capped by ``max_tokens``;
    with no history, ``max_tokens`` or :data:`DEFAULT_FALLBACK_TOKENS`. Never below ``k + 1``.
    Thread-safe.
    """

    def __init__(self, quantile: float = DEFAULT_QUANTILE, window: int = 2000, min_count: int = 20,
                 default_tokens: int = DEFAULT_FALLBACK_TOKENS) -> None:
        self.quantile = quantile
        self.window = window
        self.min_count = min_count
        self.default_tokens = default_tokens
        self._hist: dict[str, deque[int]] = {}
        self._cache: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()

    def observe(self, app: str | None, output_len: int, *, truncated: bool = False) -> None:
        """Record one finished request's total output length (tokens). A ``truncated`` response (cut off at
        its ``max_tokens``) only says the answer was at least that long: it is kept as "longer than
        anything" (censored), so a client sending many short-capped requests cannot pull the bound of
        everyone else's requests down (measured: 10 000 requests capped at 8 tokens made the bound of
        128-token requests 37 and deadline admission admitted 3× too much work)."""
        n = CENSORED if truncated else int(output_len)
        with self._lock:
            for key in {str(app), "*"}:
                self._hist.setdefault(key, deque(maxlen=self.window)).append(n)
            self._cache.clear()

    def _q(self, key: str, k: int) -> float | None:
        ck = (key, int(k) // 50 * 50)
        if ck in self._cache:
            return self._cache[ck]
        hist = self._hist.get(key)
        val = None
        if hist:
            arr = np.fromiter(hist, dtype=np.int64)
            arr = arr[arr > ck[1]]
            if len(arr) >= self.min_count:
                val = float(np.quantile(arr, self.quantile, method="higher"))
        self._cache[ck] = val
        return val

    def bound(self, app: str | None, k: int = 0, max_tokens: int | None = None) -> int:
        """Fallback bound (int tokens) for a request of ``app`` after ``k`` generated tokens."""
        with self._lock:
            q = self._q(str(app), k)
            if q is None:
                q = self._q("*", k)
        if q is None or q >= CENSORED:
            q = float(max_tokens) if max_tokens else float(self.default_tokens)
        return finalize_bound(q, k, max_tokens)
