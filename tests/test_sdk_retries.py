"""SDK retries of 429/503 answers and of connections that failed before an answer (``max_retries``): Retry-After, back-off, the deadline rule,
what is never retried, logging, ``error.attempts`` and one telemetry record per logical call.

httpx.MockTransport stands in for the server (``FakeServer`` of conftest_sdk.py); async tests run
under asyncio and trio. Waits are Retry-After: 0 except in the tests that measure them.
"""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import jitflow
from conftest_sdk import FakeServer, error, sse
from jitflow import _retries

MSG = [{"role": "user", "content": "hello"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def rejected(retry_after: str | None = "0", status: int = 429) -> httpx.Response:
    """The server's admission-control rejection (OpenAI error shape, Retry-After header)."""
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return error(status, "queue full", "admission_rejected", "slo.waiting_time", headers)


class Script:
    """Answers the first chat/completions requests with ``responses`` (then the FakeServer's normal
    completion) and records every such request's arrival time (monotonic s) and JSON body."""

    def __init__(self, server: FakeServer, *responses: httpx.Response) -> None:
        self.responses = list(responses)
        self.times: list[float] = []
        self.bodies: list[dict] = []
        server.route = self

    def __call__(self, request: httpx.Request) -> httpx.Response | None:
        if request.url.path not in (CHAT, "/v1/completions"):
            return None
        self.times.append(time.monotonic())
        self.bodies.append(json.loads(request.content))
        return self.responses.pop(0) if self.responses else None

    @property
    def count(self) -> int:
        return len(self.times)


def async_client(server: FakeServer, **kw) -> jitflow.AsyncClient:
    return jitflow.AsyncClient("http://test:8123", transport=server.async_transport(), **kw)


def sync_client(server: FakeServer, **kw) -> jitflow.Client:
    return jitflow.Client("http://test:8123", transport=server.sync_transport(), **kw)


# --------------------------------------------------------------------------- succeeds after a 429
@pytest.mark.anyio
async def test_async_429_then_ok_is_retried(caplog):
    server = FakeServer()
    script = Script(server, rejected("0"))
    with caplog.at_level(logging.INFO, logger="jitflow"):
        async with async_client(server) as client:
            r = await client.chat.completions.create(model="demo", messages=MSG, max_tokens=2)
    assert r.content == "tok tok "
    assert script.count == 2 and script.bodies[0] == script.bodies[1] == server.calls[0]
    retries = [rec for rec in caplog.records if rec.name == "jitflow" and "retry 1 of 2" in rec.getMessage()]
    assert len(retries) == 1 and retries[0].levelno == logging.INFO
    assert "429" in retries[0].getMessage() and "AdmissionRejectedError" in retries[0].getMessage()


def test_sync_429_then_ok_is_retried():
    server = FakeServer()
    script = Script(server, rejected("0"))
    with sync_client(server) as client:
        r = client.chat.completions.create(model="demo", messages=MSG, max_tokens=2)
    assert r.content == "tok tok " and script.count == 2


def test_a_retry_keeps_the_callers_deadline():
    server = FakeServer()
    script = Script(server, rejected("1"))
    with sync_client(server) as client:
        client.chat.completions.create(model="demo", messages=MSG, max_tokens=2, slo=jitflow.Deadline(30))
    first, retry = (b["slo"] for b in script.bodies)
    waited = script.times[1] - script.times[0]
    assert first["deadline"] == 30 and waited >= 1.0
    # the server measures from the retry's arrival: it gets what is left of the caller's 30 s
    assert retry["deadline"] == pytest.approx(30 - waited, abs=0.05) and retry["kind"] == "deadline"


@pytest.mark.anyio
async def test_a_retried_latency_call_keeps_its_token_due_times():
    server = FakeServer()
    script = Script(server, rejected("1"))
    async with async_client(server) as client:
        await client.chat.completions.create(model="demo", messages=MSG, max_tokens=2,
                                             slo=jitflow.Latency(ttft=5, tbt=0.2))
    first, retry = (b["slo"] for b in script.bodies)
    waited = script.times[1] - script.times[0]
    assert retry["ttft"] == pytest.approx(5 - waited, abs=0.05) and retry["tbt"] == first["tbt"] == 0.2
    assert {k: v for k, v in retry.items() if k != "ttft"} == {k: v for k, v in first.items() if k != "ttft"}


@pytest.mark.anyio
@pytest.mark.parametrize("first", [
    rejected("0", status=503),
    error(429, "slow down", "rate_limit_error", None, {"Retry-After": "0"}),
    error(503, "engine restarting", "server_error", None, {"Retry-After": "0"}),
], ids=["admission-503", "rate-limit-429", "plain-503"])
async def test_every_429_and_503_is_retried(first):
    server = FakeServer()
    script = Script(server, first)
    async with async_client(server) as client:
        c = await client.completions.create(model="demo", prompt="x", max_tokens=1)
    assert c.content == "tok " and script.count == 2


# --------------------------------------------------------------------------- exhausted / disabled
@pytest.mark.anyio
async def test_async_retries_exhausted_keep_the_error_type():
    server = FakeServer()
    script = Script(server, rejected("0"), rejected("0"), rejected("0"), rejected("0"))
    async with async_client(server, max_retries=2) as client:
        with pytest.raises(jitflow.AdmissionRejectedError) as ei:
            await client.chat.completions.create(model="demo", messages=MSG)
    assert type(ei.value) is jitflow.AdmissionRejectedError
    assert ei.value.attempts == 3 and script.count == 3
    assert ei.value.status_code == 429 and ei.value.retry_after == 0.0


def test_sync_retries_exhausted_keep_the_error_type():
    server = FakeServer()
    script = Script(server, *(rejected("0") for _ in range(5)))
    with sync_client(server, max_retries=2) as client, pytest.raises(jitflow.AdmissionRejectedError) as ei:
        client.chat.completions.create(model="demo", messages=MSG)
    assert ei.value.attempts == 3 and script.count == 3


@pytest.mark.anyio
async def test_max_retries_zero_disables_retries():
    server = FakeServer()
    script = Script(server, rejected("0"), rejected("0"))
    async with async_client(server, max_retries=0) as client:
        with pytest.raises(jitflow.AdmissionRejectedError) as ei:
            await client.chat.completions.create(model="demo", messages=MSG)
    assert ei.value.attempts == 1 and script.count == 1
    server2 = FakeServer()
    script2 = Script(server2, rejected("0"))
    with sync_client(server2, max_retries=0) as client, pytest.raises(jitflow.AdmissionRejectedError):
        client.chat.completions.create(model="demo", messages=MSG)
    assert script2.count == 1


@pytest.mark.parametrize("bad", [-1, 1.5, "2", None, True])
def test_max_retries_is_validated(bad):
    with pytest.raises(ValueError, match="max_retries"):
        jitflow.AsyncClient("http://test", max_retries=bad)
    with pytest.raises(ValueError, match="max_retries"):
        jitflow.Client("http://test", max_retries=bad)
    assert jitflow.Client("http://test").max_retries == jitflow.DEFAULT_MAX_RETRIES == 2


# --------------------------------------------------------------------------- never retried
@pytest.mark.anyio
@pytest.mark.parametrize("status, exc", [(400, jitflow.BadRequestError), (404, jitflow.NotFoundError),
                                         (422, jitflow.UnprocessableEntityError),
                                         (500, jitflow.InternalServerError)])
async def test_other_errors_are_not_retried(status, exc):
    server = FakeServer()
    script = Script(server, error(status, "no", "invalid_request_error", "slo", {"Retry-After": "0"}))
    async with async_client(server) as client:
        with pytest.raises(exc) as ei:
            await client.chat.completions.create(model="demo", messages=MSG)
    assert script.count == 1 and ei.value.attempts == 1


def test_sync_400_is_not_retried():
    server = FakeServer()
    script = Script(server, error(400, "bad", "invalid_request_error", "max_tokens"))
    with sync_client(server) as client, pytest.raises(jitflow.BadRequestError):
        client.chat.completions.create(model="demo", messages=MSG)
    assert script.count == 1


@pytest.mark.anyio
async def test_connection_errors_before_an_answer_are_retried_but_timeouts_are_not():
    """A keep-alive connection the server closes as the request goes out fails with ReadError before any
    answer: retried, as the OpenAI client does. A timeout is not (the server may be working on it)."""
    seen = []
    server = FakeServer()
    inner = server.async_transport()

    class DropFirst(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            seen.append(request)
            if len(seen) == 1:
                raise httpx.ReadError("", request=request)
            return await inner.handle_async_request(request)

    async with jitflow.AsyncClient("http://test:8123", transport=DropFirst()) as client:
        r = await client.chat.completions.create(model="demo", messages=MSG, max_tokens=2)
    assert r.content == "tok tok " and len(seen) == 2

    def refuse(request):
        seen.append(request)
        raise httpx.ConnectError("refused", request=request)

    seen.clear()
    async with jitflow.AsyncClient("http://test", transport=httpx.MockTransport(refuse), max_retries=1) as client:
        with pytest.raises(jitflow.APIConnectionError) as ei:
            await client.chat.completions.create(model="demo", messages=MSG)
    assert len(seen) == 2 and ei.value.attempts == 2

    def slow(request):
        seen.append(request)
        raise httpx.ReadTimeout("slow", request=request)

    seen.clear()
    async with jitflow.AsyncClient("http://test", transport=httpx.MockTransport(slow)) as client:
        with pytest.raises(jitflow.APITimeoutError):
            await client.chat.completions.create(model="demo", messages=MSG)
    assert len(seen) == 1


# --------------------------------------------------------------------------- streaming
@pytest.mark.anyio
async def test_stream_429_before_the_stream_is_retried():
    server = FakeServer()
    script = Script(server, rejected("0"))
    async with async_client(server) as client:
        stream = await client.chat.completions.create(model="demo", messages=MSG, max_tokens=3, stream=True)
        async with stream:
            chunks = [c async for c in stream]
    assert script.count == 2 and len(chunks) == 4 and stream.attempts == 2
    assert stream.timing is not None and server.streams[0].closed


def test_sync_stream_429_before_the_stream_is_retried():
    server = FakeServer()
    script = Script(server, rejected("0", status=503))
    with sync_client(server) as client:
        with client.chat.completions.create(model="demo", messages=MSG, max_tokens=2, stream=True) as s:
            chunks = list(s)
    assert script.count == 2 and len(chunks) == 3


@pytest.mark.anyio
async def test_stream_error_after_tokens_is_not_retried():
    server = FakeServer()
    chunk = {"id": "c1", "model": "demo", "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]}
    body = sse([chunk, {"error": {"message": "overloaded", "type": "server_error", "code": 503}}], done=False)
    script = Script(server, httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"".join(body)))
    async with async_client(server) as client:
        stream = await client.chat.completions.create(model="demo", messages=MSG, stream=True)
        got = []
        with pytest.raises(jitflow.StreamError) as ei:
            async with stream:
                async for c in stream:
                    got.append(c)
    assert len(got) == 1 and ei.value.status_code == 503
    assert script.count == 1 and ei.value.attempts == 1


# --------------------------------------------------------------------------- waits and deadlines
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])  # one backend is enough to measure a 1 s wait
async def test_retry_after_is_honoured(anyio_backend):
    server = FakeServer()
    script = Script(server, rejected("1"))
    async with async_client(server) as client:
        await client.chat.completions.create(model="demo", messages=MSG)
    assert script.count == 2 and script.times[1] - script.times[0] >= 0.9


def test_sync_retry_after_is_honoured():
    server = FakeServer()
    script = Script(server, rejected("1", status=503))
    with sync_client(server) as client:
        client.chat.completions.create(model="demo", messages=MSG)
    assert script.count == 2 and script.times[1] - script.times[0] >= 0.9


def test_backoff_without_retry_after(monkeypatch):
    monkeypatch.setattr(_retries, "INITIAL_RETRY_DELAY", 0.1)
    server = FakeServer()
    script = Script(server, rejected(None), rejected(None))
    with sync_client(server) as client:
        client.chat.completions.create(model="demo", messages=MSG)
    first, second = (b - a for a, b in zip(script.times, script.times[1:]))
    assert script.count == 3
    assert 0.07 <= first < 0.5 and 0.14 <= second < 0.6  # 0.1 then 0.2, less up to 25 % jitter


def test_retry_delay_policy():
    e = jitflow.AdmissionRejectedError(429, None, "full", retry_after=None)
    for n, base in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0), (9, 8.0), (5000, 8.0)]:
        d = [_retries.retry_delay(e, n) for _ in range(50)]
        assert all(0.75 * base <= x <= base for x in d), (n, min(d), max(d))
    e.retry_after = 3.0
    assert _retries.retry_delay(e, 1) == 3.0
    e.retry_after = 600.0
    assert _retries.retry_delay(e, 1) == 60.0


