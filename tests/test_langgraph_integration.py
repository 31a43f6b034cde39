"""jitflow.integrations.langgraph against a real HTTP server on 127.0.0.1 (the deterministic FakeEngine
behind it): a LangGraph run is one compound task under its application, each super-step one stage named
after its node, and the nodes themselves are plain OpenAI-client code."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("langgraph")

from examples.langgraph_agent import run  # noqa: E402

from jitflow.integrations import langgraph as jf  # noqa: E402
from jitflow_server.engine.fake import FakeEngine  # noqa: E402
from jitflow_server.scheduler import Kind  # noqa: E402
from test_api_fake_engine import serve  # noqa: E402


def test_a_graph_run_is_one_task_with_a_stage_per_super_step(env):
    eng = FakeEngine(eos_after=3)
    with serve(eng) as (url, _):
        state, task_id = run(url, "why is the sky blue?", deadline=60.0, model="fake", task_id="lg-1")
        assert state["answer"] == " t0 t1 t2" and len(state["notes"]) == 3
        hints = sorted((req.hints for req in eng.requests.values()), key=lambda h: h.stage_index)
        assert all(h.kind is Kind.COMPOUND and h.task_id == "lg-1" for h in hints)
        # plan (super-step 1), research_a + research_b together (2), answer (3)
        assert [h.stage_index for h in hints] == [0, 1, 1, 2]
        assert all(h.deadline is not None and 0 < h.deadline <= 60.0 for h in hints)
        task = httpx.get(f"{url}/v1/tasks/{task_id}").json()
        assert task["app"] == "langgraph-example"
        assert [s["index"] for s in task["stages"]] == [0, 1, 2]
        assert task["stages"][0]["name"] == "plan" and task["stages"][2]["name"] == "answer"


def test_requests_outside_a_graph_run_go_out_unchanged_and_bad_configs_are_refused():
    assert jf.task_headers() == {}  # not inside a LangGraph run
    with pytest.raises(ValueError, match="deadline"):
        jf.task_config("app", 0)
    with pytest.raises(ValueError, match="app"):
        jf.task_config("", 10)
    cfg = jf.task_config("app", 10, config={"configurable": {"thread_id": "t"}, "tags": ["x"]})
    assert cfg["configurable"]["thread_id"] == "t" and cfg["tags"] == ["x"]
    assert cfg["configurable"][jf.TASK_KEY]["app"] == "app"
