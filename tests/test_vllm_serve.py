"""`jitflow vllm-serve`: vLLM's own OpenAI server with the jitflow plug-in, SLOs in ``vllm_xargs``."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from conftest import free_port, jitflow_exe, running_server

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    cmd = [jitflow_exe(), "vllm-serve", "--model", "tiny", "--port", str(free_port()), "--policy", "gmax",
           "--batch-size", "2", "--max-model-len", "4096"]
    with running_server(cmd, log, dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")) as (url, _):
        yield url


@pytest.mark.xfail(strict=False, reason="flaky like the ordering tests of test_plugin_engine.py: in some full "
                   "runs the two long requests are no longer running right after the probe (see issue 3)")
def test_vllm_server_with_plugin_follows_gmax(vllm_url):
    stop = threading.Event()
    progress = [0, 0]

    def hog(i: int) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "story"}], "max_tokens": 4000,
                "ignore_eos": True, "stream": True, "vllm_xargs": {"jf_kind": "best_effort"}}
        with httpx.Client(timeout=120) as c, c.stream("POST", vllm_url + "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    progress[i] += 1
                if stop.is_set():
                    break

    threads = [threading.Thread(target=hog, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    try:
        t0 = time.time()

        def engine_running() -> float:  # the engine's own count, not the client's view of the streams
            lines = httpx.get(vllm_url + "/metrics").text.splitlines()
            return max([float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("vllm:num_requests_running")],
                       default=0.0)

        while engine_running() < 2 and time.time() - t0 < 60:
            time.sleep(0.05)
        assert engine_running() >= 2, "best-effort requests did not start"
        metrics_before = [x for x in httpx.get(vllm_url + "/metrics").text.splitlines()
                          if x.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting",
                                           "vllm:num_preemptions"))]
        t1 = time.time()
        r = httpx.post(vllm_url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "quick"}], "max_tokens": 40,
            "ignore_eos": True, "vllm_xargs": {"jf_kind": "deadline", "jf_deadline": 3.0, "jf_arrival": t1,
                                                  # what the jitflow server sends by default: admission
                                                  # within 5 s, so GMAX admits it at once (JIT otherwise
                                                  # defers it until its laxity runs low)
                                                  "jf_waiting_time": 5.0}})
        e2el = time.time() - t1
        metrics = httpx.get(vllm_url + "/metrics").text
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 40
    # With B=2 both slots are held by 4,000-token requests; only a scheduler that ranks the deadline
    # request first finishes it while both are still unfinished (vLLM's FCFS would wait for one to end).
    running = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:num_requests_running")]
    assert running and running[0] == 2, (running, e2el, progress, metrics_before)
    assert e2el < 8.0, e2el  # generous: client-side time on a shared machine
