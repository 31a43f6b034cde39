"""Scheduling behaviour on the real vLLM engine with the jitflow plug-in (tiny model).

Scenarios are built so the outcome is certain on any machine speed: the engine is
saturated (B=2) by two best-effort requests of 4,000 tokens each (the test server's context
is 4,096), which take many seconds even on a fast CPU, while the probe request needs ~40
decode steps.

Two things make them independent of the test client's own timing, which on the 2-core CI
machine is not reliable (a client process can be left without CPU for 10+ s while the engine
runs; measured): the long requests are submitted while the engine is paused
(``/v1/jitflow/engine/pause``), so they start in the same step; and every ordering claim is
judged on the engine's own event timeline (``/v1/jitflow/engine/events``), not on when the
client happened to look.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

import jitflow
from conftest import wait_idle
from longstream import LongStream

pytestmark = pytest.mark.engine

MSG = [{"role": "user", "content": "Write a long story about schedules."}]
HOG_TOKENS = 4000


def long_request(url: str, max_tokens: int = HOG_TOKENS) -> LongStream:
    """A long best-effort streaming request, read in a child process (see ``longstream.py``)."""
    return LongStream(url, {"model": "tiny", "messages": MSG, "max_tokens": max_tokens, "ignore_eos": True,
                            "slo": {"kind": "best_effort"}})


def wait_for(c: httpx.Client, pred: Callable[[dict], bool], what: str, hogs: list[LongStream],
             timeout: float = 120.0) -> dict:
    """Poll ``/v1/jitflow/engine`` until ``pred(stats)``; fail naming ``what`` (with the stats) on timeout."""
    t0 = time.time()
    st: dict = {}
    while time.time() - t0 < timeout:
        bad = [h.describe() for h in hogs if h.error is not None]
        assert not bad, f"a long request failed: {bad}"
        st = c.get("/v1/jitflow/engine").json()
        if pred(st):
            return st
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached in {timeout} s: {st}; long requests: {[h.describe() for h in hogs]}")


@contextmanager
def paused(c: httpx.Client) -> Iterator[None]:
    """Hold the engine's scheduling (nothing is lost) for the duration of the block."""
    assert c.post("/v1/jitflow/engine/pause").json()["paused"] is True
    try:
        yield
    finally:
        assert c.post("/v1/jitflow/engine/resume").json()["paused"] is False


def engine_events(c: httpx.Client) -> list[tuple[float, str, str, str]]:
    """The engine's recent request events ``(unix s, event, engine request id, detail)``."""
    return [tuple(e) for e in c.get("/v1/jitflow/engine/events").json()["engine"]]


def when(events: list, kind: str, rid: str) -> float:
    """Time of the first ``kind`` event of the server request ``rid`` (engine ids extend it); inf if none."""
    return min((t for t, k, r, _ in events if k == kind and r.startswith(rid)), default=float("inf"))


@contextmanager
def explain(c: httpx.Client, hogs: list[LongStream]) -> Iterator[None]:
    """On an assertion failure, append the server's and the engine's recent request events."""
    try:
        yield
    except AssertionError as exc:
        try:
            ev = c.get("/v1/jitflow/engine/events").json()
            lines = sorted([(e[0], "server", *e[1:]) for e in ev["server"]] +
                           [(e[0], "engine", *e[1:]) for e in ev["engine"]])
            t0 = lines[0][0] if lines else 0.0
            text = "\n".join(f"{t - t0:9.3f} {src:6} {kind:11} {rid} {d}" for t, src, kind, rid, d in lines[-80:])
        except Exception as e2:  # the diagnostics must not hide the failure
            text = f"(events unavailable: {e2})"
        raise AssertionError(f"{exc}\nlong requests: {[h.describe() for h in hogs]}\n"
                             f"recent events (s since first):\n{text}") from exc


def start_long_requests(c: httpx.Client, url: str, n: int) -> list[LongStream]:
    """Submit ``n`` long requests while the engine is paused, so they start together; wait until they run."""
    hogs: list[LongStream] = []
    with paused(c):
        hogs = [long_request(url) for _ in range(n)]
        wait_for(c, lambda st: st["waiting"] >= n, f"{n} queued long requests", hogs)
    wait_for(c, lambda st: st["running"] >= n, f"{n} running long requests", hogs)
    for h in hogs:  # their server request ids arrive with the response headers
        assert h.started.wait(120), h.describe()
    return hogs


def _probe(c: httpx.Client, deadline: float, max_tokens: int = 40) -> dict:
    r = c.post("/v1/chat/completions", timeout=400, json={
        "model": "tiny", "messages": [{"role": "user", "content": "quick"}], "max_tokens": max_tokens,
        "ignore_eos": True, "slo": {"kind": "deadline", "deadline": deadline, "waiting_time": 300}})
    assert r.status_code == 200, r.text
    return r.json()["jitflow"]


