"""Compound tasks end to end: SDK decorators/stages/tools -> server task API, history store, φ(s), OTel."""

from __future__ import annotations

import json
import time

import anyio
import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import jitflow
from jitflow_server.analyzer.subdeadline import sub_deadline
from jitflow_server.store.history import HistoryStore

pytestmark = pytest.mark.engine
APP = "e2e-research"


def _run_task(url: str, provider=None, *, fail: bool = False, app: str = APP):
    seen: dict = {}

    async def main():
        async with jitflow.AsyncClient(base_url=url, tracer_provider=provider) as client:

            @jitflow.tool(name="search")
            async def search(q: str) -> list[str]:
                await anyio.sleep(0.05)
                return [q.upper()]

            @jitflow.agent(app=app, deadline=60, client=client)
            async def research(question: str) -> str:
                seen["task_id"] = jitflow.current_task().task_id
                async with jitflow.stage("plan") as st:
                    await st.chat([{"role": "user", "content": question}], max_tokens=12,
                                  extra_body={"ignore_eos": True})
                async with jitflow.stage("research") as st:
                    async with anyio.create_task_group() as tg:
                        for i in range(3):
                            tg.start_soon(lambda i=i: st.chat([{"role": "user", "content": f"q{i}"}],
                                                                max_tokens=8 + 4 * i,
                                                                extra_body={"ignore_eos": True}))
                    await search(question)
                if fail:
                    raise ValueError("agent bug")
                async with jitflow.stage("answer") as st:
                    r = await st.chat([{"role": "user", "content": "final"}], max_tokens=16,
                                      extra_body={"ignore_eos": True})
                return r.content

            return await research("why is the sky blue?")

    try:
        out = anyio.run(main)
    except ValueError:
        out = None
    return seen["task_id"], out


def _task(url: str, task_id: str) -> dict:
    for _ in range(50):
        view = httpx.get(f"{url}/v1/tasks/{task_id}").json()
        if view.get("outcome") is not None:
            return view
        time.sleep(0.1)
    return view


def test_three_stage_task_is_stored_as_one_pattern_graph(server_url, server_files):
    task_id, out = _run_task(server_url)
    assert isinstance(out, str)
    view = _task(server_url, task_id)
    assert view["outcome"] == "succeeded"
    assert [s["name"] for s in view["stages"]] == ["plan", "research", "answer"]
    plan, research, answer = view["stages"]
    assert len(plan["calls"]) == 1 and len(answer["calls"]) == 1
    llm = [c for c in research["calls"] if c["kind"] == "llm"]
    tools = [c for c in research["calls"] if c["kind"] == "tool"]
    assert len(llm) == 3 and len(tools) == 1 and tools[0]["name"] == "search"
    plan_id = plan["calls"][0]["call_id"]
    assert all(c["parents"] == [plan_id] for c in llm)
    assert sorted(c["output_tokens"] for c in llm) == [8, 12, 16]
    assert set(answer["calls"][0]["parents"]) == {c["call_id"] for c in research["calls"]}
    assert all(s["sub_deadline"] is not None for s in view["stages"])
    assert view["stored_graph_id"] is not None
    store = HistoryStore(server_files["db"])
    try:
        g = store.get(view["stored_graph_id"]).graph
        assert g.app == APP and g.n_stages == 3 and g.outcome == "succeeded"
        kinds = sorted(n.kind for n in g.nodes)
        assert kinds == ["llm"] * 5 + ["tool"]
        tool = next(n for n in g.nodes if n.kind == "tool")
        assert tool.stage == 1 and (tool.duration or (tool.end - tool.start)) >= 0.04
    finally:
        store.close()
    # the observed call lengths went to the length predictor's training telemetry
    recs = [json.loads(x) for x in server_files["telemetry"].read_text().splitlines()]
    mine = [r for r in recs if r["app"] == APP]
    assert sorted(r["output_len"] for r in mine[-5:]) == [8, 12, 12, 16, 16]


def test_sub_deadlines_follow_the_matched_pattern(server_url, server_files):
    _run_task(server_url)  # make sure the history has this app
    task_id, _ = _run_task(server_url)
    view = _task(server_url, task_id)
    m = view["matched"]
    assert m is not None and m["n_stages"] == 3
    store = HistoryStore(server_files["db"])
    try:
        g = store.get(m["graph_id"]).graph
    finally:
        store.close()
    # The last call's match decided the final stage; every stage's sub-deadline must equal
    # T0 + φ(s)·D of *a* matched graph: check the final stage against the reported match, and
    # that all are inside [T0, T0 + D] and non-decreasing.
    t0, d = view["start_time"], view["deadline"]
    sds = [s["sub_deadline"] for s in view["stages"]]
    assert sds == sorted(sds)
    assert all(t0 <= x <= t0 + d + 1e-6 for x in sds)
    assert sds[-1] == pytest.approx(sub_deadline(g, 2, t0, d), abs=1e-6)
    assert sds[-1] == pytest.approx(t0 + d, abs=1e-6)  # φ(last) = 1


