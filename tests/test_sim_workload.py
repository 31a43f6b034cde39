"""Benchmark workloads (bench/workload.py): kind mix, arrivals, SLOs, trace replay."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jitflow_server.bench.workload import (
    DataSources,
    WorkloadError,
    arrival_times,
    make_workload,
    parse_mix,
    workload_summary,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_default_mix_is_one_to_one_to_one():
    jobs = make_workload(300, 5.0, seed=1)
    s = workload_summary(jobs)
    assert (s["latency"], s["deadline"], s["compound"]) == (100, 100, 100)
    kinds = [j.kind for j in jobs[:60]]
    assert len(set(kinds)) == 3  # shuffled, not in blocks


def test_custom_mix_and_rounding():
    s = workload_summary(make_workload(101, 5.0, mix=parse_mix("2:1:1"), seed=2))
    assert s["latency"] + s["deadline"] + s["compound"] == 101
    assert s["latency"] in (50, 51) and s["deadline"] in (25, 26) and s["compound"] in (25, 26)
    s0 = workload_summary(make_workload(40, 5.0, mix=parse_mix("0:1:0"), seed=2))
    assert s0["deadline"] == 40


@pytest.mark.parametrize("bad", ["1:1", "a:b:c", "0:0:0", "-1:1:1"])
def test_bad_mix_is_rejected(bad):
    with pytest.raises(WorkloadError):
        parse_mix(bad)


def test_slos_follow_the_paper_and_tightness():
    jobs = make_workload(90, 5.0, seed=3, tightness=1.5)
    for j in jobs:
        if j.kind == "latency":
            assert j.ttft == pytest.approx(3.0) and j.tbt == pytest.approx(0.15)
        elif j.kind == "deadline":
            assert j.deadline == pytest.approx(30.0)
        else:
            assert j.deadline == pytest.approx(30.0 * len(j.stages))
            assert len(j.stages) >= 3


def test_poisson_rate_matches_target():
    t = arrival_times(20000, 7.0, "poisson", np.random.default_rng(0), DataSources())
    assert np.all(np.diff(t) >= 0)
    assert (len(t) - 1) / t[-1] == pytest.approx(7.0, rel=0.03)


def test_length_scale_and_context_cap():
    jobs = make_workload(60, 5.0, seed=4, length_scale=0.5, max_context=300)
    for j in jobs:
        for st in j.stages:
            for c in st:
                assert c.input_len >= 1 and c.output_len >= 1
                assert c.input_len + c.output_len <= 300


def test_bad_parameters():
    with pytest.raises(WorkloadError):
        make_workload(10, 0.0)
    with pytest.raises(WorkloadError):
        make_workload(10, 1.0, arrivals="uniform")
    with pytest.raises(WorkloadError):
        make_workload(10, 1.0, arrivals="azure", data=DataSources())  # no trace loaded
    with pytest.raises(WorkloadError):
        make_workload(10, 1.0, compound_apps=("nope",))


@pytest.mark.skipif(not DATA.is_dir(), reason="shared data not present")
def test_azure_replay_rescales_to_target_rps_and_uses_trace_lengths():
    ds = DataSources.load(DATA)
    assert ds.azure_times is not None and ds.pairs is not None and ds.deepresearch
    for rps in (0.5, 3.0, 12.0):
        t = arrival_times(3000, rps, "azure", np.random.default_rng(1), ds)
        assert (len(t) - 1) / (t[-1] - t[0]) == pytest.approx(rps, rel=1e-9)
        gaps = np.diff(t)
        assert gaps.std() / gaps.mean() > 1.0  # bursty like the trace, unlike a uniform spacing
    jobs = make_workload(60, 2.0, arrivals="azure", data=ds, seed=5)
    pairs = {tuple(p) for p in ds.pairs.tolist()}
    singles = [j for j in jobs if j.kind != "compound"]
    assert singles and all((j.stages[0][0].input_len, j.stages[0][0].output_len) in pairs for j in singles)
    dr = [j for j in jobs if j.app == "deep-research"]
    history = {str(t) for t in ds.deepresearch_history}
    assert dr and all(str([[(c.input_len, c.output_len) for c in s] for s in j.stages]) not in history for j in dr)