def test_gmax_runs_a_tight_deadline_ahead_of_long_best_effort(server_url, policy):
    policy("gmax", batch_size=2)
    hogs: list[LongStream] = []
    with httpx.Client(base_url=server_url, timeout=60) as c, explain(c, hogs):
        try:
            hogs += start_long_requests(c, server_url, 2)
            timing = _probe(c, deadline=3.0)
            ev = engine_events(c)
            plan = c.get("/v1/jitflow/engine/plan").json()
        finally:
            for h in hogs:
                h.close()
        assert timing["output_tokens"] == 40
        # the last decision, as the diagnostics endpoint shows it: both long requests ranked as
        # running best-effort work, and a batch of at most B = 2 of the ranked requests
        ranked = {r["id"]: r for r in plan["requests"]}
        for h in hogs:
            mine = [r for rid, r in ranked.items() if rid.startswith(h.rid)]
            assert len(mine) == 1 and mine[0]["kind"] == "best_effort" and mine[0]["running"], plan
        assert set(plan["batch"]) <= set(ranked) and len(plan["batch"]) <= 2
        # GMAX runs the deadline request ahead of (pausing) a best-effort one: it meets its 3-s deadline,
        # and, on the engine's clock, both long requests were running before it arrived and still
        # unfinished when it finished.
        assert timing["slo_met"] is True, sorted(timing.items())
        probe = timing["request_id"]
        for h in hogs:
            assert when(ev, "first_sched", h.rid) < when(ev, "add", probe)
            assert when(ev, "finish", h.rid) > when(ev, "finish", probe)
        st = wait_idle(server_url)
        assert st["unfinished"] == 0


def test_fcfs_keeps_the_tight_deadline_behind_long_best_effort_and_admission_refuses_it(server_url, policy):
    """FCFS admits the two long requests (B = 2) and leaves the probe waiting behind them. Deadline
    admission does not let it start too late to meet its deadline: it is refused with 429 at its latest
    feasible start, long before either long request ends, and removed from the engine unscheduled."""
    policy("fcfs", batch_size=2)
    hogs: list[LongStream] = []
    out: dict = {}

    def probe() -> None:
        with httpx.Client(base_url=server_url, timeout=60) as pc:
            t0 = time.time()
            out["response"] = pc.post("/v1/chat/completions", timeout=400, json={
                "model": "tiny", "messages": [{"role": "user", "content": "quick"}], "max_tokens": 40,
                "ignore_eos": True, "slo": {"kind": "deadline", "deadline": 3.0, "waiting_time": 300}})
            out["waited"] = time.time() - t0

    with httpx.Client(base_url=server_url, timeout=60) as c, explain(c, hogs):
        t = threading.Thread(target=probe, daemon=True)
        try:
            before = c.get("/v1/jitflow/engine").json()["rejected"]
            # The probe arrives after both long requests (all three queued while paused).
            with paused(c):
                hogs += [long_request(server_url) for _ in range(2)]
                wait_for(c, lambda st: st["waiting"] >= 2, "2 queued long requests", hogs)
                t.start()
                wait_for(c, lambda st: st["waiting"] >= 3, "the queued probe", hogs)
            t.join(timeout=400)
            assert "response" in out, "the probe did not return"
            ev = engine_events(c)
            after = c.get("/v1/jitflow/engine").json()["rejected"]
        finally:
            for h in hogs:
                h.close()
        r = out["response"]
        assert r.status_code == 429 and r.json()["error"]["code"] == "deadline_infeasible", r.text
        assert out["waited"] < 3.0  # refused by its latest feasible start, not after the 300 s waiting time
        assert after == before + 1  # the engine removed it, never scheduled
        assert all(when(ev, "finish", h.rid) == float("inf") for h in hogs)  # the long requests still ran
        st = wait_idle(server_url)
        assert st["unfinished"] == 0


def test_request_not_admitted_within_waiting_time_is_rejected_and_freed(server_url, policy):
    policy("fcfs", batch_size=1)
    hogs: list[LongStream] = []
    with httpx.Client(base_url=server_url, timeout=60) as c, explain(c, hogs):
        try:
            hogs += start_long_requests(c, server_url, 1)
            before = c.get("/v1/jitflow/engine").json()["rejected"]
            t0 = time.time()
            r = c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": MSG, "max_tokens": 10,
                "slo": {"kind": "deadline", "deadline": 30, "waiting_time": 0.5}})
            waited = time.time() - t0
            assert r.status_code == 429, r.text
            assert r.json()["error"]["type"] == "admission_rejected"
            assert r.json()["error"]["param"] == "slo.waiting_time"
            assert int(r.headers["Retry-After"]) >= 1
            assert waited >= 0.5
            st = c.get("/v1/jitflow/engine").json()
            assert st["rejected"] == before + 1
            # the rejected request left the engine; at most the long request is still there
            assert st["unfinished"] <= 1 and st["waiting"] == 0
            with jitflow.Client(base_url=server_url, max_retries=0) as client, \
                    pytest.raises(jitflow.AdmissionRejectedError) as ei:
                client.chat.completions.create(model="tiny", messages=MSG, max_tokens=10,
                                               slo=jitflow.Deadline(30, waiting_time=0.3))
            assert ei.value.retry_after is not None
            ev = engine_events(c)
        finally:
            for h in hogs:
                h.close()
        # Both rejections happened while the long request held the only slot (engine clock).
        rejects = [t for t, k, _, _ in ev if k == "reject" and t > when(ev, "first_sched", hogs[0].rid)]
        assert len(rejects) >= 2
        assert max(rejects) < when(ev, "finish", hogs[0].rid), "the long request left the engine early"
        st = wait_idle(server_url)
        assert st["unfinished"] == 0 and st["frontend_unfinished"] == 0