@pytest.mark.anyio
async def test_deadline_slo_is_not_slept_past():
    server = FakeServer()
    script = Script(server, rejected("5"), rejected("0"))
    async with async_client(server) as client:
        t0 = time.monotonic()
        with pytest.raises(jitflow.AdmissionRejectedError) as ei:
            await client.chat.completions.create(model="demo", messages=MSG, slo=jitflow.Deadline(1))
        elapsed = time.monotonic() - t0
    assert elapsed < 0.5 and script.count == 1 and ei.value.attempts == 1 and ei.value.retry_after == 5.0


def test_sync_deadline_slo_is_not_slept_past_but_short_waits_are_taken():
    server = FakeServer()
    script = Script(server, rejected("0"), rejected("5"))
    with sync_client(server) as client:
        t0 = time.monotonic()
        with pytest.raises(jitflow.AdmissionRejectedError) as ei:
            client.chat.completions.create(model="demo", messages=MSG, slo={"kind": "deadline", "deadline": 1})
    assert time.monotonic() - t0 < 0.5 and script.count == 2 and ei.value.attempts == 2


@pytest.mark.anyio
async def test_latency_slo_has_no_deadline_to_stop_retries():
    server = FakeServer()
    script = Script(server, rejected("0"), rejected("0"))
    async with async_client(server) as client:
        await client.chat.completions.create(model="demo", messages=MSG, slo=jitflow.Latency(0.5, 0.1))
    assert script.count == 3


