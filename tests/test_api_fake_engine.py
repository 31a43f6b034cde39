"""The HTTP API and the task manager through the ``Engine`` seam: a real HTTP server on 127.0.0.1 (uvicorn
in a thread) around the deterministic ``FakeEngine``. What reaches the engine is checked on the
``GenerateRequest`` values it received, so these tests see the hints contract, admission control and
clean-up without a model."""

from __future__ import annotations

import contextlib
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


@pytest.fixture()
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("JITFLOW_HISTORY_DB", str(tmp_path / "history.db"))
    monkeypatch.delenv("JITFLOW_PATTERNS", raising=False)
    monkeypatch.delenv("JITFLOW_LENGTH_TELEMETRY", raising=False)
    return tmp_path


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
                          json={"model": "fake", "messages": MSG, "stream": True}, timeout=30) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert '"usage"' in lines[-2] and '"completion_tokens":3' in lines[-2]
        assert sum('" t' in ln for ln in lines) == 3


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
