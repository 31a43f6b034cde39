"""Baselines order requests as their definitions say (fcfs, sarathi, edf, sjf, las) and make_policy."""

from __future__ import annotations

import pytest

from jitflow_server.scheduler import POLICY_NAMES, Kind, RequestView, SchedContext, make_policy


def ctx(b: int, **kw) -> SchedContext:
    return SchedContext(now=10.0, batch_size=b, token_time=0.02, prefill_rate=2000.0, **kw)


def req(rid: str, kind: Kind = Kind.BEST_EFFORT, arrival: float = 0.0, gen: int = 0, bound: int = 100,
        running: bool = False, **kw) -> RequestView:
    return RequestView(rid, kind, arrival, 50, gen, bound, running, kv_tokens=50 + gen if running else 0, **kw)


@pytest.mark.parametrize("name", ["fcfs", "sarathi"])
def test_fcfs_keeps_running_then_admits_by_arrival(name):
    views = [req("w3", arrival=3.0), req("r1", arrival=5.0, gen=5, running=True), req("w1", arrival=1.0),
             req("w2", arrival=2.0)]
    assert make_policy(name).schedule(views, ctx(2)).batch == ["r1", "w1"]
    d = make_policy(name).schedule(views, ctx(3))
    assert d.batch == ["r1", "w1", "w2"] and d.preempt == []


def edf_views() -> list[RequestView]:
    return [
        req("E", Kind.BEST_EFFORT, running=True, gen=3),  # default deadline 0 + 60
        req("L", Kind.LATENCY, gen=30, ttft=2.0, tbt=0.1),  # next token due 0 + 2 + 30·0.1 = 5.0
        req("D", Kind.DEADLINE, deadline=4.0),
        req("C", Kind.COMPOUND, deadline=50.0, sub_deadline=6.0, task_id="t", stage_index=0),
        req("C2", Kind.COMPOUND, deadline=5.5, task_id="u", stage_index=0),  # no sub-deadline: task deadline
    ]


def test_edf_orders_by_effective_deadline_and_preempts_displaced():
    d = make_policy("edf", best_effort_deadline=60.0).schedule(edf_views(), ctx(4))
    assert d.batch == ["D", "L", "C2", "C"]
    assert d.preempt == ["E"]  # pushed out while holding KV, memory unknown -> preempted
    roomy = make_policy("edf").schedule(edf_views(), ctx(4, kv_capacity_tokens=10**6))
    assert roomy.preempt == []  # KV fits: only paused
    assert make_policy("edf", best_effort_deadline=1.0).schedule(edf_views(), ctx(1)).batch == ["E"]


def test_sjf_orders_by_predicted_remaining_length():
    views = [req("a", bound=500), req("b", gen=250, bound=300, running=True), req("c", bound=100),
             req("d", bound=80, arrival=9.0)]
    # remaining: a 500, b 50, c 100, d 80
    assert make_policy("sjf").schedule(views, ctx(3)).batch == ["b", "d", "c"]


def test_las_is_program_level_summed_over_the_task():
    views = [
        req("T1", Kind.COMPOUND, gen=40, running=True, task_id="T", stage_index=0, deadline=99.0),
        req("T2", Kind.COMPOUND, gen=40, running=True, task_id="T", stage_index=0, deadline=99.0),
        req("T3", Kind.COMPOUND, gen=40, running=True, task_id="T", stage_index=0, deadline=99.0),
        req("S", gen=100, running=True),  # alone: 100 < task T's 3·40 = 120
        req("U", attained_service=200.0, task_id="U"),  # the engine says its program already got 200 tokens
        req("X", Kind.COMPOUND, gen=10, attained_service=500.0, task_id="X", stage_index=2, deadline=99.0),
    ]
    pol = make_policy("las")
    assert pol.schedule(views, ctx(1)).batch == ["S"]
    assert pol.schedule(views, ctx(5)).batch == ["S", "T1", "T2", "T3", "U"]
    d = pol.schedule(views, ctx(4))
    assert d.priorities["T1"] == d.priorities["T2"] == -120.0 and d.priorities["X"] == -500.0


def test_make_policy_names_and_errors():
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="valid: gmax"):
        make_policy("round-robin")
    with pytest.raises(ValueError, match="full_priorities"):
        make_policy("fcfs", p=0.9)
    with pytest.raises(ValueError, match="unknown GMAX parameter"):
        make_policy("gmax", lookback=3)
    with pytest.raises(ValueError, match="window must be"):
        make_policy("gmax", window=3)