def test_failed_agent_is_stored_as_failed(server_url, server_files):
    task_id, out = _run_task(server_url, fail=True, app="e2e-failing")
    assert out is None
    view = _task(server_url, task_id)
    assert view["outcome"] == "failed"
    assert "agent bug" in (view["error"] or "")
    store = HistoryStore(server_files["db"])
    try:
        assert store.get(view["stored_graph_id"]).graph.outcome == "failed"
    finally:
        store.close()


def test_one_trace_across_client_and_server(server_url, server_files):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    task_id, _ = _run_task(server_url, provider)
    spans = exporter.get_finished_spans()
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name.split(" ")[0], []).append(s)
    (wf,) = by_name["invoke_workflow"]
    assert wf.attributes["gen_ai.operation.name"] == "invoke_workflow"
    assert wf.attributes["jitflow.task_id"] == task_id
    trace_id = wf.context.trace_id
    assert all(s.context.trace_id == trace_id for s in spans)
    stages = by_name["stage"]
    assert len(stages) == 3 and all(s.parent.span_id == wf.context.span_id for s in stages)
    chats = by_name["chat"]
    assert len(chats) == 5
    stage_ids = {s.context.span_id for s in stages}
    assert all(c.parent.span_id in stage_ids for c in chats)
    c0 = chats[0]
    assert c0.attributes["gen_ai.operation.name"] == "chat"
    assert c0.attributes["gen_ai.request.model"] == "tiny"
    assert c0.attributes["gen_ai.usage.output_tokens"] > 0
    assert "jitflow.sub_deadline" in c0.attributes
    tools = by_name["execute_tool"]
    assert len(tools) == 1 and tools[0].attributes["gen_ai.tool.name"] == "search"
    # The server's spans (exported to a file by the server process) join the same trace.
    deadline = time.time() + 10
    server_spans = []
    while time.time() < deadline:
        lines = server_files["spans"].read_text().splitlines() if server_files["spans"].exists() else []
        server_spans = [json.loads(x) for x in lines]
        server_spans = [s for s in server_spans if int(s["context"]["trace_id"], 16) == trace_id]
        if len([s for s in server_spans if s["name"].startswith("serve")]) >= 5:
            break
        time.sleep(0.2)
    serve = [s for s in server_spans if s["name"].startswith("serve")]
    assert len(serve) == 5
    # the HTTP SERVER spans (FastAPI instrumentation) are children of the SDK's chat spans, and each
    # generation's ``serve`` span a child of its HTTP span
    chat_ids = {format(c.context.span_id, "016x") for c in chats}
    http = {s["context"]["span_id"]: s for s in server_spans if s["kind"] == "SpanKind.SERVER"}
    assert all(s["parent_id"].removeprefix("0x") in chat_ids for s in http.values()), http
    assert all(s["parent_id"] in http for s in serve)
    assert {s["name"] for s in server_spans} >= {"queue", "decode", "POST /v1/chat/completions"}
    attrs = serve[0]["attributes"]  # GenAI semantic conventions on the generation's span
    assert attrs["gen_ai.provider.name"] == "jitflow" and attrs["gen_ai.request.model"] == "tiny"
    h = http[serve[0]["parent_id"]]["attributes"]  # HTTP semantic conventions on the request's
    assert h["http.request.method"] == "POST" and h["http.route"] == "/v1/chat/completions"
    assert h["http.response.status_code"] == 200


def test_telemetry_to_a_dead_server_does_not_block_the_agent():
    async def main():
        async with jitflow.AsyncClient(base_url="http://127.0.0.1:1", telemetry_retries=1) as client:

            @jitflow.tool(name="calc")
            def calc(x: int) -> int:
                return x * 2

            @jitflow.agent(app="offline", deadline=30, client=client)
            async def agent() -> int:
                async with jitflow.stage("compute"):
                    return calc(21)

            t0 = time.monotonic()
            out = await agent()
            return out, time.monotonic() - t0, client.telemetry.dropped

    with pytest.warns(jitflow.TelemetryWarning) as warned:  # said once, never raised into the agent
        out, elapsed, dropped = anyio.run(main)
    assert out == 42
    assert dropped >= 1
    assert elapsed < 15
    texts = [str(w.message) for w in warned]
    assert any("could not register task" in t for t in texts)
    assert any("could not be delivered" in t for t in texts)
