"""jitflow.integrations.openai_agents against a real HTTP server on 127.0.0.1 (the deterministic
FakeEngine behind it): a workflow of OpenAI Agents SDK runs is one compound task under its application,
each model turn one stage named after its agent, the agents themselves unchanged."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("agents")

from examples.openai_agents_app import run  # noqa: E402

from jitflow.integrations.openai_agents import AgentTask  # noqa: E402
from jitflow_server.engine.fake import FakeEngine  # noqa: E402
from jitflow_server.scheduler import Kind  # noqa: E402
from test_api_fake_engine import serve  # noqa: E402


def test_a_workflow_of_agent_runs_is_one_task_with_a_stage_per_model_turn(env):
    eng = FakeEngine(eos_after=3)
    with serve(eng) as (url, _):
        answer, task_id = asyncio.run(run(url, "why is the sky blue?", deadline=60.0, model="fake",
                                          task_id="ag-1"))
        assert answer == " t0 t1 t2"
        hints = sorted((req.hints for req in eng.requests.values()), key=lambda h: h.stage_index)
        assert all(h.kind is Kind.COMPOUND and h.task_id == "ag-1" for h in hints)
        assert [h.stage_index for h in hints] == [0, 1]  # planner, then writer
        assert all(h.deadline is not None and 0 < h.deadline <= 60.0 for h in hints)
        task = httpx.get(f"{url}/v1/tasks/{task_id}").json()
        assert task["app"] == "agents-example"
        assert [(s["index"], s["name"]) for s in task["stages"]] == [(0, "planner"), (1, "writer")]


def test_the_task_headers_name_the_turn_and_bad_tasks_are_refused():
    task = AgentTask("app", 30, base_url="http://127.0.0.1:1/v1", task_id="t")
    h = task.headers()
    assert h["x-jitflow-task-id"] == "t" and h["x-jitflow-stage-index"] == "0" and "x-jitflow-stage" not in h
    assert 0 < float(h["x-jitflow-deadline"]) <= 30
    task._turn("planner")
    task._turn("writer")
    assert task.headers()["x-jitflow-stage-index"] == "1" and task.headers()["x-jitflow-stage"] == "writer"
    with pytest.raises(ValueError, match="deadline"):
        AgentTask("app", 0, base_url="x")
    with pytest.raises(ValueError, match="app"):
        AgentTask("", 10, base_url="x")
