"""SDK compound tasks: agent/task scopes, stages, parents, tools, telemetry.

httpx.MockTransport stands in for the server; the SDK's real task, contextvars, anyio task-group
and telemetry code runs. Every async test runs under asyncio and trio.
"""

from __future__ import annotations

import time
import warnings

import anyio
import httpx
import pytest

import jitflow
from conftest_sdk import FakeServer

MSG = [{"role": "user", "content": "q"}]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def make_client(server: FakeServer, **kw) -> jitflow.AsyncClient:
    kw.setdefault("telemetry_backoff", 0.01)
    return jitflow.AsyncClient("http://test:8123", transport=server.async_transport(), model="demo", **kw)


def events_of(server: FakeServer, task_id: str, type_: str | None = None) -> list[dict]:
    evs = server.tasks[task_id]["events"]
    return [e for e in evs if type_ is None or e["type"] == type_]


@jitflow.tool(name="web_search")
async def web_search(q: str) -> str:
    await anyio.sleep(0.02)
    return f"results for {q}"


@jitflow.tool
def parse(text: str) -> int:
    time.sleep(0.01)
    return len(text)


@pytest.mark.anyio
async def test_three_stage_task_parents_and_telemetry():
    server = FakeServer()
    client = make_client(server)

    @jitflow.agent(app="research", deadline=30, client=client, metadata={"user": "u1"})
    async def research(question: str) -> tuple[jitflow.Task, str]:
        task = jitflow.current_task()
        async with jitflow.stage("plan") as st:
            plan = await st.chat(MSG, max_tokens=2)
        results: list[str] = []
        async with jitflow.stage("search") as st:

            async def one(i: int) -> None:
                r = await client.chat.completions.create(messages=MSG, max_tokens=1)
                results.append(r.content)

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(one, i)
                tg.start_soon(web_search, question)
        async with task.stage("answer") as st:
            n = parse("x" * 10)
            ans = await st.chat(MSG, max_tokens=3, stream=True)
            async with ans:
                text = "".join([c.choices[0].delta.content async for c in ans if c.choices])
        assert n == 10 and plan.call_id is not None
        return task, text

    task, text = await research("why?")
    await client.aclose()
    assert text == "tok tok tok "
    assert task.outcome == "succeeded" and task.registered
    assert [s.name for s in task.stages] == ["plan", "search", "answer"]

    reg = server.tasks[task.task_id]["register"]
    assert reg["app"] == "research" and reg["deadline"] == 30.0 and reg["metadata"] == {"user": "u1"}
    assert abs(reg["start_time"] - task.start_time) < 1e-6

    # every LLM call carried the task context
    ctx = [c["jitflow"] for c in server.calls]
    assert all(c["task_id"] == task.task_id for c in ctx)
    assert [c["stage_index"] for c in ctx] == [0, 1, 1, 1, 2]
    assert all(call["slo"]["kind"] == "compound" and 0 < call["slo"]["deadline"] <= 30 for call in server.calls)
    plan_id = ctx[0]["call_id"]
    search_ids = {c["call_id"] for c in ctx[1:4]}
    assert all(c["parents"] == [plan_id] for c in ctx[1:4])  # parallel siblings share parents
    tool_ev = events_of(server, task.task_id, "tool")
    ws = next(e for e in tool_ev if e["name"] == "web_search")
    assert ws["parents"] == [plan_id] and ws["stage"] == "search" and ws["error"] is None
    assert ws["end"] - ws["start"] >= 0.015
    # the answer stage depends on every call (LLM + tool) of the search stage
    assert set(ctx[4]["parents"]) == search_ids | {ws["call_id"]}
    pr = next(e for e in tool_ev if e["name"] == "parse")
    assert pr["stage_index"] == 2 and set(pr["parents"]) == set(ctx[4]["parents"])

    starts = events_of(server, task.task_id, "stage_start")
    ends = events_of(server, task.task_id, "stage_end")
    assert [(e["stage"], e["stage_index"]) for e in starts] == [("plan", 0), ("search", 1), ("answer", 2)]
    assert [e["stage_index"] for e in ends] == [0, 1, 2]
    assert all(s["time"] <= e["time"] for s, e in zip(starts, ends, strict=True))
    llm = events_of(server, task.task_id, "llm")
    assert len(llm) == 5 and {e["call_id"] for e in llm} == {c["call_id"] for c in ctx}
    streamed = next(e for e in llm if e["call_id"] == ctx[4]["call_id"])
    assert streamed["output_tokens"] == 3 and streamed["input_tokens"] == 5 and streamed["model"] == "demo"
    done = server.tasks[task.task_id]["complete"]
    assert done["outcome"] == "succeeded" and done["error"] is None and done["end_time"] >= task.start_time
    assert client.telemetry.dropped == 0 and client.telemetry.sent >= 2 + len(server.tasks[task.task_id]["events"])
    assert task.stages[0].sub_deadline is not None  # reported back by the server's timing


