"""SLO tracker: step-time model from measured steps."""

from __future__ import annotations

import pytest

from jitflow_server.tracker.steps import StepTimeTracker


def test_fit_recovers_a_linear_step_model():
    tr = StepTimeTracker()
    for n in range(1, 33):
        for pre in (0, 512):
            tr.record(0.005 + 0.001 * n + 0.0002 * pre, n, pre)
    assert tr.token_time(32) == pytest.approx(0.005 + 0.032, rel=1e-6)
    assert tr.prefill_rate() == pytest.approx(1 / 0.0002, rel=1e-6)


def test_token_time_never_collapses_when_extrapolating():
    tr = StepTimeTracker()
    for _ in range(10):  # steep slope, negative intercept: the fit extrapolates to ~0 at small batches
        tr.record(0.010, 10, 0)
        tr.record(0.030, 20, 0)
    assert tr.step_time(2) < 0.005  # what the raw fit says
    assert tr.token_time(2) >= 0.01  # floored at half the median measured step (0.02 s)


def test_defaults_before_measurements():
    tr = StepTimeTracker(default_token_time=0.03, default_prefill_rate=1000.0)
    assert tr.token_time(8) == pytest.approx(0.03)
    assert tr.prefill_rate() == 1000.0


def test_the_window_slides_and_the_fit_matches_a_fresh_least_squares_fit():
    import numpy as np

    rng = np.random.default_rng(0)
    tr = StepTimeTracker(window=64)
    rows = []
    for i in range(200):  # slides over the window three times; the model drifts so old steps must go
        n, pre = int(rng.integers(1, 33)), int(rng.integers(0, 2)) * 256
        dur = (0.01 if i < 100 else 0.03) + 0.001 * n + 0.0001 * pre + float(rng.normal(0, 1e-4))
        tr.record(dur, n, pre, period=dur * 1.1)
        rows.append((1.0, n, pre, dur))
    last = np.array(rows[-64:])
    coef = np.linalg.lstsq(last[:, :3], last[:, 3], rcond=None)[0]
    assert tr.step_time(10, 256) == pytest.approx(coef[0] + 10 * coef[1] + 256 * coef[2], rel=1e-9)
    a, b = max(coef[0], 1e-4), max(coef[1], 0.0)
    assert tr.wall_factor() == pytest.approx(1.1 * last[:, 3].sum() / (a + b * last[:, 1]).sum(), rel=1e-9)
    model = tr.token_time_model()
    assert model is not None and model.floor_s == pytest.approx(0.5 * float(np.median(last[:, 3])), rel=1e-12)
    tr.record(0.5, 32, 0)  # a new step replaces the cached model
    assert tr.token_time_model() is not model


def test_a_window_of_no_steps_is_refused():
    with pytest.raises(ValueError, match="window"):
        StepTimeTracker(window=0)
