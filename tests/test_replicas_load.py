"""`jitflow bench replicas-real --load`: the offered load sized from a replica's measured output rate."""

from __future__ import annotations

import pytest

from jitflow_server.bench.replicas_real import counter_rate, rps_for_load
from jitflow_server.bench.workload import make_workload


def _output_tokens_per_s(jobs, rps: float) -> float:
    return rps * sum(j.total_tokens[1] for j in jobs) / len(jobs)


def test_the_load_offers_that_multiple_of_the_replica_rate_in_output_tokens():
    jobs = make_workload(400, 1.0, seed=3, length_scale=0.25)
    for load, rate in ((1.0, 400.0), (1.5, 400.0), (2.0, 180.0)):
        rps = rps_for_load(load, rate, jobs)
        assert _output_tokens_per_s(jobs, rps) == pytest.approx(load * rate)


def test_longer_jobs_get_fewer_requests_per_second_at_the_same_load():
    short = make_workload(400, 1.0, seed=3, length_scale=0.0625)
    long = make_workload(400, 1.0, seed=3, length_scale=0.25)
    assert rps_for_load(1.5, 400.0, long) < rps_for_load(1.5, 400.0, short)


@pytest.mark.parametrize("load, rate, n", [(0.0, 400.0, 10), (1.0, 0.0, 10), (1.0, 400.0, 0)])
def test_a_load_it_cannot_size_is_refused(load, rate, n):
    jobs = make_workload(n, 1.0, seed=3) if n else []
    with pytest.raises(ValueError):
        rps_for_load(load, rate, jobs)


def test_a_counter_rate_is_taken_over_the_window_between_its_bracketing_samples():
    samples = [(0.0, 0.0), (1.0, 10.0), (2.0, 50.0), (3.0, 90.0), (4.0, 100.0)]
    assert counter_rate(samples, 1.0, 3.0) == pytest.approx(40.0)  # (90 - 10) / 2: the busy middle only
    assert counter_rate(samples, 1.5, 2.5) == pytest.approx(40.0)  # brackets 1.0 .. 3.0
    assert counter_rate(samples, -5.0, 9.0) == pytest.approx(25.0)  # clipped to the samples there are


@pytest.mark.parametrize("samples, lo, hi", [([(0.0, 1.0)], 0.0, 1.0), ([(0.0, 1.0), (1.0, 2.0)], 2.0, 1.0),
                                             ([(0.0, 1.0), (1.0, 2.0)], 5.0, 9.0)])
def test_a_counter_rate_it_cannot_take_is_refused(samples, lo, hi):
    with pytest.raises(ValueError):
        counter_rate(samples, lo, hi)