# --------------------------------------------------------------------------- tasks, telemetry, spans
@pytest.mark.anyio
async def test_task_deadline_bounds_retries():
    server = FakeServer()
    script = Script(server, rejected("5"))
    async with async_client(server, model="demo", telemetry_backoff=0.01) as client:
        t0 = time.monotonic()
        with pytest.raises(jitflow.AdmissionRejectedError):
            async with client.task("t", deadline=1) as task:
                async with task.stage("s") as st:
                    await st.chat(MSG)
    assert time.monotonic() - t0 < 0.5 and script.count == 1


def _tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    """A tracer provider exporting finished spans to memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@pytest.mark.anyio
async def test_a_call_that_exhausts_its_retries_is_one_failed_record():
    provider, exporter = _tracing()
    server = FakeServer()
    script = Script(server, *(rejected("0") for _ in range(3)))
    async with async_client(server, model="demo", telemetry_backoff=0.01, tracer_provider=provider,
                            max_retries=2) as client:
        with pytest.raises(jitflow.AdmissionRejectedError) as ei:
            async with client.task("t", deadline=30) as task:
                async with task.stage("s") as st:
                    await st.chat(MSG)
    provider.shutdown()
    assert script.count == 3 and ei.value.attempts == 3
    assert len([e for e in server.tasks[task.task_id]["events"] if e["type"] == "llm"]) == 1
    (call,) = task.stages[0].calls
    assert call.error is not None and call.error.startswith("AdmissionRejectedError")
    (chat,) = [sp for sp in exporter.get_finished_spans() if sp.name == "chat demo"]
    assert chat.attributes["error.type"] == "AdmissionRejectedError" and chat.attributes["jitflow.attempts"] == 3


@pytest.mark.anyio
async def test_a_retried_call_is_one_telemetry_record_and_one_span():
    provider, exporter = _tracing()
    server = FakeServer()
    script = Script(server, rejected("0"), rejected("0", status=503))
    async with async_client(server, model="demo", telemetry_backoff=0.01, tracer_provider=provider) as client:
        async with client.task("t", deadline=30) as task:
            async with task.stage("s") as st:
                r = await st.chat(MSG, max_tokens=2)
    provider.shutdown()
    assert script.count == 3 and r.content == "tok tok "
    llm = [e for e in server.tasks[task.task_id]["events"] if e["type"] == "llm"]
    assert len(llm) == 1 and llm[0]["call_id"] == r.call_id and llm[0]["output_tokens"] == 2
    assert [c.call_id for c in task.stages[0].calls] == [r.call_id]
    # every attempt carries the same call id (the server sees one logical call)
    assert {b["jitflow"]["call_id"] for b in script.bodies} == {r.call_id}
    (chat,) = [sp for sp in exporter.get_finished_spans() if sp.name == "chat demo"]
    assert chat.attributes["jitflow.attempts"] == 3
    assert [ev.name for ev in chat.events] == ["jitflow.retry", "jitflow.retry"]
