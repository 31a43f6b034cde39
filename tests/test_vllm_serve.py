"""`jitflow vllm-serve`: vLLM's own OpenAI server with the jitflow plug-in, SLOs in ``vllm_xargs``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    exe = Path(sys.executable).with_name("jitflow")
    cmd = [str(exe), "vllm-serve", "--model", "tiny", "--port", str(port), "--policy", "gmax",
           "--batch-size", "2", "--max-model-len", "4096"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.time() - t0 > 420:
                raise RuntimeError(f"vllm-serve not healthy:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_vllm_server_with_plugin_follows_gmax(vllm_url):
    stop = threading.Event()
    progress = [0, 0]

    def hog(i: int) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "story"}], "max_tokens": 3000,
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
        while min(progress) < 5 and time.time() - t0 < 60:
            time.sleep(0.05)
        assert min(progress) >= 5, "best-effort requests did not start"
        t1 = time.time()
        r = httpx.post(vllm_url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "quick"}], "max_tokens": 40,
            "ignore_eos": True, "vllm_xargs": {"jf_kind": "deadline", "jf_deadline": 3.0, "jf_arrival": t1}})
        e2el = time.time() - t1
        hog_tokens = list(progress)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 40
    # With B=2 both slots are held by 3,000-token requests; only a scheduler that ranks the
    # deadline request first can finish it within 3 s (vLLM's FCFS would wait for a hog to end).
    assert e2el < 3.0, (e2el, hog_tokens)
    assert max(hog_tokens) < 3000
