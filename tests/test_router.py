"""The router front end (`jitflow serve --replica URL ...`) over two real vLLM replicas (`jitflow vllm-serve`
with the jitflow plug-in, tiny model, 127.0.0.1): routing follows the replicas' measured speed, a killed
replica loses no queued request, a request it was streaming fails with a clear 502, a replica that
comes back is used again, and a call queued behind a busy replica moves to an idle one."""

from __future__ import annotations

import math
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate

import httpx
import pytest

from conftest import free_port, jitflow_exe, running_server
from jitflow_server.bench.server_process import ServerProcess

pytestmark = pytest.mark.engine

FAST_B, SLOW_B = 8, 2
HANDOVER_S = 2.0  # the hand-over test's --handover (s)


def _replica(port: int, batch: int, log, model: str = "tiny") -> ServerProcess:
    """A replica serving the model id ``tiny``: the slow one runs the demo model (same tokenizer, 50 times the
    parameters), so its speed differs by the engine's work, not by HTTP overheads."""
    cmd = [jitflow_exe(), "vllm-serve", "--model", model, "--port", str(port), "--policy", "gmax",
           "--batch-size", str(batch), "--max-model-len", "4096", "--served-model-name", "tiny"]
    return ServerProcess(cmd, log, {"VLLM_CPU_KVCACHE_SPACE": "1"}, startup_timeout=420)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """``{"fast": ServerProcess, "slow": ServerProcess, "dir": Path}``; a test may replace ``slow``."""
    tmp = tmp_path_factory.mktemp("replicas")
    reps = {"fast": _replica(free_port(), FAST_B, tmp / "fast.log"),
            "slow": _replica(free_port(), SLOW_B, tmp / "slow.log", "demo"), "dir": tmp}
    try:
        for k in ("fast", "slow"):
            reps[k].start()  # both load at once
        for k in ("fast", "slow"):
            reps[k].wait_healthy()
        yield reps
    finally:
        for k in ("fast", "slow"):
            reps[k].stop()


def _router(reps, router: str, log, *extra: str, members: tuple[str, ...] = ("fast", "slow")):
    urls = [a for k in members for a in ("--replica", reps[k].base_url)]
    cmd = [jitflow_exe(), "serve", "--model", "tiny", "--port", str(free_port()), "--router", router, *urls,
           "--no-length-predictor", *extra]
    return running_server(cmd, log, dict(os.environ, JITFLOW_HISTORY_DB=str(log.parent / f"{router}.sqlite")),
                          timeout=120)


def _stats(url: str) -> dict:
    return httpx.get(url + "/v1/jitflow/engine", timeout=30).json()


def _ask(url: str, prompt: str, tokens: int, slo: dict | None = None) -> tuple[int, dict, float]:
    """One chat call: ``(status, body, seconds it took)``."""
    t0 = time.time()
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
        "ignore_eos": True, **({"slo": slo} if slo else {})})
    return r.status_code, r.json(), time.time() - t0


def _chat(url: str, i: int, tokens: int) -> tuple[int, dict]:
    status, body, _ = _ask(url, f"story number {i}", tokens)
    return status, body


def _burst(url: str, n: int, tokens: int) -> list[tuple[int, dict]]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: _chat(url, i, tokens), range(n)))


def test_routing_follows_the_measured_speed(replicas):
    with _router(replicas, "goodput", replicas["dir"] / "goodput.log") as (url, _):
        first = _burst(url, 16, 64)  # both replicas get work (equal prior speeds) and are measured
        assert [s for s, _ in first] == [200] * 16, [b for s, b in first if s != 200][:2]
        t0 = time.time()
        while not all(r["measured"] for r in _stats(url)["replicas"]) and time.time() - t0 < 30:
            time.sleep(0.5)
        stats0 = _stats(url)
        before = stats0["replicas"]
        fast, slow = before
        assert fast["measured"] and slow["measured"], before
        assert fast["output_tok_s"] > 2 * slow["output_tok_s"], before
        second = _burst(url, 24, 64)
        assert [s for s, _ in second] == [200] * 24
        assert all(b["usage"]["completion_tokens"] == 64 for _, b in second)
        after = _stats(url)
        to_fast = after["replicas"][0]["routed"] - fast["routed"]
        to_slow = after["replicas"][1]["routed"] - slow["routed"]
        # one attempt per call, and one more per call moved before its first token (a call that waits on
        # the slow replica's two slots for longer than the default 2 s hand-over goes to the fast one)
        moved = sum(after[k] - stats0[k] for k in ("handed_over", "rerouted"))
        assert to_fast + to_slow == 24 + moved, after
        assert to_fast >= 2 * to_slow, after["replicas"]
        assert after["decision_us"]["n"] >= 40  # every call's decision was timed (its speed: bench replicas-real)
        wall, cpu = after["decision_us"], after["decision_cpu_us"]
        assert cpu["n"] == wall["n"]
        # each decision's CPU time lies inside its wall interval, so every order statistic is below
        assert 0 < cpu["p50"] <= wall["p50"] and cpu["p99"] <= wall["p99"]


