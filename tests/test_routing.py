"""Routing over replicas of different speeds: each router's choice on constructed states, and the
simulated replicas (``jitflow bench replicas``) on a small workload."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from jitflow_server.cli import app
from jitflow_server.scheduler.routing import (
    Backlog,
    GoodputRouter,
    LeastLoaded,
    PrefixAffinity,
    ReplicaSpeed,
    RoundRobin,
    RouteRequest,
    make_router,
)

FAST, SLOW = ReplicaSpeed(200.0, 2000.0), ReplicaSpeed(100.0, 1000.0)


def req(now: float, out: float = 100.0, slo: float | None = None, key: str | None = None) -> RouteRequest:
    return RouteRequest(now=now, input_tokens=100, output_tokens=out, slo_s=slo, key=key)


def test_round_robin_ignores_speed_and_least_loaded_follows_it():
    rr, b = RoundRobin(), Backlog([FAST, SLOW])
    assert [rr.route(req(0.0), b) for _ in range(4)] == [0, 1, 0, 1]
    ll, b = LeastLoaded(), Backlog([FAST, SLOW])
    picks = [ll.route(req(0.0), b) for _ in range(6)]
    assert picks.count(0) == 4 and picks.count(1) == 2  # twice the speed, twice the work
    assert b.work == pytest.approx([4 * 0.55, 2 * 1.1])  # (100/2000 + 100/200) s each on the fast one


def test_backlog_drains_with_time():
    b = Backlog([FAST])
    b.add(0, req(0.0, out=200.0))  # 0.05 + 1.0 s
    assert b.at(0.5) == pytest.approx([0.55]) and b.at(10.0) == [0.0]
    assert b.at(5.0) == [0.0]  # time does not run backwards


def test_the_backlog_of_calls_in_flight_is_their_work_at_each_replicas_speed_in_routing_order():
    from types import SimpleNamespace as F

    flights = [F(replica=0, prompt_tokens=400, est_output=300.0, generated=0, urgent=False, deadline=10.0),
               F(replica=1, prompt_tokens=400, est_output=300.0, generated=120, urgent=True, deadline=None),
               F(replica=0, prompt_tokens=50, est_output=100.0, generated=100, urgent=True, deadline=1.0),
               F(replica=0, prompt_tokens=80, est_output=20.0, generated=5, urgent=False, deadline=3.0)]
    b = Backlog.in_flight(0.0, [FAST, SLOW], flights)
    # a call with a token has its prompt in the KV cache; one at or past its estimate still needs a token
    w = [FAST.work_s(400, 300.0), SLOW.work_s(0, 180.0), FAST.work_s(0, 1.0), FAST.work_s(0, 15.0)]
    assert b.work == pytest.approx([w[0] + w[2] + w[3], w[1]])
    assert b.urgent == pytest.approx([w[2], w[1]])
    # pending: the calls with a deadline that finish by it behind the work routed before them (the third is
    # due at 1 s, behind 1.7 s of work)
    assert [e[1:] for e in b.pending[0]] == [(10.0, 300.0), (3.0, 20.0)] and b.pending[1] == []
    assert [e[0] for e in b.pending[0]] == pytest.approx([w[0], w[0] + w[2] + w[3]])
    later = Backlog.in_flight(9.0, [FAST, SLOW], flights[:1])  # 1.7 s of work from 9 s misses 10 s
    assert later.pending[0] == [] and later.work[0] == pytest.approx(w[0])


def test_goodput_router_does_not_make_a_pending_request_late_where_least_loaded_does():
    def state() -> Backlog:
        b = Backlog([FAST, SLOW])
        b.add(0, req(0.0, out=40.0, slo=0.3))  # on the fast replica: 0.25 s of work, due at 0.3 s
        return b

    new = req(0.0, out=100.0, slo=10.0)  # 0.55 s on the fast replica, 1.1 s on the slow one
    assert LeastLoaded().route(new, state()) == 0  # finishes first there (0.8 s against 1.1 s) ...
    b = state()
    assert b.harm(0, 0.55) == 40.0  # ... but pushes the pending request past its deadline
    assert GoodputRouter().route(new, b) == 1  # on time on the slow one, and so is the pending one


def test_an_urgent_request_waits_only_behind_urgent_work():
    def state() -> Backlog:
        b = Backlog([FAST, SLOW])
        b.add(0, req(0.0, out=1000.0))  # 5.05 s of batch work on the fast replica
        return b

    chat = RouteRequest(now=0.0, input_tokens=100, output_tokens=100.0, slo_s=3.0, urgent=True)
    assert LeastLoaded().route(chat, state()) == 1  # 1.1 s on the idle slow one against 5.6 s
    b = state()
    assert b.waits(chat) == [0.0, 0.0] and GoodputRouter().route(chat, b) == 0  # served ahead: 0.55 s
    assert b.urgent[0] == pytest.approx(0.55) and b.at(0.3)[0] == pytest.approx(5.3)
    assert b.urgent[0] == pytest.approx(0.25)  # the urgent part drains first


def test_a_key_stays_on_its_replica_and_prefix_affinity_spills_when_overloaded():
    g, b = GoodputRouter(), Backlog([FAST, FAST])
    first = g.route(req(0.0, key="task-1"), b)
    b.add(1 - first, req(0.0, out=10.0))  # the other replica a little busier is no reason to move
    assert g.route(req(0.1, key="task-1"), b) == first
    pa, b = PrefixAffinity(spill_s=1.0), Backlog([FAST, FAST])
    home = pa.route(req(0.0, key="sys-prompt"), b)
    assert pa.route(req(0.0, key="sys-prompt"), b) == home
    for _ in range(3):
        b.add(home, req(0.0, out=400.0))  # 6 s of work: past the spill threshold
    assert pa.route(req(0.0, key="sys-prompt"), b) == 1 - home


def test_bad_routers_and_speeds_are_refused():
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random")
    with pytest.raises(ValueError, match="positive"):
        ReplicaSpeed(0.0, 1.0)
    with pytest.raises(ValueError, match="at least one"):
        Backlog([])


def test_bench_replicas_routes_every_job_and_writes_its_reports(tmp_path):
    out = tmp_path / "rep"
    res = CliRunner().invoke(app, ["bench", "replicas", "--preset", "a100-llama8b", "--speeds", "1,0.5",
                                   "--rps", "1.5", "--requests", "60", "--seeds", "2", "--routers",
                                   "goodput,round-robin", "--policies", "gmax,fcfs", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "replicas.json").read_text())
    table = data["loads"]["1.5"]["results"]
    assert set(table) == {"gmax+goodput", "gmax+round-robin", "fcfs+goodput", "fcfs+round-robin"}
    for r in table.values():
        assert sum(r["jobs_per_replica"]) == 60 and r["token_goodput"] > 0
    assert table["gmax+round-robin"]["jobs_per_replica"] == [30, 30]
    h = data["loads"]["1.5"]["headline"]
    assert h["token"]["best_other"] in table and h["token"]["ratio"] > 0
    assert set(data["decision_us"]) == {"4", "16", "64"}
    assert "GMAX + goodput router" in (out / "replicas.md").read_text() and (out / "replicas.png").exists()
    bad = CliRunner().invoke(app, ["bench", "replicas", "--routers", "random", "--out", str(tmp_path / "x")])
    assert bad.exit_code != 0 and "routers" in bad.output


def test_the_front_end_sees_a_job_until_it_ends_on_its_replica_not_until_a_fluid_queue_drains():
    """The simulated front end's backlog (``bench replicas``) counts a routed job's prompt until its first
    token and its estimated output less what it generated; a job that ended (here: rejected by admission
    control behind a long one) leaves it at once."""
    from jitflow_server.bench.estimates import LengthBounder
    from jitflow_server.bench.replicas import _Routed, front_end_backlog
    from jitflow_server.engine.jobs import CallSpec, Job
    from jitflow_server.engine.sim import SimConfig, SimEngine
    from jitflow_server.engine.sim_run import SimRun
    from jitflow_server.engine.step_model import StepModel
    from jitflow_server.scheduler import make_policy

    model = StepModel(name="one-slot", base_s=0.01, per_decode_s=0.0005, per_prefill_token_s=0.0002,
                      per_ctx_token_s=1e-7, hetero=0.0, kv_capacity_tokens=200_000, block_size=16,
                      max_batched_tokens=1024, sarathi_chunk=256, batch_size=1)
    jobs = [Job(f"j{i}", "deadline", 0.1 * i, "chat", [[CallSpec(100, 400 if i == 0 else 20)]], deadline=60.0)
            for i in range(2)]
    eng = SimEngine(model, make_policy("fcfs", delta_steps=50), LengthBounder("oracle"), None,
                    SimConfig(waiting_time=1.0))
    run = SimRun(eng, [], last_arrival=jobs[-1].arrival)
    speed = [ReplicaSpeed(100.0, 1000.0)]
    routed: list[list[_Routed]] = [[]]
    seen = []
    for j in jobs:
        run.run_until(j.arrival)
        run.add_job(j)
        routed[0].append(_Routed(j, RouteRequest(now=j.arrival, input_tokens=100, output_tokens=500.0, slo_s=60.0),
                                 run.states[-1], 0))
        seen.append(front_end_backlog(j.arrival, speed, routed).work[0])
    assert seen[0] == pytest.approx(100 / 1000 + 500 / 100)  # j0 just arrived: its prompt and estimated output
    gen = run.states[0].calls[0].generated
    assert 0 < gen < 400  # by j1's arrival j0 has started: its prompt no longer counts, its tokens do
    assert seen[1] == pytest.approx((500 - gen) / 100 + (100 / 1000 + 500 / 100))
    run.run_until(1.5)  # j1 never started within its waiting time: rejected
    assert run.states[1].done and not run.states[0].done
    b = front_end_backlog(1.5, speed, routed)
    assert [r.job.job_id for r in routed[0]] == ["j0"] and b.work[0] == pytest.approx(
        (500 - run.states[0].calls[0].generated) / 100)