@pytest.mark.anyio
async def test_nested_agents_and_task_scopes_reuse_the_task():
    server = FakeServer()
    client = make_client(server)

    @jitflow.agent(app="inner", deadline=5, client=client)
    async def inner() -> jitflow.Task:
        async with client.task("other", deadline=1) as t:
            await client.chat.completions.create(messages=MSG)  # implicit one-call stage
            return t

    @jitflow.agent(app="outer", deadline=10, client=client)
    async def outer() -> tuple[jitflow.Task, jitflow.Task]:
        return jitflow.current_task(), await inner()

    t_outer, t_inner = await outer()
    assert t_outer is t_inner and t_outer.app == "outer"
    assert list(server.tasks) == [t_outer.task_id]
    assert jitflow.current_task() is None
    assert server.calls[0]["jitflow"]["stage"] == "demo"  # implicit stage named after the model
    kinds = [e["type"] for e in events_of(server, t_outer.task_id)]
    assert kinds == ["stage_start", "llm", "stage_end"]
    # two sequential tasks are independent
    async with client.task("again", deadline=3) as t2:
        pass
    assert t2.task_id != t_outer.task_id and len(server.tasks) == 2
    await client.aclose()


@pytest.mark.anyio
async def test_concurrent_tasks_do_not_share_context():
    server = FakeServer()
    client = make_client(server)
    seen: dict[str, str] = {}

    @jitflow.agent(app="par", deadline=10, client=client)
    async def job(name: str) -> None:
        async with jitflow.stage(name) as st:
            await anyio.sleep(0.01)
            r = await st.chat(MSG)
            seen[name] = jitflow.current_task().task_id
            assert r.call_id in st.call_ids

    async with anyio.create_task_group() as tg:
        for n in ("a", "b", "c"):
            tg.start_soon(job, n)
    await client.aclose()
    assert len(set(seen.values())) == 3
    for call in server.calls:
        tid = call["jitflow"]["task_id"]
        assert seen[call["jitflow"]["stage"]] == tid and call["jitflow"]["parents"] == []


@pytest.mark.anyio
async def test_failed_task_is_reported_and_exception_propagates_unchanged():
    server = FakeServer()
    client = make_client(server)
    boom = KeyError("missing")
    holder: list[jitflow.Task] = []

    @jitflow.tool(name="lookup")
    def lookup() -> None:
        raise boom

    @jitflow.agent(app="fails", deadline=10, client=client)
    async def agent() -> None:
        holder.append(jitflow.current_task())
        async with jitflow.stage("s1"):
            lookup()

    with pytest.raises(KeyError) as ei:
        await agent()
    assert ei.value is boom  # not wrapped in an ExceptionGroup
    task = holder[0]
    assert task.outcome == "failed"
    done = server.tasks[task.task_id]["complete"]
    assert done["outcome"] == "failed" and "KeyError" in done["error"] and "missing" in done["error"]
    tool_ev = events_of(server, task.task_id, "tool")[0]
    assert tool_ev["name"] == "lookup" and tool_ev["error"].startswith("KeyError")
    assert [e["type"] for e in events_of(server, task.task_id)][-1] == "stage_end"
    await client.aclose()


@pytest.mark.anyio
async def test_tools_outside_tasks_and_error_propagation():
    calls = []

    @jitflow.tool(name="adder")
    async def add(a: int, b: int) -> int:
        calls.append((a, b))
        return a + b

    @jitflow.tool
    def fail() -> None:
        raise RuntimeError("nope")

    assert await add(1, 2) == 3 and add.__name__ == "add"
    with pytest.raises(RuntimeError, match="nope"):
        fail()
    assert calls == [(1, 2)]
    with pytest.raises(jitflow.NoActiveTaskError):
        async with jitflow.stage("x"):
            pass


