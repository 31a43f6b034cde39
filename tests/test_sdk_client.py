"""SDK clients: requests on the wire, responses, streaming, typed errors.

httpx.MockTransport stands in for the server (allowed for SDK unit tests); every async test runs
under asyncio and trio.
"""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

import jitflow
from conftest_sdk import FakeServer, TrackingStream, error, sse, timing


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


MSG = [{"role": "user", "content": "hello"}]


def make_client(server: FakeServer, **kw) -> jitflow.AsyncClient:
    return jitflow.AsyncClient("http://test:8123", transport=server.async_transport(), **kw)


# --------------------------------------------------------------------------- non-streaming
@pytest.mark.anyio
async def test_chat_sends_slo_and_returns_timing():
    server = FakeServer()
    async with make_client(server) as client:
        r = await client.chat.completions.create(
            model="demo", messages=MSG, max_tokens=4, temperature=0.5,
            slo=jitflow.Latency(ttft=2, tbt=0.1), waiting_time=3, seed=7,
        )
    assert isinstance(r, jitflow.ChatCompletion)
    assert r.content == "tok " * 4
    assert r.usage.completion_tokens == 4
    assert isinstance(r.jitflow, jitflow.Timing)
    assert r.jitflow.kind == "latency" and r.jitflow.output_tokens == 4
    assert r.jitflow.first_token_time >= r.jitflow.arrival
    body = server.calls[0]
    assert body["slo"] == {"kind": "latency", "ttft": 2.0, "tbt": 0.1, "waiting_time": 3.0}
    assert body["max_tokens"] == 4 and body["temperature"] == 0.5 and body["seed"] == 7
    assert "stream" not in body and "jitflow" not in body  # no task context outside a task
    assert r.call_id is None


@pytest.mark.anyio
@pytest.mark.parametrize(
    "slo, wire",
    [
        (jitflow.Deadline(20), {"kind": "deadline", "deadline": 20.0}),
        (jitflow.BestEffort(), {"kind": "best_effort"}),
        (jitflow.Compound(deadline=9), {"kind": "compound", "deadline": 9.0}),
        ({"kind": "deadline", "deadline": 5}, {"kind": "deadline", "deadline": 5.0}),
        (None, None),
    ],
)
async def test_slo_kinds_on_the_wire(slo, wire):
    server = FakeServer()
    async with make_client(server) as client:
        await client.chat.completions.create(model="demo", messages=MSG, slo=slo)
    assert server.calls[0].get("slo") == wire


@pytest.mark.anyio
async def test_bad_inputs_raise_before_sending():
    server = FakeServer()
    async with make_client(server) as client:
        with pytest.raises(ValueError, match="deadline"):
            await client.chat.completions.create(model="demo", messages=MSG, slo={"kind": "deadline"})
        with pytest.raises(ValueError):
            await client.chat.completions.create(model="demo", messages=MSG, slo=jitflow.BestEffort(),
                                                 waiting_time=-1)
        with pytest.raises(ValueError, match="waiting_time"):
            await client.chat.completions.create(model="demo", messages=MSG, waiting_time=2)
        with pytest.raises(ValueError, match="messages"):
            await client.chat.completions.create(model="demo", messages=[])
        with pytest.raises(ValueError, match="messages"):
            await client.chat.completions.create(model="demo", messages="hi")
        with pytest.raises(TypeError):
            await client.chat.completions.create(model="demo", messages=MSG, slo=3)
    assert server.calls == []


@pytest.mark.anyio
async def test_completions_models_and_default_model():
    server = FakeServer(models=("m-a", "m-b"))
    async with make_client(server) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["m-a", "m-b"]
        c = await client.completions.create(prompt="once upon", max_tokens=2, slo=jitflow.Deadline(3))
        assert isinstance(c, jitflow.Completion) and c.content == "tok tok "
        assert server.calls[0]["model"] == "m-a"  # resolved from /v1/models
        assert server.calls[0]["prompt"] == "once upon"
    async with make_client(server, model="m-b") as client:
        await client.chat.completions.create(messages=MSG)
    assert server.calls[-1]["model"] == "m-b"


@pytest.mark.anyio
async def test_headers_api_key_traceparent_and_v1_base_url():
    server = FakeServer()
    client = jitflow.AsyncClient("http://test:8123/v1/", api_key="sk-x", transport=server.async_transport())
    assert client.base_url == "http://test:8123"
    await client.chat.completions.create(model="demo", messages=MSG)
    await client.aclose()
    h = server.headers[0]
    assert h["authorization"] == "Bearer sk-x"
    assert h["user-agent"].startswith("jitflow-python/")
    # traceparent is only injected when a real (recording or sampled) span exists; with the
    # default no-op provider there is no valid span context, so nothing is required here.
    with pytest.raises(ValueError):
        jitflow.AsyncClient("ftp://nope")


