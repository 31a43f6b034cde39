"""Online adaptation of the cutoff p from measured goodput (JITServe §4.2)."""

from __future__ import annotations

import pytest

from jitflow_server.scheduler import CutoffAdapter, GMAXPolicy, Kind, RequestView, SchedContext


def drive(policy: GMAXPolicy, signal, n_finished: int) -> tuple[list[float], list[float]]:
    """Feed ``n_finished`` finished requests whose goodput is ``signal(p in use)``.

    Returns (p in use before each finish, incumbent p after each finish)."""
    used, incumbent = [], []
    for k in range(n_finished):
        p = policy.p
        used.append(p)
        policy.on_finished(f"r{k}", signal(p), now=float(k))
        incumbent.append(policy.adapter.p)
    return used, incumbent


@pytest.mark.parametrize("peak", [0.8, 1.0, 0.6])
def test_p_converges_to_the_value_with_the_best_goodput(peak):
    def signal(p: float) -> float:
        return 1000.0 - 10000.0 * (p - peak) ** 2

    pol = GMAXPolicy(p=0.95, p_step=0.05, p_min=0.5, adapt_epoch=5)
    used, incumbent = drive(pol, signal, 400)
    assert pol.adapter.p == pytest.approx(peak)
    # the incumbent only ever moves toward the peak ("keep the better")
    dist = [abs(p - peak) for p in incumbent]
    assert all(b <= a + 1e-9 for a, b in zip(dist, dist[1:], strict=False))
    assert min(used) >= 0.5 - 1e-9 and max(used) <= 1.0 + 1e-9


def test_p_stays_when_neighbours_are_worse():
    pol = GMAXPolicy(p=0.9, p_step=0.05, adapt_epoch=4)
    drive(pol, lambda p: 500.0 - 1000.0 * abs(p - 0.9), 120)
    assert pol.adapter.p == pytest.approx(0.9)


def test_adaptation_disabled_keeps_p():
    pol = GMAXPolicy(p=0.9, adapt_p=False, adapt_epoch=2)
    drive(pol, lambda p: 1000.0 * p, 50)
    assert pol.p == 0.9


def test_schedule_uses_the_cutoff_under_trial():
    pol = GMAXPolicy(p=0.95, adapt_epoch=1)
    pol.on_finished("x", 10.0, 0.0)  # first trial (the incumbent) done -> now exploring p - step
    views = [RequestView("a", Kind.DEADLINE, 0.0, 10, 0, 10, False, deadline=100.0)]
    d = pol.schedule(views, SchedContext(now=1.0, batch_size=1, token_time=0.01, prefill_rate=1e4))
    assert d.info["p"] == pytest.approx(0.90)


def test_adapter_rejects_bad_parameters():
    with pytest.raises(ValueError):
        CutoffAdapter(p0=0.0)
    with pytest.raises(ValueError):
        CutoffAdapter(epoch=0)