def test_a_call_queued_behind_a_busy_replica_is_handed_over_to_an_idle_one(replicas):
    # round robin sends half of the burst to the slow replica (2 slots): the calls queued there have no token
    # after 2 s while the fast replica is idle, so they move to it and every call is served once. The speeds
    # are measured first: before that the router prices both replicas alike, and a fast replica slowed by
    # the machine's other work (its first tokens later than 2 s) could rightly hand its calls to the slow one.
    with _router(replicas, "round-robin", replicas["dir"] / "handover.log", "--handover", str(HANDOVER_S)) as (url, _):
        assert [s for s, _ in _burst(url, 4, 32)] == [200] * 4
        t0 = time.time()
        while not all(r["measured"] for r in _stats(url)["replicas"]) and time.time() - t0 < 30:
            time.sleep(0.5)
        stats0 = _stats(url)
        assert all(r["measured"] for r in stats0["replicas"]), stats0["replicas"]
        # calls long enough that the slow replica's queued ones wait past the hand-over on any machine: each
        # takes 1.5 hand-overs on one of its slots at its measured speed (64-token calls took 0.7 s there on
        # a 2-core AMD EPYC with avx512_bf16, and none waited 2 s)
        tokens = int(min(768, max(64, math.ceil(1.5 * HANDOVER_S * stats0["replicas"][1]["output_tok_s"] / SLOW_B))))
        results = _burst(url, 12, tokens)
        stats = _stats(url)
    assert [s for s, _ in results] == [200] * 12, [b for s, b in results if s != 200][:2]
    assert all(b["usage"]["completion_tokens"] == tokens for _, b in results)
    fast, slow = (after["routed"] - before["routed"] for after, before in zip(stats["replicas"], stats0["replicas"]))
    handed_over = stats["handed_over"] - stats0["handed_over"]
    assert handed_over >= 1, (tokens, [{k: r.get(k) for k in ("output_tok_s", "routed")} for r in stats["replicas"]])
    assert fast + slow == 12 + handed_over  # one more attempt per hand-over
    assert fast > slow, stats["replicas"]
    assert stats["rerouted"] == 0 and stats["failed_streaming"] == 0


def test_a_killed_replica_loses_no_queued_request_and_is_used_again_when_back(replicas):
    # no hand-over: the slow replica must keep the calls it holds until it is killed
    with _router(replicas, "round-robin", replicas["dir"] / "rr.log", "--handover", "0") as (url, _):
        slow = replicas["slow"]
        n, tokens = 12, 300
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(_chat, url, i, tokens) for i in range(n)]  # round robin: half on the slow one
            t0 = time.time()
            while time.time() - t0 < 120:  # wait until the slow replica streams one request and holds more
                st = _stats(url)["replicas"][1]
                if st["streamed_tokens"] > 0 and st["in_flight"] >= 3:
                    break
                time.sleep(0.05)
            assert st["in_flight"] >= 3, st
            os.killpg(slow.proc.pid, signal.SIGKILL)  # the replica, its engine core and worker, at once
            results = [f.result(timeout=300) for f in futures]
        slow.stop()
        stats = _stats(url)
        ok = [b for s, b in results if s == 200]
        failed = [(s, b) for s, b in results if s != 200]
        assert len(ok) + len(failed) == n  # every request answered
        assert all(b["usage"]["completion_tokens"] == tokens for b in ok)
        # only the requests the slow replica had started (at most its 2·B running sequences) fail, each with
        # a 502 that names the replica; the ones it held but had not started were sent elsewhere and served
        assert all(s == 502 and slow.base_url in b["error"]["message"] and "failed after" in b["error"]["message"]
                   for s, b in failed), failed
        assert 1 <= len(failed) <= 2 * SLOW_B, failed
        assert stats["failed_streaming"] == len(failed)
        assert len(failed) + stats["rerouted"] >= st["in_flight"]  # each request it held: failed or re-routed
        assert stats["replicas"][1]["up"] is False

        # the replica comes back on the same address: the router finds it and routes to it again
        back = _replica(slow.port, SLOW_B, replicas["dir"] / "slow-again.log", "demo")
        replicas["slow"] = back
        back.start()
        back.wait_healthy()
        t0 = time.time()
        while not _stats(url)["replicas"][1]["up"] and time.time() - t0 < 30:
            time.sleep(0.5)
        routed = _stats(url)["replicas"][1]["routed"]
        assert [s for s, _ in _burst(url, 4, 16)] == [200] * 4
        assert _stats(url)["replicas"][1]["routed"] >= routed + 2


