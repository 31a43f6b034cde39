"""SDK OpenTelemetry spans: workflow -> stage -> chat / execute_tool, GenAI and
jitflow attributes, W3C traceparent injection. The in-memory exporter is configured here, in the
test, on a private TracerProvider handed to the client (the library never configures one).
"""

from __future__ import annotations

import anyio
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import jitflow
from conftest_sdk import FakeServer, error

MSG = [{"role": "user", "content": "q"}]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture
def otel():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


@jitflow.tool(name="web_search")
async def web_search(q: str) -> str:
    await anyio.sleep(0.005)
    return q


@jitflow.tool(name="broken")
def broken() -> None:
    raise ValueError("bad tool")


@pytest.mark.anyio
async def test_span_tree_attributes_and_traceparent(otel):
    provider, exporter = otel
    server = FakeServer()
    client = jitflow.AsyncClient("http://test:8123", transport=server.async_transport(), model="demo",
                                 tracer_provider=provider)

    @jitflow.agent(app="research", deadline=20, client=client)
    async def research() -> jitflow.Task:
        async with jitflow.stage("plan") as st:
            await st.chat(MSG, max_tokens=2)
        async with jitflow.stage("search") as st:
            async with anyio.create_task_group() as tg:
                tg.start_soon(web_search, "a")
                tg.start_soon(lambda: st.chat(MSG, max_tokens=1))
                tg.start_soon(lambda: st.chat(MSG, max_tokens=1))
            with pytest.raises(ValueError):
                broken()
        async with jitflow.stage("answer") as st:
            s = await st.chat(MSG, max_tokens=3, stream=True)
            async with s:
                async for _ in s:
                    pass
        return jitflow.current_task()

    task = await research()
    await client.aclose()
    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for sp in spans:
        by_name.setdefault(sp.name, []).append(sp)
    assert sorted(by_name) == ["chat demo", "execute_tool broken", "execute_tool web_search",
                               "invoke_workflow research", "stage answer", "stage plan", "stage search"]
    assert len({sp.context.trace_id for sp in spans}) == 1

    wf = by_name["invoke_workflow research"][0]
    assert wf.parent is None and wf.kind == SpanKind.INTERNAL
    assert wf.attributes["gen_ai.operation.name"] == "invoke_workflow"
    assert wf.attributes["gen_ai.workflow.name"] == wf.attributes["gen_ai.agent.name"] == "research"
    assert wf.attributes["jitflow.app"] == "research" and wf.attributes["jitflow.deadline"] == 20.0
    assert wf.attributes["jitflow.task_id"] == task.task_id and wf.attributes["jitflow.outcome"] == "succeeded"

    stages = {sp.attributes["jitflow.stage"]: sp for sp in spans if sp.name.startswith("stage ")}
    assert all(sp.parent.span_id == wf.context.span_id for sp in stages.values())
    assert [stages[n].attributes["jitflow.stage_index"] for n in ("plan", "search", "answer")] == [0, 1, 2]
    assert "jitflow.sub_deadline" in stages["plan"].attributes

    chats = by_name["chat demo"]
    assert len(chats) == 4
    for sp in chats:
        stage_sp = stages[sp.attributes["jitflow.stage"]]
        assert sp.kind == SpanKind.CLIENT and sp.parent.span_id == stage_sp.context.span_id
        a = sp.attributes
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "demo"
        assert a["gen_ai.provider.name"] == "jitflow"
        assert a["server.address"] == "test" and a["server.port"] == 8123
        assert a["gen_ai.usage.input_tokens"] == 5
        assert a["gen_ai.usage.output_tokens"] == a["gen_ai.request.max_tokens"]
        assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
        assert a["gen_ai.response.id"].startswith("cmpl-")
        assert a["jitflow.slo.kind"] == "compound" and a["jitflow.task_id"] == task.task_id
        assert a["jitflow.slo_met"] is True and a["jitflow.ttft"] > 0 and "jitflow.sub_deadline" in a
    # traceparent of each chat request = that chat span's context (server spans join the trace)
    sent = {h["traceparent"] for h in server.headers}
    expected = {
        f"00-{sp.context.trace_id:032x}-{sp.context.span_id:016x}-{int(sp.context.trace_flags):02x}"
        for sp in chats
    }
    assert sent == expected

    ws = by_name["execute_tool web_search"][0]
    assert ws.parent.span_id == stages["search"].context.span_id
    assert ws.attributes["gen_ai.operation.name"] == "execute_tool"
    assert ws.attributes["gen_ai.tool.name"] == "web_search"
    assert ws.end_time - ws.start_time >= 4_000_000  # ns
    br = by_name["execute_tool broken"][0]
    assert br.status.status_code == StatusCode.ERROR and br.attributes["error.type"] == "ValueError"


@pytest.mark.anyio
async def test_failed_calls_and_tasks_mark_spans(otel):
    provider, exporter = otel
    server = FakeServer()
    server.route = lambda req: (error(429, "full", "admission_rejected", None, {"Retry-After": "1"})
                                if req.url.path == "/v1/chat/completions" else None)
    client = jitflow.AsyncClient("http://test:8123", transport=server.async_transport(), model="demo",
                                 tracer_provider=provider, max_retries=0)
    with pytest.raises(jitflow.AdmissionRejectedError):
        async with client.task("t", deadline=5) as task:
            async with task.stage("s") as st:
                await st.chat(MSG)
    await client.aclose()
    spans = {sp.name: sp for sp in exporter.get_finished_spans()}
    chat = spans["chat demo"]
    assert chat.status.status_code == StatusCode.ERROR
    assert chat.attributes["error.type"] == "AdmissionRejectedError"
    wf = spans["invoke_workflow t"]
    assert wf.status.status_code == StatusCode.ERROR and wf.attributes["jitflow.outcome"] == "failed"
    assert spans["stage s"].attributes["error.type"] == "AdmissionRejectedError"


def test_sync_client_spans_outside_tasks(otel):
    provider, exporter = otel
    server = FakeServer()
    with jitflow.Client("http://test:8123", transport=server.sync_transport(), tracer_provider=provider) as c:
        c.chat.completions.create(model="demo", messages=MSG, max_tokens=2, slo=jitflow.Latency(1, 0.05))
    (sp,) = exporter.get_finished_spans()
    assert sp.name == "chat demo" and sp.parent is None
    assert sp.attributes["jitflow.slo.kind"] == "latency" and sp.attributes["jitflow.slo.ttft"] == 1.0
    assert "jitflow.task_id" not in sp.attributes
    assert server.headers[0]["traceparent"].split("-")[1] == f"{sp.context.trace_id:032x}"
