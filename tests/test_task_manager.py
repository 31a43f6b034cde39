"""The server's task manager on its own (no HTTP, no engine): typed call advice from the compound advisor,
server-clock task starts, implicit tasks, conflicts, and the history written on completion."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from jitflow_server.api.schemas import APIError, TaskContext
from jitflow_server.api.tasks import TaskComplete, TaskCreate, TaskManager
from jitflow_server.scheduler import Kind
from jitflow_server.scheduler.types import SLOSpec
from jitflow_server.store.graph import DEEPRESEARCH_MODEL, PatternGraph
from jitflow_server.tracker.metrics import RequestTiming


def _timing(rid: str, deadline: float | None = None, arrival: float | None = None) -> RequestTiming:
    return RequestTiming(rid, SLOSpec("compound", deadline=deadline, waiting_time=5.0),
                         time.time() if arrival is None else arrival, 10)


def _advise(mgr: TaskManager, *args):
    return asyncio.run(mgr.advise_call(*args))


@pytest.fixture()
def mgr(tmp_path):
    m = TaskManager(tmp_path / "h.db")
    yield m
    asyncio.run(m.close())


def test_unmatched_call_gets_equal_share_of_the_typical_stage_count(mgr):
    # history exists for another app only: this task's app has neither a match nor a typical stage count
    mgr.store.insert_many([PatternGraph.from_stage_lengths("app", [[(10, 5)]] * 4, task_id=f"h{i}")
                           for i in range(3)])
    t = mgr.create(TaskCreate(task_id="t1", app="other-app", deadline=40.0, start_time=1.0))
    assert abs(t.t0 - time.time()) < 5 and t.metadata["client_start_time"] == 1.0  # server clock
    adv = _advise(mgr, TaskContext(task_id="t1", stage_index=0), "m", "r1", 10, 64, _timing("r1"))
    assert adv.slo.kind is Kind.COMPOUND and adv.slo.waiting_time == 5.0
    assert adv.task_id == "t1" and adv.stage_index == 0 and adv.app == "other-app"
    assert adv.sub_deadline == pytest.approx(t.t0 + 40.0)  # no history for this app: the whole deadline
    assert adv.len_bound is None and adv.task_tokens_est is None


def test_matched_call_gets_the_pattern_share_and_a_stage_length_bound(mgr):
    hist = [[(100, 50)], [(200, 300), (200, 280)], [(300, 20)]]
    mgr.store.insert_many([PatternGraph.from_stage_lengths("app", hist, task_id=f"h{i}") for i in range(5)])
    t = mgr.create(TaskCreate(task_id="t2", app="app", deadline=30.0))
    ctx0 = TaskContext(task_id="t2", stage_index=0, call_id="c0")
    adv = _advise(mgr, ctx0, DEEPRESEARCH_MODEL, "r0", 100, 500, _timing("r0"))
    assert adv.task_tokens_est == sum(i + o for st in hist for i, o in st)
    # the q-quantile of the matched graphs' outputs of the stage, refined later from the same samples
    assert adv.len_bound == 50 and adv.len_samples is not None and adv.len_samples.neighbours == (50,) * 5
    assert t.t0 < adv.sub_deadline < t.t0 + 30.0  # a share of the deadline, not all of it
    capped = _advise(mgr, TaskContext(task_id="t2", stage_index=0, call_id="c0b"), DEEPRESEARCH_MODEL, "r0b", 100, 8,
                             _timing("r0b"))
    assert capped.len_bound == 8  # never above max_tokens


def test_implicit_task_needs_a_deadline_and_completed_tasks_refuse_calls(mgr):
    with pytest.raises(APIError) as ei:
        _advise(mgr, TaskContext(task_id="nope"), "m", "r", 1, 8, _timing("r"))
    assert ei.value.status == 400 and ei.value.param == "jitflow.task_id"
    adv = _advise(mgr, TaskContext(task_id="imp"), "m", "r2", 1, 8, _timing("r2", deadline=12.0))
    assert mgr.get("imp").implicit and adv.slo.deadline == pytest.approx(12.0, abs=0.1)
    timing = _timing("r2")
    timing.add_tokens(3)
    mgr.on_call_end(TaskContext(task_id="imp"), "r2", timing, ok=True)
    done = mgr.complete("imp", TaskComplete(outcome="succeeded"))
    assert done.outcome == "succeeded" and done.stored_graph_id is not None
    assert mgr.store.get(done.stored_graph_id).graph.nodes[0].output_len == 3
    with pytest.raises(APIError) as ei:
        _advise(mgr, TaskContext(task_id="imp"), "m", "r3", 1, 8, _timing("r3"))
    assert ei.value.status == 409


def test_implicit_tasks_are_closed_after_their_deadline_and_start_again_on_a_later_call(mgr):
    t0 = time.time()
    ctx = TaskContext(task_id="imp", app="my-app", stage_index=0, call_id="c0")
    _advise(mgr, ctx, "m", "r1", 5, 8, _timing("r1", deadline=10.0, arrival=t0))
    timing = _timing("r1", arrival=t0)
    timing.add_tokens(4)
    assert mgr.close_implicit(now=t0 + 5) == 0  # before its deadline: still open
    assert mgr.close_implicit(now=t0 + 11) == 0  # a call still runs
    mgr.on_call_end(ctx, "r1", timing, ok=True)
    assert mgr.close_implicit(now=t0 + 11, idle_s=0.0) == 1
    t = mgr.get("imp")
    assert t.outcome == "succeeded" and t.public_app == "my-app" and t.stored_graph_id is not None
    # the same id later is a new implicit task, not a 409
    again = _advise(mgr, TaskContext(task_id="imp", app="my-app"), "m", "r2", 5, 8, _timing("r2", deadline=9.0))
    assert mgr.get("imp").outcome is None and again.app == "my-app"


def test_the_analyzer_follows_the_engine_speed_unless_pinned(tmp_path):
    """A built-in time model is replaced by the engine's measured speed; one the operator gave is kept."""
    from jitflow_server.analyzer.subdeadline import DEFAULT_TIME_MODEL, PINNED_TIME_MODEL, CallTimeModel
    from jitflow_server.scheduler.admission import ServiceRate

    rate = ServiceRate(base_s=0.02, per_decode_s=0.003, per_prefill_token_s=0.001, wall_factor=1.0,
                       min_step_s=0.0, batch_size=16, decode_batch=16)
    g = PatternGraph.from_stage_lengths("app", [[(100, 50)], [(100, 50)]])
    m = TaskManager(tmp_path / "a.db")
    try:
        assert m.time_model_view()["source"] == "built-in"
        m.advisor.mode = "oracle"  # advice from the task's own graph: only the time model matters
        before = m.advisor.advise("app", None, 0, 0.0, 60.0, own_graph=g).task_rem_gen_time
        assert before == pytest.approx(DEFAULT_TIME_MODEL.call_time(100, 50))
        m.follow_engine_speed(dataclasses.replace(rate, decode_batch=None))  # not enough to go on
        assert m.time_model_view()["source"] == "built-in"
        m.follow_engine_speed(rate)
        view = m.time_model_view()
        assert view["source"] == "measured" and view["decode_s_per_token"] == pytest.approx(0.02 + 0.003 * 16)
        after = m.advisor.advise("app", None, 0, 0.0, 60.0, own_graph=g).task_rem_gen_time
        assert after == pytest.approx(100 * 0.001 + 50 * 0.068)  # the later stage at the measured speed
    finally:
        asyncio.run(m.close())
    pinned = TaskManager(tmp_path / "b.db", time_model=CallTimeModel(0.001, 0.5), time_model_source=PINNED_TIME_MODEL)
    try:
        pinned.follow_engine_speed(rate)
        assert pinned.time_model_view() == {"decode_s_per_token": 0.5, "prefill_s_per_token": 0.001,
                                            "source": PINNED_TIME_MODEL}
        assert pinned.advisor.time_model != DEFAULT_TIME_MODEL
    finally:
        asyncio.run(pinned.close())
    with pytest.raises(ValueError, match="time_model_source"):
        TaskManager(tmp_path / "c.db", time_model_source="guess")