def test_the_workload_capacity_run_counts_the_replicas_own_output_tokens(replicas, tmp_path):
    """``bench replicas-real --load-basis workload`` sizes its load from one replica serving the workload
    itself behind its front end, in a closed loop, read from the replica's own
    ``vllm:generation_tokens_total``: over the whole run the counter rises by exactly the output tokens of
    the jobs the loop started (``ignore_eos``, nothing refused), the loop stops starting jobs after its
    time, and the rate over the window is positive."""
    from jitflow_server.bench.replicas_real import workload_tok_s
    from jitflow_server.bench.workload import make_workload

    jobs = make_workload(400, 1.0, seed=5, length_scale=0.0625, max_context=2000)
    with _router(replicas, "goodput", tmp_path / "front.log", members=("fast",)) as (url, _proc):
        rate, samples = workload_tok_s(url, "tiny", replicas["fast"].base_url, jobs, 4, seconds=4.0,
                                       settle_s=1.0, period_s=0.2)
    started = samples[-1][1] - samples[0][1]
    assert 0 < started < sum(j.total_tokens[1] for j in jobs)  # it stopped starting jobs, with most of the 400 never started
    assert started in set(accumulate(j.total_tokens[1] for j in jobs))  # the first k jobs, all finished, for some k
    assert rate > 0


def _long_prompt(i: int) -> str:
    """About 2 500 tokens, different from its first word on for each ``i`` (no prefix-cache hit)."""
    return " ".join(f"item{i} {w} {k} of the ledger" for k, w in enumerate(["alpha", "beta", "gamma"] * 55))


def test_admission_is_judged_by_the_replica_that_knows_whether_a_call_started(replicas):
    """With ``--engine-admission`` the replica's plug-in enforces each call's waiting time (admission
    control, JITServe §5), since the front end sees only tokens: a call the replica scheduled at once but
    whose prefill is longer than its waiting time is served (the default rule, no token by the waiting
    time, refuses it: checked last), and calls queued behind the replica's B busy slots are refused by the replica
    itself, each a 429 in OpenAI's error shape."""
    with _router(replicas, "goodput", replicas["dir"] / "admission.log", "--engine-admission",
                 members=("slow",)) as (url, _):
        status, body, ttft = _ask(url, _long_prompt(0), 1)  # one token: the time is the prefill's
        assert status == 200 and body["usage"]["prompt_tokens"] > 1500, body
        wait = ttft / 3
        if wait < 0.15:
            pytest.skip(f"a {body['usage']['prompt_tokens']}-token prefill takes {ttft:.2f} s here: too short to "
                        "tell a started call from a queued one")
        status, body, _ = _ask(url, _long_prompt(1), 1, {"kind": "best_effort", "waiting_time": wait})
        assert status == 200, body
        before = _stats(url)
        assert before["refused_by_replica"] == before["refused_at_front"] == 0

        # B = 2 slots held by two long chat calls; twelve best-effort calls queue behind them, and the replica
        # refuses those it has not started at 1 s. How many the policy starts meanwhile is its choice (GMAX
        # started five of eight in one run, pausing and preempting); it cannot start twelve.
        chat_slo = {"kind": "latency", "ttft": 30.0, "tbt": 1.0, "waiting_time": 30.0}
        with ThreadPoolExecutor(14) as pool:
            blockers = [pool.submit(_ask, url, f"block {i}", 400, chat_slo) for i in range(2)]
            t0 = time.time()
            while _stats(url)["replicas"][0]["streamed_tokens"] - before["replicas"][0]["streamed_tokens"] < 8:
                assert time.time() - t0 < 120, "the blocking calls never streamed"
                time.sleep(0.05)
            queued = [f.result(timeout=300) for f in [
                pool.submit(_ask, url, f"queued {i}", 400, {"kind": "best_effort", "waiting_time": 1.0})
                for i in range(12)]]
            done = [f.result(timeout=300) for f in blockers]
        after = _stats(url)
    assert [s for s, _, _ in done] == [200, 200] and all(b["usage"]["completion_tokens"] == 400 for _, b, _ in done)
    refused = [(body, took) for status, body, took in queued if status == 429]
    assert refused, [(s, took) for s, _, took in queued]
    for body, took in refused:
        assert body["error"]["code"] == "admission_rejected" and body["error"]["param"] == "slo.waiting_time"
        assert 1.0 <= took < 3.0  # refused at its waiting time
    assert all(b["usage"]["completion_tokens"] == 400 for s, b, _ in queued if s == 200)
    assert after["refused_by_replica"] - before["refused_by_replica"] == len(refused)  # each by the replica
    assert after["refused_at_front"] == 0

    # the default rule, judged at the front end by tokens, refuses the started call with no token yet
    with _router(replicas, "goodput", replicas["dir"] / "admission-front.log", members=("slow",)) as (url, _):
        status, body, _ = _ask(url, _long_prompt(2), 1, {"kind": "best_effort", "waiting_time": wait})
        stats = _stats(url)
    assert status == 429 and body["error"]["code"] == "admission_rejected", body
    assert stats["refused_at_front"] == 1 and stats["refused_by_replica"] == 0