# --------------------------------------------------------------------------- streaming
@pytest.mark.anyio
async def test_stream_yields_chunks_and_final_timing():
    server = FakeServer()
    async with make_client(server) as client:
        stream = await client.chat.completions.create(
            model="demo", messages=MSG, max_tokens=5, stream=True, slo=jitflow.Deadline(20)
        )
        assert isinstance(stream, jitflow.AsyncStream)
        text, chunks = "", []
        async with stream:
            async for chunk in stream:
                assert isinstance(chunk, jitflow.ChatCompletionChunk)
                chunks.append(chunk)
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
        assert text == "tok " * 5
        assert chunks[-1].choices == [] and chunks[-1].jitflow is not None
        assert stream.timing == chunks[-1].jitflow and stream.timing.kind == "deadline"
        assert stream.usage.completion_tokens == 5
        assert stream.finish_reasons == ["length"]
    body = server.calls[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert server.streams[0].closed


@pytest.mark.anyio
async def test_stream_context_manager_closes_response_on_early_exit():
    server = FakeServer()
    async with make_client(server) as client:
        stream = await client.chat.completions.create(model="demo", messages=MSG, max_tokens=50, stream=True)
        async with stream:
            async for _chunk in stream:
                break
        assert server.streams[0].closed
        assert stream.timing is None  # never reached the final chunk
        # completions stream: chunks are Completion objects
        cstream = await client.completions.create(model="demo", prompt="x", max_tokens=2, stream=True)
        async with cstream:
            got = [c async for c in cstream]
        assert all(isinstance(c, jitflow.Completion) for c in got)
        assert "".join(c.content for c in got) == "tok tok "
        assert cstream.timing is not None and server.streams[1].closed


@pytest.mark.anyio
async def test_mid_stream_error_event_raises_stream_error():
    server = FakeServer()
    chunk = {"id": "c1", "model": "demo", "choices": [{"index": 0, "delta": {"content": "a"}}]}
    body = sse([chunk, {"error": {"message": "engine died", "type": "engine_error", "param": None,
                                  "code": 503}}], done=False)
    stream_body = TrackingStream(body)
    server.route = lambda req: httpx.Response(200, stream=stream_body,
                                              headers={"content-type": "text/event-stream"})
    async with make_client(server) as client:
        stream = await client.chat.completions.create(model="demo", messages=MSG, stream=True)
        seen = []
        with pytest.raises(jitflow.StreamError) as ei:
            async for c in stream:
                seen.append(c)
    assert len(seen) == 1
    assert ei.value.status_code == 503 and ei.value.type == "engine_error"
    assert "engine died" in str(ei.value)
    assert isinstance(ei.value, jitflow.APIStatusError)
    assert stream_body.closed


@pytest.mark.anyio
async def test_sse_multiline_comments_and_missing_done():
    server = FakeServer()
    c1 = {"id": "c1", "model": "demo", "choices": [{"index": 0, "delta": {"content": "a"}}]}
    final = json.dumps({"id": "c1", "model": "demo", "choices": [], "jitflow": timing({}, 1)})
    cut = final.index(', "model"') + 1  # one event split over two data: lines (joined by "\n")
    raw = (b": keepalive\n\n" + f"data: {json.dumps(c1)}\r\n\r\n".encode()
           + b"event: chunk\ndata: " + final[:cut].encode() + b"\ndata:" + final[cut:].encode())
    server.route = lambda req: httpx.Response(200, content=raw)  # no [DONE], no final blank line
    async with make_client(server) as client:
        stream = await client.chat.completions.create(model="demo", messages=MSG, stream=True)
        chunks = [c async for c in stream]
    assert len(chunks) == 2
    assert chunks[0].choices[0].delta.content == "a"
    assert stream.timing is not None and stream.timing.output_tokens == 1


# --------------------------------------------------------------------------- errors
@pytest.mark.anyio
@pytest.mark.parametrize(
    "status, type_, exc",
    [
        (400, "invalid_request_error", jitflow.BadRequestError),
        (404, "not_found_error", jitflow.NotFoundError),
        (422, "invalid_request_error", jitflow.UnprocessableEntityError),
        (429, "rate_limit_error", jitflow.RateLimitError),
        (500, "engine_error", jitflow.InternalServerError),
        (502, "bad_gateway", jitflow.InternalServerError),
        (409, "conflict", jitflow.APIStatusError),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_status_errors_are_typed(status, type_, exc, stream):
    server = FakeServer()
    server.route = lambda req: error(status, "bad slo.deadline", type_, "slo.deadline")
    async with make_client(server, max_retries=0) as client:
        with pytest.raises(exc) as ei:
            await client.chat.completions.create(model="demo", messages=MSG, stream=stream)
    e = ei.value
    assert type(e) is exc
    assert e.status_code == status and e.param == "slo.deadline" and e.message == "bad slo.deadline"
    assert e.body["error"]["type"] == type_
    assert not isinstance(e, jitflow.AdmissionRejectedError)


@pytest.mark.anyio
@pytest.mark.parametrize("status", [429, 503])
async def test_admission_rejected_with_retry_after(status):
    server = FakeServer()
    server.route = lambda req: error(status, "queue full", "admission_rejected", "slo.waiting_time",
                                     headers={"Retry-After": "2.5"})
    async with make_client(server, max_retries=0) as client:
        with pytest.raises(jitflow.AdmissionRejectedError) as ei:
            await client.chat.completions.create(model="demo", messages=MSG, stream=True,
                                                 slo=jitflow.Latency(2, 0.1, waiting_time=1))
    assert ei.value.retry_after == 2.5 and ei.value.status_code == status


@pytest.mark.anyio
async def test_unknown_model_and_fastapi_style_detail():
    server = FakeServer()
    async with make_client(server) as client:
        with pytest.raises(jitflow.NotFoundError) as ei:
            await client.chat.completions.create(model="nope", messages=MSG)
        assert ei.value.param == "model"
        server.route = lambda req: httpx.Response(422, json={"detail": [{"loc": ["body", "x"]}]})
        with pytest.raises(jitflow.UnprocessableEntityError, match="loc"):
            await client.chat.completions.create(model="demo", messages=MSG)
        server.route = lambda req: httpx.Response(200, json={"not": "a completion"})
        with pytest.raises(jitflow.APIError, match="unexpected response"):
            await client.chat.completions.create(model="demo", messages=MSG)


@pytest.mark.anyio
async def test_connection_and_timeout_errors():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    def slow(request):
        raise httpx.ReadTimeout("slow", request=request)

    async with jitflow.AsyncClient("http://test", transport=httpx.MockTransport(refuse)) as client:
        with pytest.raises(jitflow.APIConnectionError) as ei:
            await client.chat.completions.create(model="demo", messages=MSG)
        assert not isinstance(ei.value, jitflow.APITimeoutError)
        with pytest.raises(jitflow.APIConnectionError):
            await client.models.list()
    async with jitflow.AsyncClient("http://test", transport=httpx.MockTransport(slow)) as client:
        with pytest.raises(jitflow.APITimeoutError):
            await client.chat.completions.create(model="demo", messages=MSG, stream=True)


def test_retry_after_parsing():
    from jitflow._exceptions import parse_retry_after

    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:05 GMT", now=1445412480.0) == pytest.approx(5.0)


# --------------------------------------------------------------------------- sync twin
def test_sync_client_chat_stream_and_errors():
    server = FakeServer()
    with jitflow.Client("http://test:8123", transport=server.sync_transport(), max_retries=0) as client:
        r = client.chat.completions.create(model="demo", messages=MSG, max_tokens=2, slo=jitflow.Deadline(4))
        assert r.content == "tok tok " and r.jitflow.kind == "deadline"
        with client.chat.completions.create(model="demo", messages=MSG, max_tokens=3, stream=True) as s:
            chunks = list(s)
        assert len(chunks) == 4 and s.timing is not None and server.streams[0].closed
        with client.chat.completions.create(model="demo", messages=MSG, max_tokens=30, stream=True) as s:
            next(iter(s))
        assert server.streams[1].closed
        c = client.completions.create(prompt="x", max_tokens=1)
        assert c.content == "tok "
        assert [m.id for m in client.models.list().data] == ["demo"]
        server.route = lambda req: error(429, "full", "admission_rejected", None, {"Retry-After": "1"})
        with pytest.raises(jitflow.AdmissionRejectedError) as ei:
            client.chat.completions.create(model="demo", messages=MSG)
        assert ei.value.retry_after == 1.0


def test_one_client_across_event_loops():
    server = FakeServer()
    client = make_client(server)
    pools = []

    async def use() -> str:
        pools.append(client._http)
        r = await client.chat.completions.create(model="demo", messages=MSG, max_tokens=1)
        assert client._http is pools[-1]  # stable within one loop
        return r.content

    assert anyio.run(use) == "tok "
    assert anyio.run(use, backend="trio") == "tok "
    assert anyio.run(use) == "tok "
    assert len({id(p) for p in pools}) == 3  # a fresh httpx pool per event loop
    anyio.run(client.aclose)
