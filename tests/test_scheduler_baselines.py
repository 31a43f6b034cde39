"""Baselines order requests as their definitions say (fcfs, sarathi, edf, sjf, las) and make_policy."""

from __future__ import annotations

import numpy as np
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
    pol = make_policy("las", mlfq=False)  # the continuous key: raw program service in tokens
    assert pol.schedule(views, ctx(1)).batch == ["S"]
    assert pol.schedule(views, ctx(5)).batch == ["S", "T1", "T2", "T3", "U"]
    d = pol.schedule(views, ctx(4))
    assert d.priorities["T1"] == d.priorities["T2"] == -120.0 and d.priorities["X"] == -500.0
    # MLFQ (default): T1-T3 (120 tokens), S (100) and U (200) share Q_1 = [0, 256) and are FCFS
    # (all arrived at 0: view order); X (500) is in Q_2 = [256, 512)
    d = make_policy("las").schedule(views, ctx(6))
    assert d.batch == ["T1", "T2", "T3", "S", "U", "X"]
    assert d.priorities["T1"] == d.priorities["U"] == 0.0 and d.priorities["X"] == -1.0


def at(now: float, b: int) -> SchedContext:
    return SchedContext(now=now, batch_size=b, token_time=0.02, prefill_rate=2000.0)


def test_las_mlfq_keeps_fcfs_within_a_queue():
    """A (older, 200 tokens served) and B (newer, 0) are both in Q_1 = [0, 256): A keeps its slot;
    the continuous key would preempt A for B on a difference of 200 tokens. Same in Q_2."""
    views = [req("A", arrival=0.0, gen=200, running=True), req("B", arrival=1.0)]
    d = make_policy("las").schedule(views, ctx(1))
    assert d.batch == ["A"] and d.preempt == []
    assert d.priorities == {"A": 0.0, "B": 0.0}
    old = make_policy("las", mlfq=False).schedule(views, ctx(1))
    assert old.batch == ["B"] and old.preempt == ["A"]
    q2 = [req("A", arrival=0.0, gen=500, running=True), req("B", arrival=1.0, attained_service=300.0, task_id="b")]
    d = make_policy("las").schedule(q2, ctx(1))
    assert d.batch == ["A"] and d.preempt == []
    assert make_policy("las", quantum=400).schedule(q2, ctx(1)).batch == ["B"]  # 300 in Q_1, 500 in Q_2


def test_las_mlfq_preempts_a_program_crossing_a_threshold():
    """Task T's calls sum to 255 tokens (Q_1): they keep running ahead of the newer N. One more
    token puts the program at 256 = hi_1 (Q_2): N (Q_1) goes first and the displaced call is preempted."""
    pol = make_policy("las")

    def views(g2: int) -> list[RequestView]:
        return [
            req("A1", Kind.COMPOUND, arrival=0.0, gen=150, running=True, task_id="T", stage_index=0, deadline=99.0),
            req("A2", Kind.COMPOUND, arrival=0.5, gen=g2, running=True, task_id="T", stage_index=0, deadline=99.0),
            req("N", arrival=2.0, gen=0),
        ]

    d = pol.schedule(views(105), ctx(2))
    assert d.batch == ["A1", "A2"] and d.preempt == []
    d = pol.schedule(views(106), ctx(2))
    assert d.batch == ["N", "A1"] and d.preempt == ["A2"]
    assert d.priorities["N"] == 0.0 and d.priorities["A1"] == d.priorities["A2"] == -1.0
    assert list(pol.queue_index(np.array([0, 255, 256, 511, 512, 16383, 16384, 1e9]))) == [0, 0, 1, 1, 2, 6, 7, 7]
    assert list(make_policy("las", levels=3, quantum=100, ratio=3).queue_index(
        np.array([99, 100, 299, 300, 1e6]))) == [0, 1, 1, 2, 2]


def test_las_anti_starvation_promotes_a_long_waiting_call_for_one_quantum():
    """L's program holds 600 tokens (Q_3) and it has waited since t=0; N (Q_1, arrived at 5) runs.
    With token_time 0.02 s and β = 8, L is promoted once it waited 8 · 0.02 · 600 = 96 s; it then
    runs ahead of N (older arrival) for one quantum (256 tokens) although its program's service
    grows, goes back to its queue, and is promoted again only after waiting β · T anew."""
    pol = make_policy("las", starvation_ratio=8)
    n = req("N", arrival=5.0, gen=10, running=True)

    def lv(gen: int, att: float, running: bool) -> RequestView:
        return req("L", arrival=0.0, gen=gen, running=running, task_id="L", attained_service=att)

    assert pol.schedule([lv(0, 600.0, False), n], at(95.9, 1)).batch == ["N"]
    assert pol.promotions == 0
    d = pol.schedule([lv(0, 600.0, False), n], at(96.1, 1))
    assert d.batch == ["L"] and d.preempt == ["N"] and d.priorities["L"] == 0.0
    assert pol.promotions == 1
    # W/T is now 97 / (0.02 · 5000) < 8, but the boost holds for 256 generated tokens
    d = pol.schedule([lv(255, 5000.0, True), n], at(97.0, 1))
    assert d.batch == ["L"] and d.preempt == ["N"] and pol.promotions == 1
    d = pol.schedule([lv(256, 5000.0, True), n], at(99.0, 1))  # quantum used: back to Q_6 = [4096, 8192)
    assert d.batch == ["N"] and d.preempt == ["L"] and d.priorities["L"] == -5.0
    # the waiting clock restarted at t=99: the next promotion needs 8 · 0.02 · 5000 = 800 s more
    assert pol.schedule([lv(256, 5000.0, False), n], at(898.0, 1)).batch == ["N"]
    assert pol.schedule([lv(256, 5000.0, False), n], at(900.0, 1)).batch == ["L"] and pol.promotions == 2
    # the time L has been decoding does not count as waiting: 96.1 s − 60 · 0.02 s < 96 s
    assert make_policy("las", starvation_ratio=8).schedule([lv(60, 600.0, False), n], at(96.1, 1)).batch == ["N"]
    # default β = 16: 192 s
    dflt = make_policy("las")
    assert dflt.schedule([lv(0, 600.0, False), n], at(191.9, 1)).batch == ["N"]
    assert dflt.schedule([lv(0, 600.0, False), n], at(192.1, 1)).batch == ["L"]
    off = make_policy("las", starvation_ratio=float("inf"))
    assert off.schedule([lv(0, 600.0, False), n], at(1e6, 1)).batch == ["N"] and off.promotions == 0
    # Q_1 calls are never counted as promoted (they are already first in line)
    q1 = make_policy("las")
    q1.schedule([req("W", arrival=0.0), n], at(1e6, 1))
    assert q1.promotions == 0


@pytest.mark.parametrize("bad", [
    {"quantum": 0}, {"quantum": -5}, {"quantum": float("nan")}, {"quantum": float("inf")},
    {"levels": 0}, {"levels": -1}, {"levels": 2.5},
    {"ratio": 1}, {"ratio": 0.5}, {"ratio": float("nan")},
    {"starvation_ratio": 0}, {"starvation_ratio": -1.0}, {"starvation_ratio": float("nan")},
    {"delta_steps": 0}, {"slices": 3},
])
def test_las_bad_parameters_raise_value_error(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        make_policy("las", **bad)


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
