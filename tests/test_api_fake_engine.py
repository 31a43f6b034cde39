"""The HTTP API and the task manager through the ``Engine`` seam: a real HTTP server on 127.0.0.1 (uvicorn
in a thread) around the deterministic ``FakeEngine``. What reaches the engine is checked on the
``GenerateRequest`` values it received, so these tests see the hints contract, admission control and
clean-up without a model."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time

import httpx
import pytest
import uvicorn

from jitflow_server.api.app import ServerSettings, create_app
from jitflow_server.bench.server_process import free_port
from jitflow_server.engine.fake import FakeEngine
from jitflow_server.scheduler import Kind

MSG = [{"role": "user", "content": "plan the trip"}]


@contextlib.contextmanager
def serve(engine: FakeEngine, settings: ServerSettings | None = None):
    """Run the app on 127.0.0.1 in a background thread; yields the base URL; stops it on exit."""
    port = free_port()
    app = create_app(engine, settings or ServerSettings(), owns_engine=True)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while not server.started:
        if time.time() - t0 > 20 or not th.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield url, app.state.jitflow
    finally:
        server.should_exit = True
        th.join(timeout=20)


def _chat(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG, **body}, timeout=30)


def test_chat_reaches_the_engine_with_typed_hints(env):
    eng = FakeEngine(eos_after=5)
    with serve(eng) as (url, state):
        r = _chat(url, max_tokens=12, slo={"kind": "latency", "ttft": 5, "tbt": 1})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == " t0 t1 t2 t3 t4"
        assert body["usage"]["completion_tokens"] == 5 and body["jitflow"]["slo_met"] is True
        (req,) = eng.requests.values()
        h = req.hints
        assert req.request_id == body["id"] == h.request_id
        assert h.kind is Kind.LATENCY and (h.ttft, h.tbt) == (5.0, 1.0)
        assert h.waiting_time == ServerSettings().default_waiting_time  # server default for SLO requests
        assert 1 <= h.len_bound <= 12 and h.arrival == pytest.approx(body["jitflow"]["arrival"])
        assert not state.live and state.in_flight == 0


def test_ignore_eos_gives_the_exact_length_as_bound(env):
    eng = FakeEngine()
    with serve(eng) as (url, _):
        r = _chat(url, max_tokens=40, ignore_eos=True, slo={"kind": "deadline", "deadline": 30})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
        (req,) = eng.requests.values()
        assert req.hints.len_bound == 40 and req.hints.kind is Kind.DEADLINE and req.hints.deadline == 30


@pytest.mark.parametrize("key", ["jf_len_bound", "jitflow_hints", "jf_true_len"])
def test_client_cannot_send_scheduling_hints(env, key):
    eng = FakeEngine()
    with serve(eng) as (url, _):
        r = _chat(url, vllm_xargs={key: "1"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == f"vllm_xargs.{key}" and "reserved" in err["message"]
        assert eng.requests == {}  # nothing reached the engine
        assert _chat(url, max_tokens=3, vllm_xargs={"custom": 1}).status_code == 200


def test_request_not_admitted_in_time_gets_429_and_leaves_nothing_behind(env):
    eng = FakeEngine()
    with serve(eng) as (url, state):
        assert httpx.post(url + "/v1/jitflow/engine/pause").json() == {"paused": True}
        t0 = time.time()
        r = _chat(url, max_tokens=4, slo={"kind": "deadline", "deadline": 10, "waiting_time": 0.3})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "admission_rejected"
        assert time.time() - t0 < 5
        assert eng.rejected == 1 and eng.num_unfinished_frontend() == 0
        assert not state.live and state.in_flight == 0 and state.waiting_first_token == 0
        assert state.length is None or state.length.latest(next(iter(eng.requests))) is None
        httpx.post(url + "/v1/jitflow/engine/resume")
        assert _chat(url, max_tokens=2).status_code == 200


def test_stream_sends_chunks_usage_and_done(env):
    eng = FakeEngine(eos_after=3)
    with serve(eng) as (url, _):
        with httpx.stream("POST", url + "/v1/chat/completions",
                          json={"model": "fake", "messages": MSG, "stream": True,
                                "stream_options": {"include_usage": True}}, timeout=30) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert '"usage"' in lines[-2] and '"completion_tokens":3' in lines[-2]
        assert sum('" t' in ln for ln in lines) == 3
        with httpx.stream("POST", url + "/v1/chat/completions",
                          json={"model": "fake", "messages": MSG, "stream": True}, timeout=30) as r:
            plain = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert all(c["choices"] for c in plain) and all("usage" not in c for c in plain)
        assert plain[-1]["choices"][0]["finish_reason"] and plain[-1]["jitflow"]["output_tokens"] == 3


def test_oracle_policy_is_refused_on_a_served_engine(env):
    eng = FakeEngine()
    with serve(eng) as (url, _):
        r = httpx.post(url + "/v1/jitflow/policy", json={"name": "oracle"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "params"
        assert httpx.post(url + "/v1/jitflow/policy", json={"name": "edf"}).json()["policy"] == "edf"


def test_compound_call_gets_task_hints_from_the_server(env):
    eng = FakeEngine(eos_after=4)
    with serve(eng) as (url, _):
        r = httpx.post(url + "/v1/tasks", json={"task_id": "t-1", "app": "demo-app", "deadline": 20,
                                                "start_time": 12.0})  # a client clock far off
        assert r.status_code == 201
        t_reg = time.time()
        ctx = {"task_id": "t-1", "stage": "plan", "stage_index": 0, "call_id": "c0"}
        r = _chat(url, max_tokens=8, jitflow=ctx)
        assert r.status_code == 200, r.text
        (req,) = eng.requests.values()
        h = req.hints
        assert h.kind is Kind.COMPOUND and h.task_id == "t-1" and h.stage_index == 0
        # the task deadline is counted from the server's registration time, not the client's start_time
        assert h.deadline == pytest.approx(20 - (h.arrival - t_reg), abs=0.5)
        assert h.sub_deadline is not None and 0 < h.sub_deadline <= h.deadline + 1e-6
        task = httpx.get(url + "/v1/tasks/t-1").json()
        assert task["stages"][0]["calls"][0]["output_tokens"] == 4


def test_errors_have_openai_shape_for_unknown_routes_and_models(env):
    with serve(FakeEngine()) as (url, _):
        r = httpx.get(url + "/v1/no-such-route")
        assert r.status_code == 404
        assert r.json() == {"error": {"message": "no route GET /v1/no-such-route", "type": "not_found_error",
                                      "param": None, "code": None}}
        r = httpx.post(url + "/v1/chat/completions", json={"model": "other", "messages": MSG})
        err = r.json()["error"]
        assert r.status_code == 404 and err["param"] == "model" and err["code"] == "model_not_found"
        assert httpx.get(url + "/v1/chat/completions").json()["error"]["type"] == "invalid_request_error"


def test_models_by_id_and_request_ids_as_openai_serves_them(env):
    with serve(FakeEngine()) as (url, _):
        listed = httpx.get(url + "/v1/models").json()["data"][0]
        one = httpx.get(url + f"/v1/models/{listed['id']}")
        assert one.status_code == 200 and one.json() == listed
        r = httpx.get(url + "/v1/models/other-model")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # every answer names its request: the client's own id is echoed, else the server makes one
        mine = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG, "max_tokens": 2},
                          headers={"x-request-id": "trace-42"})
        assert mine.status_code == 200 and mine.headers["x-request-id"] == "trace-42"
        made = {httpx.get(url + "/v1/no-such-route").headers["x-request-id"] for _ in range(2)}
        assert len(made) == 2 and all(m.startswith("req_") for m in made)
        bad = httpx.get(url + "/health", headers={"x-request-id": "x" * 500})  # too long: replaced
        assert bad.headers["x-request-id"].startswith("req_")


def test_http_metrics_count_requests_by_route_and_status_class(env):
    with serve(FakeEngine(eos_after=2)) as (url, _):
        for _ in range(3):
            assert _chat(url, max_tokens=4).status_code == 200
        assert _chat(url, max_tokens=0).status_code == 400
        httpx.get(url + "/health")
        text = httpx.get(url + "/metrics").text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("http_requests_total{")}
    chat = 'handler="/v1/chat/completions",method="POST"'
    assert samples[f'http_requests_total{{{chat},status="2xx"}}'] == 3
    assert samples[f'http_requests_total{{{chat},status="4xx"}}'] == 1
    assert not any("/health" in k or "/metrics" in k for k in samples)  # probes and scrapes: not counted
    assert f"http_request_duration_seconds_count{{{chat}}} 4.0" in text  # and their latency


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_unsupported_openai_features_are_refused_not_dropped(env, extra, param):
    with serve(FakeEngine()) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        # asking for nothing is fine (what clients send by default)
        ok = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG, "max_tokens": 2,
                                                          "tools": [], "tool_choice": "none", "logprobs": False})
        assert ok.status_code == 200


def test_task_context_in_headers_reaches_the_task_under_its_app(env):
    """A client that cannot add body fields (a proxy, a library that sends only OpenAI's body) sends the
    SLO and task context as headers; the implicit task lands under its app and is stored once over."""
    eng = FakeEngine(eos_after=3)
    with serve(eng) as (url, state):
        head = {"x-jitflow-task-id": "h-1", "x-jitflow-app": "header-app", "x-jitflow-stage": "plan",
                "x-jitflow-stage-index": "0", "x-jitflow-slo-kind": "compound", "x-jitflow-deadline": "0.5"}
        r = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG, "max_tokens": 3},
                       headers=head, timeout=30)
        assert r.status_code == 200, r.text
        (req,) = eng.requests.values()
        assert req.hints.kind is Kind.COMPOUND and req.hints.task_id == "h-1"
        assert httpx.get(url + "/v1/tasks/h-1").json()["app"] == "header-app"
        time.sleep(0.6)  # past the deadline, calls all ended: the server closes the implicit task
        assert state.tasks.close_implicit(idle_s=0.0) == 1
        task = httpx.get(url + "/v1/tasks/h-1").json()
        assert task["outcome"] == "succeeded" and task["stored_graph_id"] is not None
        assert state.tasks.store.count("header-app") == 1
        bad = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG},
                         headers={**head, "x-jitflow-deadline": "soon"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-jitflow-deadline"
        bad = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG},
                         headers={**head, "x-jitflow-stage-index": "-1"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-jitflow-stage-index"


@pytest.mark.parametrize("mode", ["sub_deadline", "waiting_time"])
def test_compound_call_waits_for_its_start_until_its_sub_deadline(env, mode):
    """An agent task's call may wait past the waiting time until its stage's sub-deadline (a rejected call
    fails its task); with ``compound_waiting="waiting_time"`` it is rejected at its waiting time (the SDK
    sends a task's ``waiting_time`` with each call)."""
    eng = FakeEngine(eos_after=3)
    eng.paused = True  # nothing starts until the test resumes the engine
    settings = ServerSettings(compound_waiting=mode)
    with serve(eng, settings) as (url, _):
        assert httpx.post(url + "/v1/tasks", json={"task_id": "w-1", "app": "demo-app", "deadline": 30}
                          ).status_code == 201
        ctx = {"task_id": "w-1", "stage": "plan", "stage_index": 0, "call_id": "c0"}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(_chat, url, max_tokens=8, jitflow=ctx, slo={"waiting_time": 0.5})
            time.sleep(1.5)  # three waiting times
            eng.paused = False
            r = fut.result(timeout=30)
        (req,) = eng.requests.values()
        h = req.hints
        if mode == "sub_deadline":
            assert h.sub_deadline > 1.5 and h.waiting_time == pytest.approx(h.sub_deadline)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
        else:
            assert h.waiting_time == 0.5
            assert r.status_code == 429 and r.json()["error"]["code"] == "admission_rejected"
            assert r.headers["Retry-After"] == "1"
