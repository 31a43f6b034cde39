"""Regression: under overload GMAX must not rotate its batch among late requests (δ clock).

Found in the simulator (docs/benchmarks.md): counting δ's frames since a request was last served
lets every waiting request outrank the running ones after one frame once most requests are late,
and the batch rotates with a recompute preemption each time. Counting from arrival (the default)
keeps old running requests ahead.
"""

from __future__ import annotations

import pytest

from jitflow_server.scheduler import Kind, RequestView, SchedContext, make_policy
from test_sim_engine import _run, _workload


@pytest.mark.parametrize("clock", ["waiting", "arrival"])
def test_clock_avoids_recompute_thrashing_under_overload(clock):
    jobs = _workload(n=80, rps=20.0, seed=5)  # far beyond the small engine's capacity
    paper = dict(jit=False, free_pause=True, stall_value="tokens", request_weight=0.0,  # where the rotation was found
                 compound_value="task")
    good = _run(jobs, starvation_clock=clock, **paper)
    served = _run(jobs, starvation_clock="served", **paper)
    assert served["preemptions"] > 0  # the scenario does provoke the rotation
    assert good["preemptions"] * 2 < served["preemptions"], (good["preemptions"], served["preemptions"])


def _hogs_and_probe(now: float, hog_age: float) -> list[RequestView]:
    # two long best-effort requests running since `hog_age` seconds, one fresh tight deadline request
    hogs = [RequestView(f"be{i}", Kind.BEST_EFFORT, now - hog_age, 20, 1500 + 100 * i, 3000, True, 1520,
                        max_tokens=3000) for i in range(2)]
    return [*hogs, RequestView("d", Kind.DEADLINE, now, 10, 0, 40, False, 0, deadline=now + 3, max_tokens=40)]


@pytest.mark.parametrize("clock", ["waiting", "served"])
@pytest.mark.parametrize("name", ["gmax", "gmax-paper"])
def test_old_running_best_effort_does_not_outrank_a_fresh_deadline_request(clock, name):
    # Running requests have been served the whole time: only the "arrival" clock ages them.
    policy = make_policy(name, starvation_clock=clock, adapt_p=False)
    now = 1000.0
    for k in range(30):  # 30 frames of the hogs running alone
        t = now - 30 + k
        policy.schedule(_hogs_and_probe(t, t - (now - 31))[:2], SchedContext(
            now=t, batch_size=2, token_time=0.005, prefill_rate=5000.0, kv_capacity_tokens=10**6))
    # frames of Δ·v = 0.25 s while the hogs keep running; the probe (t_gen ≈ 0.2 s, deadline now+3 s)
    # must be put in the batch early enough to meet its deadline (gmax-paper: at once, by density;
    # gmax: just in time, once its laxity drops below one frame)
    t = now
    while t < now + 3.0:
        d = policy.schedule(_hogs_and_probe(t, t - (now - 31)), SchedContext(
            now=t, batch_size=2, token_time=0.005, prefill_rate=5000.0, kv_capacity_tokens=10**6))
        if "d" in d.batch:
            break
        t += 0.25
    assert "d" in d.batch and t + 40 * 0.005 <= now + 3.0, t - now
    if name == "gmax-paper":
        assert t == now


def test_arrival_clock_lets_old_best_effort_outrank_a_fresh_deadline_request():
    policy = make_policy("gmax-paper", starvation_clock="arrival", adapt_p=False)
    now = 1000.0
    d = policy.schedule(_hogs_and_probe(now, 31), SchedContext(
        now=now, batch_size=2, token_time=0.005, prefill_rate=5000.0, kv_capacity_tokens=10**6))
    assert "d" not in d.batch