@pytest.mark.anyio
async def test_a_tasks_waiting_time_is_the_admission_bound_of_each_call_that_sets_none():
    server = FakeServer()
    client = make_client(server)
    async with client.task("patient", deadline=60, waiting_time=12) as t:
        assert t.waiting_time == 12.0
        async with t.stage("s") as st:
            await st.chat(MSG)  # the task's compound SLO, with the task's waiting time
            await st.chat(MSG, waiting_time=3)  # the call's own wins
            await st.chat(MSG, slo=jitflow.Deadline(4))  # an explicit SLO without one gets the task's
            await st.chat(MSG, slo=jitflow.Deadline(4, waiting_time=2))  # an explicit SLO's own wins
    async with client.task("default", deadline=60):
        await client.chat.completions.create(messages=MSG)  # an implicit stage
    slos = [c["slo"] for c in server.calls]
    assert slos[0]["kind"] == "compound" and slos[0]["waiting_time"] == 12.0
    assert [s.get("waiting_time") for s in slos] == [12.0, 3.0, 12.0, 2.0, None]  # None: the server's default

    @jitflow.agent(app="patient-agent", deadline=60, client=client, waiting_time=7)
    async def one() -> None:
        await client.chat.completions.create(messages=MSG)

    await one()
    assert server.calls[-1]["slo"]["waiting_time"] == 7.0
    for bad in (0, -1, float("inf")):
        with pytest.raises(ValueError, match="waiting_time"):
            client.task("x", deadline=1, waiting_time=bad)
        with pytest.raises(ValueError, match="waiting_time"):
            jitflow.agent(app="x", deadline=1, waiting_time=bad)
    with pytest.raises(TypeError, match="waiting_time"):
        client.task("x", deadline=1, waiting_time="5")
    await client.aclose()


@pytest.mark.anyio
async def test_deadline_raise_and_best_effort():
    server = FakeServer()
    client = make_client(server)
    with pytest.raises(jitflow.DeadlineExceededError) as ei:
        async with client.task("late", deadline=0.02) as t:
            await anyio.sleep(0.05)
            async with t.stage("too-late"):
                pass
    assert ei.value.stage == "too-late" and ei.value.elapsed > 0.02
    assert server.tasks[t.task_id]["complete"]["outcome"] == "deadline_missed"

    async with client.task("late2", deadline=0.02, on_deadline="best_effort") as t2:
        await anyio.sleep(0.05)
        async with t2.stage("after") as st:
            assert st.best_effort
            await st.chat(MSG)
            await st.chat(MSG, slo=jitflow.Deadline(4))  # explicit SLO wins
    assert server.calls[0]["slo"] == {"kind": "best_effort"}
    assert server.calls[1]["slo"]["kind"] == "deadline"
    assert t2.outcome == "deadline_missed"
    with pytest.raises(ValueError):
        client.task("x", deadline=-1)
    with pytest.raises(ValueError):
        client.task("x", deadline=1, on_deadline="ignore")
    with pytest.raises(TypeError):
        jitflow.agent(app="x", deadline="10")
    await client.aclose()


@pytest.mark.anyio
async def test_telemetry_to_dead_server_never_blocks_and_counts_drops():
    server = FakeServer()

    def dead(request: httpx.Request):
        raise httpx.ConnectError("refused", request=request)

    server.telemetry = dead
    client = make_client(server, telemetry_flush_timeout=1.0)

    @jitflow.agent(app="offline", deadline=10, client=client)
    async def agent() -> str:
        async with jitflow.stage("s") as st:
            r = await st.chat(MSG)
            await web_search("x")
        return r.content

    t0 = time.monotonic()
    with pytest.warns(jitflow.TelemetryWarning):
        assert await agent() == "tok tok tok "
    elapsed = time.monotonic() - t0
    assert elapsed < 1.5  # bounded by the flush timeout, no hang
    st = client.telemetry
    assert st.registration_failures == 1 and st.sent == 0
    # registration + stage_start + llm + tool + stage_end + complete: all dropped, none lost silently
    assert st.dropped == 6 and st.failed_attempts >= 2
    assert len(server.calls) == 1  # the LLM call itself went through
    await client.aclose()