@pytest.mark.parametrize("name", ["slos-serve", "qlm", "tempo", "vllm-priority"])
def test_peer_baselines_schedule_the_real_engine(server_url, policy, name):
    """Each peer baseline decides inside the real vLLM scheduler: a mixed burst of latency, deadline and
    best-effort requests is served in full and the plug-in computed frames with that policy."""
    import concurrent.futures as cf

    st = policy(name, batch_size=4)
    assert st["policy"] == name
    frames0 = httpx.get(server_url + "/v1/jitflow/engine", timeout=10).json()["frames"]
    slos = [{"kind": "latency", "ttft": 30, "tbt": 5}, {"kind": "deadline", "deadline": 120}, None] * 2

    def one(slo):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "ignore_eos": True}
        if slo is not None:
            body["slo"] = slo
        return httpx.post(server_url + "/v1/chat/completions", json=body, timeout=300)

    with cf.ThreadPoolExecutor(len(slos)) as ex:
        replies = list(ex.map(one, slos))
    assert [r.status_code for r in replies] == [200] * len(slos), [r.text for r in replies]
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in replies)
    st = httpx.get(server_url + "/v1/jitflow/engine", timeout=10).json()
    assert st["policy"] == name and st["frames"] > frames0


def _paced_run(c: httpx.Client, url: str, ttfts: tuple[float, ...] = (2.0, 2.3, 2.6, 2.9, 3.2), feeders: int = 4,
               prompt_tokens: int = 3000) -> int:
    """Chat requests decoding while long prompts keep arriving; returns how many steps the plug-in's prefill
    budget cut meanwhile (``paced_steps``).

    Each chat's TBT SLO (1 ms) is far below any step, so the time left until its next token is due falls
    with the wall clock, from its TTFT through zero: whatever the machine's speed, there is a stretch in
    which that slack is positive but shorter than a full prefill chunk, and the budget is cut in the steps
    that start in it. One stretch is about one step long and a step can straddle it, so the chats' TTFTs are
    staggered (``ttfts``): one stretch each. ``feeders`` clients keep a prompt waiting for prefill
    (``max_tokens`` 1 each, a bounded loop) from the chats' start until a second after the last TTFT; their
    ``waiting_time`` is long because on a slow CPU (2 ms per prompt token) a queue of 3,000-token prompts
    outlasts the server's default and admission control would answer 429."""
    import concurrent.futures as cf

    paced0 = c.get("/v1/jitflow/engine").json()["paced_steps"]

    def chat(ttft: float) -> dict:
        return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500,
                "ignore_eos": True, "slo": {"kind": "latency", "ttft": ttft, "tbt": 0.001}}

    def feed(i: int, until: float) -> list[int]:
        codes = []
        while time.time() < until and len(codes) < 200:
            doc = {"model": "tiny", "prompt": [10 + (i * 7 + len(codes) * 13 + k) % 1900 for k in range(prompt_tokens)],
                   "max_tokens": 1, "slo": {"kind": "deadline", "deadline": 600, "waiting_time": 600}}
            codes.append(httpx.post(url + "/v1/completions", json=doc, timeout=600).status_code)
        return codes

    with cf.ThreadPoolExecutor(feeders + len(ttfts)) as ex:
        t0 = time.time()
        replies = [ex.submit(httpx.post, url + "/v1/chat/completions", json=chat(t), timeout=600) for t in ttfts]
        wait_for(c, lambda s: s["running"] >= 1, "the chat requests running", [])
        fed = [ex.submit(feed, i, t0 + max(ttfts) + 1.0) for i in range(feeders)]
        codes = [code for f in fed for code in f.result()]
        rs = [r.result() for r in replies]
    assert all(r.status_code == 200 for r in rs), [r.text[:300] for r in rs]
    assert codes and set(codes) == {200}, codes
    return c.get("/v1/jitflow/engine").json()["paced_steps"] - paced0


def test_gmax_caps_each_steps_prefill_by_the_slack_of_a_decoding_chat(server_url, policy):
    """GMAX's per-step prefill budget reaches vLLM: steps are cut below the engine's 2,048 tokens while a chat
    request's slack is short; with ``prefill_budget="fixed"`` (vLLM's own chunking) none is."""
    policy("gmax", batch_size=16, prefill_budget="fixed")
    with httpx.Client(base_url=server_url, timeout=60) as c:
        assert _paced_run(c, server_url) == 0
        policy("gmax", batch_size=16)
        assert _paced_run(c, server_url) > 0
