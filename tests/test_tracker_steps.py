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
