"""φ(s) accumulated shares, the call-time model, sub-deadlines and their fallbacks."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from jitflow_server.analyzer.matcher import Matcher
from jitflow_server.analyzer.subdeadline import (
    DEFAULT_TIME_MODEL,
    CallTimeModel,
    call_time_model_from_rate,
    remaining_time,
    share_formulations,
    stage_share,
    stage_shares,
    stage_times,
    sub_deadline,
)
from jitflow_server.store.graph import CallNode, PatternGraph


def random_graph(rng: np.random.Generator, n_stages: int) -> PatternGraph:
    stages = [[(int(rng.integers(1, 5000)), int(rng.integers(0, 1024))) for _ in range(int(rng.integers(1, 4)))]
              for _ in range(n_stages)]
    return PatternGraph.from_stage_lengths("app", stages)


def test_token_time_model_gives_parallel_max_and_sequential_sum():
    tm = CallTimeModel(prefill_s_per_token=0.001, decode_s_per_token=0.01)
    g = PatternGraph.from_stage_lengths("app", [[(100, 10)], [(200, 20), (1000, 5)], [(50, 50)]])
    t = stage_times(g, tm)
    assert t[0] == pytest.approx(0.1 + 0.1)
    assert t[1] == pytest.approx(max(0.2 + 0.2, 1.0 + 0.05))  # parallel calls: the slowest
    assert t[2] == pytest.approx(0.05 + 0.5)


def test_recorded_times_take_precedence_over_the_token_model():
    calls = [
        CallNode("a", "llm", "m", 100, 10, start=0.0, end=2.0, stage=0),
        CallNode("b", "llm", "m", 100, 10, duration=3.0, parents=["a"], stage=1),
        CallNode("c", "tool", "t", duration=4.0, parents=["b"], stage=1),  # chained inside the stage
    ]
    g = PatternGraph.from_calls("app", calls)
    assert list(stage_times(g, CallTimeModel())) == pytest.approx([2.0, 7.0])


@pytest.mark.parametrize("seed", range(5))
def test_phi_is_monotone_and_reaches_one_at_the_last_stage(seed):
    rng = np.random.default_rng(seed)
    g = random_graph(rng, int(rng.integers(1, 9)))
    phi = stage_shares(g)
    assert len(phi) == g.n_stages
    assert all(b >= a for a, b in zip(phi, phi[1:], strict=False))
    assert phi[-1] == 1.0
    assert all(0.0 <= x <= 1.0 for x in phi)
    t = stage_times(g)
    assert phi[0] == pytest.approx(t[0] / t.sum())


def test_alternative_formulations_match_their_definitions():
    g = PatternGraph.from_stage_lengths("app", [[(0, 10)], [(0, 30)], [(0, 60)]])
    f = share_formulations(g, CallTimeModel(0.0, 1.0))
    assert list(f["accumulated"]) == pytest.approx([0.1, 0.4, 1.0])
    assert list(f["stage_over_total"]) == pytest.approx([0.1, 0.3, 0.6])
    assert list(f["stage_over_remaining"]) == pytest.approx([0.1, 30 / 90, 1.0])


@pytest.mark.parametrize("seed", range(4))
def test_sub_deadlines_are_absolute_times_inside_the_task_window(seed):
    rng = np.random.default_rng(100 + seed)
    hist = [random_graph(rng, 5) for _ in range(20)]
    m = Matcher.from_graphs(hist).match(hist[3].prefix(2, open_next=True))
    assert m is not None
    t0, d = 1.7e9 + float(rng.uniform(0, 1e4)), float(rng.uniform(1, 300))
    prev = t0
    for s in range(8):  # beyond the matched graph's length too
        dl = sub_deadline(m, s, t0, d)
        assert t0 <= dl <= t0 + d
        assert dl >= prev
        prev = dl
    assert sub_deadline(m, 4, t0, d) == pytest.approx(t0 + d)
    assert sub_deadline(m, 1, t0, d) == pytest.approx(t0 + m.shares()[1] * d)


def test_fallbacks_without_history():
    assert sub_deadline(None, 0, 10.0, 40.0, expected_stages=4) == pytest.approx(20.0)
    assert sub_deadline(None, 2, 10.0, 40.0, expected_stages=4) == pytest.approx(40.0)
    assert sub_deadline(None, 9, 10.0, 40.0, expected_stages=4) == pytest.approx(50.0)
    assert sub_deadline(None, 0, 10.0, 40.0) == pytest.approx(50.0)  # no depth estimate: no split
    g = PatternGraph.from_stage_lengths("app", [[(0, 0)], [(0, 0)]])
    assert stage_share(g, 0, time_model=CallTimeModel(0.0, 0.0)) == pytest.approx(0.5)  # zero-time graph


def test_invalid_arguments_raise():
    g = PatternGraph.from_stage_lengths("app", [[(1, 1)]])
    with pytest.raises(ValueError):
        sub_deadline(g, 0, 0.0, 0.0)
    with pytest.raises(ValueError):
        sub_deadline(g, -1, 0.0, 1.0)
    with pytest.raises(ValueError):
        sub_deadline(g, 0, math.nan, 1.0)
    with pytest.raises(ValueError):
        stage_share(None, 0, expected_stages=0)
    with pytest.raises(TypeError):
        stage_share("graph", 0)
    with pytest.raises(ValueError):
        CallTimeModel(-1.0, 1.0)
    with pytest.raises(ValueError):
        CallTimeModel.from_name("h100")
    assert CallTimeModel.from_name("1,20") == CallTimeModel(0.001, 0.02)
    assert CallTimeModel.from_name("a100-8b") == CallTimeModel.a100_8b()


def test_remaining_time_counts_only_later_stages():
    tm = CallTimeModel(0.0, 1.0)
    g = PatternGraph.from_stage_lengths("app", [[(0, 1)], [(0, 2)], [(0, 3)]])
    assert remaining_time(g, 0, time_model=tm) == pytest.approx(5.0)
    assert remaining_time(g, 2, time_model=tm) == 0.0
    assert remaining_time(None, 0) == 0.0


def test_the_call_time_model_follows_the_engines_measured_speed():
    """The decode time is the fit's model execution at the batch the engine decoded at (not extrapolated to
    B, no wall factor), floored at the fit's minimum step; the prefill time is the fit's, or the built-in
    prefill/decode ratio when the fit has none; without ``decode_batch`` nothing is derived."""
    from jitflow_server.scheduler.admission import ServiceRate

    rate = ServiceRate(base_s=0.01, per_decode_s=0.002, per_prefill_token_s=0.0004, wall_factor=1.5,
                       min_step_s=0.005, batch_size=32, decode_batch=8)
    tm = call_time_model_from_rate(rate)
    assert tm.decode_s_per_token == pytest.approx(0.01 + 0.002 * 8)  # at 8, not at B = 32, and no 1.5×
    assert tm.prefill_s_per_token == pytest.approx(0.0004)
    assert tm.tool_default_s == DEFAULT_TIME_MODEL.tool_default_s
    no_prefill = call_time_model_from_rate(replace(rate, per_prefill_token_s=0.0))
    ratio = DEFAULT_TIME_MODEL.prefill_s_per_token / DEFAULT_TIME_MODEL.decode_s_per_token
    assert no_prefill.prefill_s_per_token == pytest.approx(0.026 * ratio)
    floored = call_time_model_from_rate(replace(rate, base_s=0.0, per_decode_s=0.0))
    assert floored.decode_s_per_token == pytest.approx(0.005)
    assert call_time_model_from_rate(replace(rate, decode_batch=None)) is None
    # a slower engine gives the later stages more time: remaining_time scales with the decode time
    g = PatternGraph.from_stage_lengths("app", [[(0, 10)], [(0, 20)]])
    slow = call_time_model_from_rate(replace(rate, per_decode_s=0.02))
    assert remaining_time(g, 0, time_model=slow) == pytest.approx(20 * (0.01 + 0.02 * 8))


def test_a_pinned_time_model_is_read_back_as_written(monkeypatch):
    """``time_model_env`` writes what ``time_model_from_env`` parses; unset means nothing is pinned."""
    from jitflow_server.analyzer.subdeadline import time_model_env, time_model_from_env

    monkeypatch.delenv("JITFLOW_TIME_MODEL", raising=False)
    assert time_model_from_env() is None
    for k, v in time_model_env(0.121, 0.00197).items():
        monkeypatch.setenv(k, v)
    assert time_model_from_env() == CallTimeModel(prefill_s_per_token=0.00197, decode_s_per_token=0.121)
    monkeypatch.setenv("JITFLOW_TIME_MODEL", "fast")
    with pytest.raises(ValueError, match="JITFLOW_TIME_MODEL"):
        time_model_from_env()
