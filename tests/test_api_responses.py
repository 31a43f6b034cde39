"""``POST /v1/responses`` through a real HTTP server on 127.0.0.1 (the deterministic ``FakeEngine`` behind
it): the official ``openai`` client and jitflow's SDK, streaming and not, Concord's SLO fields reaching the
engine as hints, and every unserved Responses feature refused with a 400 naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

import jitflow
from jitflow_server.engine.fake import FakeEngine
from jitflow_server.scheduler import Kind
from test_api_fake_engine import serve


def _post(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json={"model": "fake", "input": "plan the trip", **body}, timeout=30)


def test_the_openai_client_gets_a_response_with_concord_slo_fields(env):
    eng = FakeEngine(eos_after=4)
    with serve(eng) as (url, state):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        r = client.responses.create(model="fake", input="plan the trip", instructions="be brief",
                                    max_output_tokens=16, extra_body={"deadline": 30, "waiting_time": 5})
        assert r.status == "completed" and r.output_text == " t0 t1 t2 t3"
        assert r.usage.output_tokens == 4 and r.usage.input_tokens > 0 and r.id.startswith("resp_")
        (req,) = eng.requests.values()
        assert req.request_id == r.id and req.hints.kind is Kind.DEADLINE and req.hints.deadline == 30
        assert req.hints.waiting_time <= 5 and req.max_tokens == 16
        assert not state.live and state.in_flight == 0


def test_latency_targets_become_a_latency_slo_and_the_stream_has_openai_events(env):
    eng = FakeEngine(eos_after=3)
    with serve(eng) as (url, state):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        events = list(client.responses.create(model="fake", input=[{"role": "user", "content": "hi"}], stream=True,
                                              extra_body={"target_ttft": 5, "target_tbt": 1}))
        types = [e.type for e in events]
        assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.completed"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        final = events[-1].response
        assert deltas == final.output_text == " t0 t1 t2" and final.usage.output_tokens == 3
        (req,) = eng.requests.values()
        assert req.hints.kind is Kind.LATENCY and (req.hints.ttft, req.hints.tbt) == (5.0, 1.0)
        assert not state.live and state.in_flight == 0


def test_max_output_tokens_cut_makes_the_response_incomplete(env):
    with serve(FakeEngine()) as (url, _):
        body = _post(url, max_output_tokens=16).json()  # OpenAI's least
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert body["usage"]["output_tokens"] == 16


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x", "detail": "auto"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"target_ttft": 2}, "target_tbt"),
    ({"deadline": 10, "target_ttft": 1, "target_tbt": 0.1}, "deadline"),
    ({"deadline": 10, "slo": {"kind": "deadline", "deadline": 10}}, "deadline"),
    ({"deadline": -1}, "deadline"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
])
def test_unserved_features_are_refused_naming_the_field(env, extra, param):
    eng = FakeEngine()
    with serve(eng) as (url, _):
        r = _post(url, **extra)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error"
        assert eng.requests == {}  # nothing reached the engine
        # what clients send by default asks for nothing and is served
        ok = _post(url, max_output_tokens=16, tools=[], tool_choice="auto", store=False, include=[])
        assert ok.status_code == 200, ok.text


def test_the_sdk_creates_responses_with_slos_and_streams_them(env):
    eng = FakeEngine(eos_after=3)
    with serve(eng) as (url, _):
        with jitflow.Client(base_url=url) as client:
            r = client.responses.create(input="plan the trip", deadline=20, max_output_tokens=16)
            assert isinstance(r, jitflow.Response) and r.output_text == " t0 t1 t2"
            assert r.jitflow.kind == "deadline" and r.jitflow.slo_met is True and r.usage.output_tokens == 3
            with client.responses.create(input="again", target_ttft=5, target_tbt=1, stream=True) as stream:
                text = "".join(e.delta or "" for e in stream if e.type == "response.output_text.delta")
            assert text == " t0 t1 t2" and stream.timing.kind == "latency" and stream.usage.output_tokens == 3
            with pytest.raises(ValueError, match="target_tbt"):
                client.responses.create(input="x", target_ttft=1)
            with pytest.raises(jitflow.BadRequestError):
                client.responses.create(input="x", extra_body={"store": True})
        kinds = [req.hints.kind for req in eng.requests.values()]
        assert kinds == [Kind.DEADLINE, Kind.LATENCY]


def test_a_response_inside_a_compound_task_gets_task_hints(env):
    eng = FakeEngine(eos_after=2)
    with serve(eng) as (url, _):
        r = _post(url, deadline=30, jitflow={"task_id": "r-1", "app": "resp-app", "stage": "plan"})
        assert r.status_code == 200, r.text
        (req,) = eng.requests.values()
        assert req.hints.kind is Kind.COMPOUND and req.hints.task_id == "r-1"
        assert httpx.get(url + "/v1/tasks/r-1").json()["app"] == "resp-app"
