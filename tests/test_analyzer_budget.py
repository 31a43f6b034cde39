"""The analyzer off the request path: a slow, stuck or failing pattern matcher never delays a compound
call past its budget nor blocks the event loop; the call gets the fallback advice and the outcome is
counted; once the matcher answers again, calls get its advice."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jitflow_server.analyzer.budget import BudgetedAdvisor
from jitflow_server.api.schemas import TaskContext
from jitflow_server.api.tasks import TaskCreate, TaskManager
from jitflow_server.scheduler.types import SLOSpec
from jitflow_server.store.graph import DEEPRESEARCH_MODEL, PatternGraph
from jitflow_server.tracker.metrics import RequestTiming

HIST = [[(100, 50)], [(200, 300), (200, 280)], [(300, 20)]]


class GatedMatcher:
    """The real matcher behind a gate (fault injection): ``match`` waits for ``gate`` or raises ``fail``."""

    def __init__(self, real, gate: threading.Event, fail: Exception | None = None) -> None:
        self.real, self.gate, self.fail = real, gate, fail
        self.top_k = getattr(real, "top_k", 1)

    def match(self, *args, **kw):
        self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        return self.real.match(*args, **kw)

    def stage_outputs(self, *args):
        return self.real.stage_outputs(*args)


@pytest.fixture()
def mgr(tmp_path):
    m = TaskManager(tmp_path / "h.db", analyzer_budget=0.05, analyzer_queue=2)
    m.store.insert_many([PatternGraph.from_stage_lengths("app", HIST, task_id=f"h{i}") for i in range(5)])
    yield m
    asyncio.run(m.close())


def _timing(rid: str) -> RequestTiming:
    return RequestTiming(rid, SLOSpec("compound", waiting_time=5.0), time.time(), 100)


async def _call(mgr: TaskManager, task: str, i: int):
    ctx = TaskContext(task_id=task, stage_index=0, call_id=f"c{i}")
    t0 = time.perf_counter()
    adv = await mgr.advise_call(ctx, DEEPRESEARCH_MODEL, f"r{i}", 100, 500, _timing(f"r{i}"))
    return adv, time.perf_counter() - t0


def test_a_stuck_matcher_costs_each_call_at_most_its_budget_and_never_blocks_the_loop(mgr):
    gate = threading.Event()
    real = mgr.matcher
    mgr.advisor.matcher_for = lambda app: GatedMatcher(real, gate)
    t = mgr.create(TaskCreate(task_id="t", app="app", deadline=30.0))
    fallback = mgr.advisor.fallback("app", 0, t.t0, 30.0)

    async def main():
        gaps: list[float] = []

        async def ticker():
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        out = [await _call(mgr, "t", i) for i in range(3)]
        tick.cancel()
        return out, max(gaps)

    calls, max_gap = asyncio.run(main())
    (a, ta), (b, tb), (c, tc) = calls
    assert [a.analyzer, b.analyzer, c.analyzer] == ["timeout", "timeout", "busy"]
    assert 0.04 < ta < 0.5 and 0.04 < tb < 0.5 and tc < 0.04  # a full queue answers at once
    assert max_gap < 0.04  # the event loop kept running while the matches were stuck
    for adv in (a, b, c):  # the fallback advice: equal shares, no length bound from history
        assert adv.sub_deadline == pytest.approx(fallback.sub_deadline) and adv.len_bound is None
    assert mgr.budgeted.stats == {"ok": 0, "timeout": 2, "busy": 1, "error": 0}
    gate.set()  # the matcher recovers: the abandoned matches finish, then calls get its advice
    deadline = time.time() + 5
    while mgr.budgeted.pending and time.time() < deadline:
        time.sleep(0.01)
    assert mgr.budgeted.pending == 0
    ok, _ = asyncio.run(_call(mgr, "t", 3))
    assert ok.analyzer == "ok" and ok.len_bound == 50 and ok.task_tokens_est is not None


def test_a_failing_matcher_is_counted_and_the_call_still_served(mgr):
    gate = threading.Event()
    gate.set()
    real = mgr.matcher
    mgr.advisor.matcher_for = lambda app: GatedMatcher(real, gate, fail=RuntimeError("corrupt index"))
    mgr.create(TaskCreate(task_id="t", app="app", deadline=30.0))
    adv, _ = asyncio.run(_call(mgr, "t", 0))
    assert adv.analyzer == "error" and adv.len_bound is None
    assert mgr.budgeted.stats["error"] == 1 and mgr.budgeted.pending == 0


def test_a_fast_matcher_is_used_within_budget(mgr):
    mgr.create(TaskCreate(task_id="t", app="app", deadline=30.0))
    adv, _ = asyncio.run(_call(mgr, "t", 0))
    assert adv.analyzer == "ok" and adv.len_bound == 50
    assert mgr.budgeted.stats["ok"] == 1


@pytest.mark.parametrize("budget,queue", [(0.0, 1), (float("nan"), 1), (-1.0, 1), (0.05, 0)])
def test_invalid_budget_or_queue_is_refused(mgr, budget, queue):
    with pytest.raises(ValueError):
        BudgetedAdvisor(mgr.advisor, budget, queue)