@pytest.mark.anyio
async def test_telemetry_to_hanging_server_is_bounded_and_buffer_is_bounded():
    server = FakeServer()

    async def hang(request: httpx.Request):
        await anyio.sleep(30)

    server.telemetry = hang
    client = make_client(server, telemetry_register_timeout=0.1, telemetry_flush_timeout=0.2,
                         telemetry_buffer=4)
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jitflow.TelemetryWarning)
        async with client.task("hung", deadline=10) as task:
            assert time.monotonic() - t0 < 0.5  # registration wait was brief
            async with task.stage("s"):
                for _ in range(20):
                    parse("abc")  # each posts a tool event without blocking
    assert time.monotonic() - t0 < 1.5
    assert not task.registered
    # 4 slots: the retried registration + 3 events; the rest overflowed, the queue was dropped at exit
    assert client.telemetry.dropped >= 20
    assert client.telemetry.sent == 0
    await client.aclose()


@pytest.mark.anyio
async def test_default_client_via_configure(monkeypatch):
    server = FakeServer()
    monkeypatch.setenv("JITFLOW_BASE_URL", "http://env-host:9000")
    jitflow.configure(transport=server.async_transport(), model="demo")
    try:
        c = jitflow.get_client()
        assert c.base_url == "http://env-host:9000" and jitflow.get_client() is c

        @jitflow.agent(app="dflt", deadline=5)
        async def agent() -> str:
            async with jitflow.stage("only") as st:
                return (await st.chat(MSG, max_tokens=1)).content

        assert await agent() == "tok "
        assert len(server.tasks) == 1
        explicit = make_client(server)
        jitflow.configure(client=explicit)
        assert jitflow.get_client() is explicit
        await explicit.aclose()
        await c.aclose()
    finally:
        jitflow.configure()


def test_agent_rejects_sync_functions():
    with pytest.raises(TypeError, match="async"):

        @jitflow.agent(app="x", deadline=1)
        def not_async() -> None:
            pass


@pytest.mark.anyio
async def test_task_view_and_explicit_parents():
    server = FakeServer()
    client = make_client(server)
    async with client.task("view", deadline=10) as task:
        async with task.stage("a") as st:
            r1 = await st.chat(MSG)
            await st.chat(MSG)
        async with task.stage("b") as st:
            await st.chat(MSG, parents=[r1.call_id])
    view = await task.view()
    assert view["task_id"] == task.task_id and view["complete"]["outcome"] == "succeeded"
    assert server.calls[2]["jitflow"]["parents"] == [r1.call_id]
    with pytest.raises(jitflow.NotFoundError):
        await client.get_task("nope")
    await client.aclose()


@pytest.mark.anyio
async def test_sync_tool_in_worker_thread_keeps_stage_context():
    server = FakeServer()
    client = make_client(server)
    async with client.task("threads", deadline=10) as task:
        async with task.stage("s0") as st0:
            await st0.chat(MSG)
        async with task.stage("s1"):
            assert await anyio.to_thread.run_sync(parse, "abcd") == 4
    await client.aclose()
    (ev,) = events_of(server, task.task_id, "tool")
    assert ev["stage"] == "s1" and ev["stage_index"] == 1 and ev["parents"] == st0.call_ids


@pytest.mark.anyio
async def test_cancelled_task_is_reported_failed():
    server = FakeServer()
    client = make_client(server)
    holder: list[jitflow.Task] = []
    with anyio.move_on_after(0.05) as scope:
        async with client.task("cancelled", deadline=10) as task:
            holder.append(task)
            async with task.stage("wait"):
                await anyio.sleep(5)
    assert scope.cancelled_caught
    task = holder[0]
    done = server.tasks[task.task_id]["complete"]  # delivered despite the outer cancellation
    assert done["outcome"] == "failed" and task.outcome == "failed"
    assert [e["type"] for e in events_of(server, task.task_id)] == ["stage_start", "stage_end"]
    assert jitflow.current_task() is None and jitflow.current_stage() is None
    await client.aclose()
