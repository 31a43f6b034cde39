"""`jitflow vllm-serve`: vLLM's own OpenAI server with the jitflow plug-in; a front end sends each request's
``SchedHints`` in ``vllm_xargs`` under ``jitflow_hints``."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from conftest import free_port, jitflow_exe, running_server
from jitflow_server.scheduler.hints import SchedHints
from longstream import LongStream

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    cmd = [jitflow_exe(), "vllm-serve", "--model", "tiny", "--port", str(free_port()), "--policy", "gmax",
           "--batch-size", "2", "--max-model-len", "4096"]
    # VLLM_SERVER_DEV_MODE: vLLM's /pause and /resume, to queue the long requests so they start together
    with running_server(cmd, log, dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1")) as (url, _):
        yield url


def test_vllm_server_with_plugin_follows_gmax(vllm_url):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "story"}], "max_tokens": 4000,
            "ignore_eos": True, "vllm_xargs": SchedHints(kind="best_effort").to_extra_args()}

    def engine_count(what: str) -> float:  # the engine's own counts, not the client's view of the streams
        lines = httpx.get(vllm_url + "/metrics").text.splitlines()
        return max([float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(f"vllm:num_requests_{what}")],
                   default=0.0)

    def wait_count(what: str, n: int) -> None:
        t0 = time.time()
        while engine_count(what) < n and time.time() - t0 < 120:
            time.sleep(0.05)
        assert engine_count(what) >= n, f"the engine did not reach {n} {what} requests"

    hogs: list[LongStream] = []
    try:
        # queued while paused so both start in the same step (see test_plugin_engine.py)
        httpx.post(vllm_url + "/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
        try:
            hogs += [LongStream(vllm_url, body) for _ in range(2)]  # read in child processes
            # vLLM publishes no metrics while paused: wait until both requests were sent, then let the
            # server (idle, so prompt) queue them
            t0 = time.time()
            while not all("send" in h.phases for h in hogs) and time.time() - t0 < 120:
                time.sleep(0.05)
            assert all("send" in h.phases for h in hogs), [h.describe() for h in hogs]
            time.sleep(1.0)
        finally:
            httpx.post(vllm_url + "/resume", timeout=60).raise_for_status()
        wait_count("running", 2)
        metrics_before = [x for x in httpx.get(vllm_url + "/metrics").text.splitlines()
                          if x.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting",
                                           "vllm:num_preemptions"))]
        t1 = time.time()
        r = httpx.post(vllm_url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "quick"}], "max_tokens": 40,
            "ignore_eos": True,
            # what the jitflow server sends by default: admission within 5 s, so GMAX admits it at once
            # (JIT otherwise defers it until its laxity runs low)
            "vllm_xargs": SchedHints(kind="deadline", deadline=3.0, arrival=t1, waiting_time=5.0).to_extra_args()})
        e2el = time.time() - t1
        metrics = httpx.get(vllm_url + "/metrics").text
    finally:
        for h in hogs:
            h.close()
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 40
    # With B=2 both slots are held by 4,000-token requests; only a scheduler that ranks the deadline
    # request first finishes it while both are still unfinished (vLLM's FCFS would wait for one to end).
    running = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:num_requests_running")]
    assert running and running[0] == 2, (running, e2el, [h.describe() for h in hogs], metrics_before)
    assert e2el < 20.0, e2el  # client-side time, generous: a long request needs far longer alone
