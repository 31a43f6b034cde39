"""Request limits: hostile JSON schemas and oversized bodies get a clear 4xx before reaching the engine.
A real HTTP server on 127.0.0.1 around the FakeEngine."""

from __future__ import annotations

import time

import httpx
import pytest

from jitflow_server.api.limits import MAX_SCHEMA_COUNT, MAX_SCHEMA_DEPTH, check_json_schema
from jitflow_server.api.schemas import APIError
from jitflow_server.api.state import ServerSettings
from jitflow_server.engine.fake import FakeEngine
from test_api_fake_engine import MSG, serve

pytestmark = pytest.mark.usefixtures("env")


def _refused(schema: dict, max_tokens: int = 256) -> APIError:
    with pytest.raises(APIError) as ei:
        check_json_schema(schema, max_tokens)
    assert ei.value.status == 400
    return ei.value


def test_schema_limits_name_the_offending_field() -> None:
    err = _refused({"type": "array", "minItems": 100_000_000})
    assert err.param == "response_format.json_schema.schema.minItems" and str(MAX_SCHEMA_COUNT) in err.message
    err = _refused({"type": "object", "properties": {"a": {"type": "array", "minItems": 300}}}, max_tokens=256)
    assert err.param == "response_format.json_schema.schema.properties.a.minItems" and "max_tokens" in err.message
    check_json_schema({"type": "string", "minLength": 300}, 256)  # a token may hold several characters
    deep: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        deep = {"type": "array", "items": deep}
    assert "deeper" in _refused(deep).message
    assert "bytes" in _refused({"enum": ["x" * 70_000]}).message
    assert "objects and arrays" in _refused({"anyOf": [{}] * 5000}).message
    # an ordinary schema, and a generous upper bound, pass
    check_json_schema({"type": "object", "properties": {"tags": {"type": "array", "maxItems": 50,
                                                                 "items": {"type": "string", "maxLength": 40}}}},
                      256)


def test_hostile_schema_is_refused_before_the_engine() -> None:
    eng = FakeEngine(eos_after=3)
    with serve(eng) as (url, _):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "minItems": 10**8}}}
        r = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG, "max_tokens": 16,
                                                           "response_format": fmt}, timeout=30)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "response_format.json_schema.schema.minItems" and err["type"] == "invalid_request_error"
        assert not eng.requests  # nothing reached the engine
        ok = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG, "max_tokens": 8},
                        timeout=30)
        assert ok.status_code == 200


def test_oversized_body_gets_413_and_the_server_stays_responsive() -> None:
    eng = FakeEngine(eos_after=3)
    with serve(eng, ServerSettings(max_body_bytes=4096)) as (url, _):
        big = {"model": "fake", "messages": [{"role": "user", "content": "x" * 10_000}]}
        r = httpx.post(url + "/v1/chat/completions", json=big, timeout=30)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large" and r.json()["error"]["param"] is None

        def chunks():  # no Content-Length: the limit applies while the body streams in
            for _ in range(10):
                yield b"x" * 1000

        r = httpx.post(url + "/v1/chat/completions", content=chunks(), timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        small = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG, "max_tokens": 4},
                           timeout=30)
        assert small.status_code == 200
        assert not any(len(q.prompt_token_ids) > 1000 for q in eng.requests.values())


