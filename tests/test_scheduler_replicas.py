"""Power-of-K replica choice with replica-specific priorities (JITServe §4.3)."""

from __future__ import annotations

import random

import pytest

from jitflow_server.scheduler import GMAXPolicy, Kind, RequestView, SchedContext, best_replica, dummy_copies


def replica(i: int, v: float, prefill: float = 5000.0) -> SchedContext:
    return SchedContext(now=1.0, batch_size=8, token_time=v, prefill_rate=prefill, replica=i)


def test_picks_the_replica_where_the_deadline_is_still_reachable():
    r = RequestView("r", Kind.DEADLINE, 0.0, 100, 0, 500, False, deadline=9.0)
    ctxs = [replica(0, 0.02), replica(1, 0.01), replica(2, 0.05)]  # 500 tokens: 10 s, 5 s, 25 s
    hard = GMAXPolicy(adapt_p=False, jit=False, bound_share=1.0, deadline_soft_share=0.0)
    best, prio, scores = best_replica(r, ctxs, hard)
    assert best == 1
    assert scores[1] == prio == max(scores.values())
    assert scores[0] < scores[1] / 100  # infeasible on replica 0 -> demoted there
    # with soft feasibility replica 0 could still make it if the answer is short (3.5 s at 0.35 of the
    # bound): a tenth of the value over twice the time there (about 1/20 of the priority), so replica 1 wins
    soft = GMAXPolicy(adapt_p=False, jit=False, bound_share=1.0, deadline_soft_share=0.35, soft_feasibility=0.1)
    best, prio, scores = best_replica(r, ctxs, soft)
    assert best == 1 and scores[1] / 40 < scores[0] < scores[1] / 10


def test_kv_locality_favours_the_home_replica():
    r = RequestView("r", Kind.DEADLINE, 0.0, 4000, 20, 200, True, kv_tokens=4020, deadline=100.0)
    ctxs = [replica(0, 0.02, prefill=1000.0), replica(1, 0.02, prefill=1000.0)]
    best, _, scores = best_replica(r, ctxs, home_replica=1)
    assert best == 1 and scores[0] < scores[1]  # elsewhere it must prefill 4020 tokens again


def test_k_samples_without_replacement():
    r = RequestView("r", Kind.DEADLINE, 0.0, 10, 0, 10, False, deadline=100.0)
    ctxs = [replica(i, 0.02) for i in range(6)]
    copies = dummy_copies(r, ctxs, k=3, rng=random.Random(0))
    assert len(copies) == 3 and len({i for i, _, _ in copies}) == 3
    with pytest.raises(ValueError):
        dummy_copies(r, [])
