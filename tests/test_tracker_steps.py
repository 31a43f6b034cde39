"""SLO tracker: step-time model from measured steps."""

from __future__ import annotations

import pytest

from jitflow_server.tracker.steps import NARROW_SPAN, STRATUM_STEPS, StepTimeTracker


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


def test_the_window_slides_and_the_fit_matches_a_fresh_non_negative_fit():
    import numpy as np
    from scipy.optimize import nnls

    rng = np.random.default_rng(0)
    tr = StepTimeTracker(window=64)
    rows = []
    for i in range(200):  # slides over the window three times; the model drifts so old steps must go
        n = int(rng.integers(1, 33)) if i < 150 else int(rng.integers(1, 9))
        pre = int(rng.integers(0, 2)) * 256
        dur = (0.01 if i < 100 else 0.03) + 0.001 * n + 0.0001 * pre + float(rng.normal(0, 1e-4))
        tr.record(dur, n, pre, period=dur * 1.1)
        rows.append((1.0, n, pre, dur))
    last = np.array(rows[-64:])
    fit = last  # the last 64 steps decode 1-8 requests: wide enough to fix the slope, no kept step joins
    coef = nnls(fit[:, :3], fit[:, 3])[0]
    assert tr.step_time(10, 256) == pytest.approx(coef[0] + 10 * coef[1] + 256 * coef[2], rel=1e-9)
    a, b = max(coef[0], 1e-4), coef[1]
    assert tr.wall_factor() == pytest.approx(1.1 * last[:, 3].sum() / (a + b * last[:, 1]).sum(), rel=1e-9)
    model = tr.token_time_model()
    assert model is not None and model.floor_s == pytest.approx(0.5 * float(np.median(last[:, 3])), rel=1e-12)
    tr.record(0.5, 32, 0)  # a new step replaces the cached model
    assert tr.token_time_model() is not model


def test_a_narrow_window_is_fitted_with_the_kept_steps_of_the_sizes_it_lacks():
    """A window whose decoding batch sizes span less than NARROW_SPAN of the largest: the last STRATUM_STEPS
    steps of every size that left it join the fit, exactly as a fresh non-negative fit over both."""
    import numpy as np
    from scipy.optimize import nnls

    rng = np.random.default_rng(3)
    tr = StepTimeTracker(window=64)
    rows = []
    for i in range(200):  # every size first, then a burst held at 30-32 for longer than the window
        n = int(rng.integers(1, 17)) if i < 120 else int(rng.integers(30, 33))
        pre = int(rng.integers(0, 2)) * 128
        dur = 0.01 + 0.001 * n + 0.0001 * pre + float(rng.normal(0, 1e-4))
        tr.record(dur, n, pre)
        rows.append((1.0, n, pre, dur))
    last = np.array(rows[-64:])
    assert last[:, 1].max() - last[:, 1].min() < NARROW_SPAN * last[:, 1].max()
    gone: dict[float, list] = {}
    for r in rows[:-64]:
        gone.setdefault(r[1], []).append(r)
    kept = [r for n, rs in gone.items() if n not in set(last[:, 1]) for r in rs[-STRATUM_STEPS:]]
    assert kept  # sizes 1-16 come from the kept steps
    fit = np.array(list(last) + kept)
    coef = nnls(fit[:, :3], fit[:, 3])[0]
    assert tr.step_time(10, 128) == pytest.approx(coef[0] + 10 * coef[1] + 128 * coef[2], rel=1e-9)
    window_only = nnls(last[:, :3], last[:, 3])[0]
    assert not np.allclose(coef, window_only)  # the kept steps did change the fit


def test_a_window_held_at_one_batch_size_keeps_the_slope():
    """A burst holds the batch at its maximum for longer than the window: the window alone cannot tell
    the per-step base from the per-request cost, and the lone-request and full-batch step times it
    implied were off by several times (module docstring). The steps of the sizes seen before keep them.
    (The host runs as fast in both phases here; a host that slowed down between them tilts the slope.)"""
    import numpy as np

    rng = np.random.default_rng(1)

    def true_step(n: int, pre: int) -> float:
        return 0.008 + 0.0008 * n + 0.0004 * pre

    tr = StepTimeTracker(window=512)
    for _ in range(300):  # a light phase: every batch size
        n = int(rng.integers(1, 33))
        pre = int(rng.choice([0, 0, 0, 64, 200]))
        tr.record(true_step(n, pre) * float(rng.uniform(0.6, 1.8)), n, pre)
    for _ in range(1500):  # the burst: full batches with an occasional prefill chunk, a noisy host
        n = int(rng.choice([30, 31, 32, 32, 32]))
        pre = int(rng.choice([0] * 9 + [int(rng.integers(16, 400))]))
        tr.record(true_step(n, pre) * float(rng.uniform(0.6, 1.8)), n, pre)
    assert tr.step_time(32) == pytest.approx(true_step(32, 0) * 1.2, rel=0.15)  # noise mean 1.2
    assert tr.step_time(1) == pytest.approx(true_step(1, 0) * 1.2, rel=0.3)
    assert tr.prefill_rate() == pytest.approx(1 / (0.0004 * 1.2), rel=0.3)


def test_fitted_costs_are_never_negative():
    tr = StepTimeTracker()
    for _ in range(20):  # the longer steps decode fewer requests: a free fit has a negative slope
        tr.record(0.030, 8, 0)
        tr.record(0.020, 16, 0)
    a, b, c = tr.summary()["coef"]
    assert a > 0 and b >= 0 and c >= 0
    assert tr.step_time(12) == pytest.approx(0.025, rel=0.01)  # the best non-negative fit: the mean


def test_a_window_of_no_steps_is_refused():
    with pytest.raises(ValueError, match="window"):
        StepTimeTracker(window=0)


def test_kept_steps_do_not_outweigh_a_window_that_measures_the_slope():
    """The kept steps of sizes the window lacks come from another time (another context, another load on
    the host): where the window holds several sizes and so fixes the slope itself, they must not tilt it."""
    def true_step(n: int) -> float:
        return 0.008 + 0.001 * n

    tr = StepTimeTracker(window=512)
    for i in range(600):  # earlier: large batches, each step twice as long as now
        tr.record(2 * true_step(17 + i % 16), 17 + i % 16, 0)
    for i in range(512):  # now: small batches only
        tr.record(true_step(1 + i % 16), 1 + i % 16, 0)
    assert tr.step_time(1) == pytest.approx(true_step(1), rel=0.1)
    assert tr.step_time(16) == pytest.approx(true_step(16), rel=0.1)