@pytest.mark.parametrize(("event", "param"), [
    ({"type": "llm", "call_id": "c", "input_tokens": 2**80}, "events[0].input_tokens"),
    ({"type": "llm", "call_id": "c", "output_tokens": -1}, "events[0].output_tokens"),
    ({"type": "stage_start", "stage_index": 0, "time": float("nan")}, "events[0].time"),
    ({"type": "tool", "call_id": "c", "start": "inf"}, "events[0].start"),
    ({"type": "tool", "call_id": "c", "start": 1e300, "end": 1e300}, "events[0].start"),  # once a 500
    ({"type": "llm", "stage_index": 10**9}, "events[0].stage_index"),
    ({"type": "walk", "stage_index": 0}, "events[0]"),
    ({"type": "llm", "call_id": "c", "parents": ["c"]}, "events[0].parents"),
])
def test_hostile_task_events_get_400_naming_the_field_and_leave_the_task_usable(event, param) -> None:
    eng = FakeEngine(eos_after=3)
    with serve(eng) as (url, _):
        assert httpx.post(url + "/v1/tasks", json={"task_id": "t", "app": "a", "deadline": 30}).status_code == 201
        good = {"type": "llm", "call_id": "ok", "model": "m", "input_tokens": 10, "output_tokens": 5}
        r = httpx.post(url + "/v1/tasks/t/events", content=_json({"events": [event, good]}),
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        # nothing of the refused batch was applied; the task still reads and completes
        assert httpx.get(url + "/v1/tasks/t", timeout=30).status_code == 200
        assert httpx.post(url + "/v1/tasks/t/events", json={"events": [good]}, timeout=30).json()["applied"] == 1
        done = httpx.post(url + "/v1/tasks/t/complete", json={"outcome": "succeeded"}, timeout=30)
        assert done.status_code == 200, done.text


def _json(obj) -> bytes:
    import json

    return json.dumps(obj).encode()  # allows NaN, as a hostile client would send it


def test_a_dependency_cycle_between_calls_does_not_break_the_task() -> None:
    eng = FakeEngine(eos_after=3)
    with serve(eng) as (url, _):
        assert httpx.post(url + "/v1/tasks", json={"task_id": "t", "app": "a", "deadline": 30}).status_code == 201
        cyc = [{"type": "llm", "call_id": "a", "parents": ["b"], "output_tokens": 3},
               {"type": "llm", "call_id": "b", "parents": ["a"], "output_tokens": 4}]
        r = httpx.post(url + "/v1/tasks/t/events", json={"events": cyc}, timeout=30)
        assert r.status_code in (200, 400), r.text
        assert httpx.get(url + "/v1/tasks/t", timeout=30).status_code == 200
        assert httpx.post(url + "/v1/tasks/t/complete", json={"outcome": "succeeded"}, timeout=30).status_code == 200
        assert httpx.get(url + "/v1/tasks/t", timeout=30).status_code == 200


def test_task_table_and_task_sizes_are_bounded(monkeypatch) -> None:
    from jitflow_server.api import tasks as tasks_mod

    monkeypatch.setattr(tasks_mod, "MAX_TASK_CALLS", 5)
    eng = FakeEngine(eos_after=3)
    with serve(eng) as (url, state):
        big = {"task_id": "m", "app": "a", "deadline": 30, "metadata": {"blob": "x" * 20_000}}
        r = httpx.post(url + "/v1/tasks", json=big, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
        r = httpx.post(url + "/v1/tasks", content=_json({"task_id": "s", "app": "a", "deadline": 30,
                                                         "start_time": float("nan")}),
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "start_time"
        assert httpx.post(url + "/v1/tasks", json={"task_id": "t", "app": "a", "deadline": 30}).status_code == 201
        calls = [{"type": "llm", "call_id": f"c{i}", "output_tokens": 1} for i in range(6)]
        r = httpx.post(url + "/v1/tasks/t/events", json={"events": calls}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "events"
        assert httpx.post(url + "/v1/tasks/t/events", json={"events": calls[:5]}, timeout=30).status_code == 200
        # abandoned tasks (deadline long past, never completed) make room when the table is full
        mgr = state.tasks
        mgr.max_tasks = 3
        for i in range(3):
            httpx.post(url + "/v1/tasks", json={"task_id": f"old{i}", "app": "a", "deadline": 1})
        for i in range(3):
            mgr.tasks[f"old{i}"].t0 -= 3600  # their deadlines passed an hour ago
        assert httpx.post(url + "/v1/tasks", json={"task_id": "new", "app": "a", "deadline": 30}).status_code == 201
        assert len(mgr.tasks) <= 3 and "new" in mgr.tasks and "t" in mgr.tasks


def test_non_streaming_request_is_aborted_when_its_client_disconnects() -> None:
    eng = FakeEngine(eos_after=100_000, step_s=0.05)  # 20 tokens/s: the 1 500 asked take 75 s
    with serve(eng) as (url, state):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG, "max_tokens": 1500},
                       timeout=httpx.Timeout(1.0))
        t0 = time.time()
        while (state.in_flight or state.live) and time.time() - t0 < 5:
            time.sleep(0.05)
        assert state.in_flight == 0 and not state.live  # the server let go of the call
        (req,) = eng.requests.values()
        assert any(e[1] == "abort" and e[2] == req.request_id for e in state.events)
        assert not eng._running and not eng._waiting  # and nothing is left running in the engine


def test_queued_stream_is_aborted_when_its_client_leaves_before_the_first_token() -> None:
    eng = FakeEngine(eos_after=100_000, step_s=0.05, batch_size=1)  # one slot, held for 75 s below
    with serve(eng) as (url, state):
        with httpx.Client(timeout=120) as c:
            # a stream holds the only slot...
            with c.stream("POST", url + "/v1/chat/completions",
                          json={"model": "fake", "messages": MSG, "max_tokens": 1500, "stream": True}) as busy:
                assert busy.status_code == 200
                # ...so this best-effort stream (no admission deadline: it would wait for the slot) is queued,
                # and its client gives up before any byte of the answer
                with pytest.raises(httpx.ReadTimeout):
                    with httpx.stream("POST", url + "/v1/chat/completions", timeout=httpx.Timeout(1.0),
                                      json={"model": "fake", "messages": MSG, "max_tokens": 8, "stream": True,
                                            "slo": {"kind": "best_effort"}}):
                        pass
                queued = [rid for rid in eng.requests if rid not in {r.request.request_id for r in eng._running}]
                assert len(queued) == 1
                t0 = time.time()
                while (eng._waiting or queued[0] in state.live) and time.time() - t0 < 10:
                    time.sleep(0.05)
                assert not eng._waiting and queued[0] not in state.live  # left the queue, never prefilled
                assert any(e[1] == "abort" and e[2] == queued[0] and "tokens=0" in e[3] for e in state.events)
                assert len(eng._running) == 1 and state.in_flight == 1  # the other stream is untouched


@pytest.mark.parametrize(("extra", "param"), [
    ({"messages": [{"role": "user", "content": "a \ud800 lone surrogate"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages[0].content"),
    ({"stop": "\ud800"}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": ""}, "stop"),  # found by `jitflow bench chaos`: vLLM refuses it, and that was a 500
    ({"stop": ["x", ""]}, "stop"),
    ({"seed": 2**64}, "seed"),
    ({"min_tokens": 9}, "min_tokens"),
])
def test_bad_sampling_fields_get_400_naming_the_field(extra, param) -> None:
    eng = FakeEngine(eos_after=3)
    with serve(eng) as (url, _):
        body = {"model": "fake", "messages": MSG, "max_tokens": 8, **extra}
        raw = _json(body).decode().encode("utf-8", "surrogatepass")
        r = httpx.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert not eng.requests


def test_long_prompts_are_tokenized_off_the_event_loop() -> None:
    import threading

    loops: list[str] = []

    class SlowTokenizer(FakeEngine):
        def encode(self, text: str) -> list[int]:
            loops.append(threading.current_thread().name)
            if len(text) > 40_000:
                time.sleep(1.5)  # a slow tokenizer on a long prompt
            return super().encode(text)[:100]

    eng = SlowTokenizer(eos_after=2)
    with serve(eng) as (url, _):
        result: dict = {}

        def long_request() -> None:
            result["r"] = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x" * 50_000,
                                                                    "max_tokens": 2}, timeout=30)

        th = threading.Thread(target=long_request)
        th.start()
        time.sleep(0.3)
        t0 = time.time()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert time.time() - t0 < 1.0  # answered while the long prompt was being tokenized
        th.join(timeout=30)
        assert result["r"].status_code == 200
        short = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert short.status_code == 200
        # the long prompt was tokenized on a worker thread, the short one inline on the event loop's thread
        assert len(loops) == 2 and loops[0] != loops[1]
