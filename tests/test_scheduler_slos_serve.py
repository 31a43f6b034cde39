"""The ``slos-serve`` baseline: DP admission, soft admission control (refuse/demote), frame invariants,
parameter validation and a short simulator run."""

from __future__ import annotations

import numpy as np
import pytest

from jitflow_server.bench.estimates import CompoundAnalyzer, LengthBounder
from jitflow_server.bench.workload import DataSources, make_workload
from jitflow_server.engine.jobs import CallSpec, Job
from jitflow_server.engine.sim import SimConfig, SimEngine
from jitflow_server.engine.step_model import StepModel
from jitflow_server.scheduler.slos_serve import SLOsServePolicy
from jitflow_server.scheduler.synthetic import synthetic_views
from jitflow_server.scheduler.types import Kind, RequestView, SchedContext

SMALL = StepModel(name="test", base_s=0.01, per_decode_s=0.0005, per_prefill_token_s=0.0002, per_ctx_token_s=1e-7,
                  hetero=0.1, kv_capacity_tokens=200_000, block_size=16, max_batched_tokens=1024,
                  sarathi_chunk=256, batch_size=8)


def ctx(b: int = 8, now: float = 10.0, rate: float = 1000.0, **kw) -> SchedContext:
    return SchedContext(now=now, batch_size=b, token_time=0.01, prefill_rate=rate, **kw)


def lat(rid: str, arrival: float = 10.0, inp: int = 400, ttft: float = 1.0, tbt: float = 1.0, bound: int = 20,
        **kw) -> RequestView:
    return RequestView(rid, Kind.LATENCY, arrival, inp, 0, bound, False, ttft=ttft, tbt=tbt, **kw)


def dl(rid: str, deadline: float, arrival: float = 10.0, inp: int = 100, bound: int = 100, gen: int = 0,
       running: bool = False) -> RequestView:
    return RequestView(rid, Kind.DEADLINE, arrival, inp, gen, bound, running,
                       kv_tokens=inp + gen if running else 0, deadline=deadline)


# ---------------------------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("params", [
    {"delta_steps": 0},
    {"delta_steps": 1.5},
    {"best_effort_deadline": 0.0},
    {"default_ttft": -1.0},
    {"default_tbt": float("nan")},
    {"max_candidates": 0},
    {"load_levels": 0},
    {"prefill_slack_share": 1.5},
    {"on_decline": "drop"},
    {"kv_admission": "yes"},
    {"waiting_slo": 1},
])
def test_bad_parameters_raise(params):
    with pytest.raises(ValueError):
        SLOsServePolicy(**params)


def test_defaults_and_name():
    pol = SLOsServePolicy(delta_steps=50, best_effort_deadline=30.0, default_ttft=1.0, default_tbt=0.05)
    assert pol.name == "slos-serve"
    assert (pol.delta_steps, pol.best_effort_deadline, pol.default_ttft, pol.default_tbt) == (50, 30.0, 1.0, 0.05)
    assert pol.needs_recompute(1, False) and not pol.needs_recompute(2, False) and pol.needs_recompute(51, False)


# ---------------------------------------------------------------------------------------------- admission
def test_feasible_requests_are_all_admitted():
    pol = SLOsServePolicy(on_decline="reject")
    views = [dl(f"d{i}", deadline=60.0 + i) for i in range(4)] + [lat("l0", ttft=2.0, tbt=0.1)]
    d = pol.schedule(views, ctx())
    assert d.reject == []
    assert sorted(d.batch) == sorted(v.req_id for v in views)
    assert d.info["accepted"] == 5


def test_unattainable_deadline_is_refused_when_never_scheduled():
    pol = SLOsServePolicy(on_decline="reject")
    # 500 remaining tokens at 0.01 s/step need 5 s: a 2 s deadline cannot be met
    views = [dl("late", deadline=12.0, bound=500), dl("ok", deadline=60.0)]
    d = pol.schedule(views, ctx())
    assert d.reject == ["late"]
    assert d.batch == ["ok"]


def test_latency_request_past_its_ttft_is_refused():
    pol = SLOsServePolicy(on_decline="reject")
    d = pol.schedule([lat("old", arrival=5.0, ttft=1.0), lat("new", ttft=2.0)], ctx())
    assert d.reject == ["old"]
    assert d.batch == ["new"]


def test_unattainable_request_is_demoted_to_best_effort_not_refused():
    pol = SLOsServePolicy()  # on_decline="best_effort": SLOs-Serve's single-replica fallback
    views = [dl("late", deadline=12.0, bound=500, arrival=0.0), dl("ok", deadline=60.0, arrival=5.0)]
    d = pol.schedule(views, ctx(b=1))
    assert d.reject == []
    assert d.batch == ["ok"]  # the demoted one only gets the surplus, though it arrived first
    d = pol.schedule(views, ctx(b=2))
    assert d.batch == ["ok", "late"]
    assert pol.declined == 1


def test_dp_admits_the_largest_attainable_subset_not_greedy():
    # prefill budget by the common TTFT (1 s at 1000 tokens/s) is 1000 tokens: one 950-token request
    # (first in arrival order) or both 450-token ones; SLOs-Serve's objective is the number admitted
    pol = SLOsServePolicy(on_decline="reject")
    views = [lat("big", arrival=10.0, inp=950), lat("s1", arrival=10.001, inp=450), lat("s2", arrival=10.002, inp=450)]
    d = pol.schedule(views, ctx(now=10.002))
    assert d.reject == ["big"]
    assert sorted(d.batch) == ["s1", "s2"]


def test_prefill_budget_limits_admissions_in_a_burst():
    pol = SLOsServePolicy(on_decline="reject")
    views = [lat(f"r{i}", arrival=10.0, inp=400) for i in range(10)]  # 4000 tokens, 1000 by the TTFT
    d = pol.schedule(views, ctx())
    assert len(d.batch) == 2 and len(d.reject) == 8
    assert set(d.batch) | set(d.reject) == {v.req_id for v in views}
    # a later TTFT leaves room: the budget keeps accruing until each prefill deadline
    pol = SLOsServePolicy(on_decline="reject")
    views = [lat(f"r{i}", arrival=10.0, inp=400, ttft=1.0 + 0.5 * i) for i in range(10)]
    d = pol.schedule(views, ctx())
    assert len(d.batch) >= 8


def test_admitted_requests_stay_admitted_ahead_of_later_arrivals():
    pol = SLOsServePolicy(on_decline="reject")
    first = [lat(f"a{i}", arrival=10.0, inp=400) for i in range(2)]
    d = pol.schedule(first, ctx())
    assert sorted(d.batch) == ["a0", "a1"]
    # the two are admitted but not started; a new request that would need their prefill budget is declined
    d = pol.schedule(first + [lat("b", arrival=10.1, inp=400, ttft=0.95)], ctx(now=10.1))
    assert d.reject == ["b"]
    assert sorted(d.batch) == ["a0", "a1"]


def test_decode_share_blocks_admission_when_the_engine_is_full_of_tight_tbt_requests():
    # B = 2 running requests at TBT = token_time each take half of the engine (d / (B·tbt) = 0.5):
    # no decode share left for a new one, whatever its prefill
    running = [RequestView(f"r{i}", Kind.LATENCY, 0.0, 10, 5, 1000, True, kv_tokens=15, ttft=1.0, tbt=0.01)
               for i in range(2)]
    pol = SLOsServePolicy(on_decline="reject")
    d = pol.schedule(running + [lat("new", inp=10, ttft=5.0, tbt=0.01)], ctx(b=2))
    assert d.reject == ["new"]
    assert sorted(d.batch) == ["r0", "r1"]


def test_best_effort_requests_are_never_refused_and_yield_to_slo_requests():
    pol = SLOsServePolicy(on_decline="reject")
    be = RequestView("be", Kind.BEST_EFFORT, 0.0, 50, 10, 100, True, kv_tokens=60)
    d = pol.schedule([be, dl("d", deadline=60.0)], ctx(b=1))
    assert d.reject == [] and d.batch == ["d"]
    # when the KV cache cannot hold the frame, the displaced best-effort request is preempted
    d = pol.schedule([be, dl("d", deadline=60.0)], ctx(b=1, kv_capacity_tokens=100))
    assert d.preempt == ["be"]


def test_admitted_deadline_request_that_becomes_unattainable_is_demoted():
    pol = SLOsServePolicy()
    v = dl("d", deadline=15.0, bound=100)
    assert pol.schedule([v], ctx()).batch == ["d"]
    v2 = dl("d", deadline=15.0, bound=100, gen=5, running=True)
    v2.len_bound = 2000  # the bound grew: 1995 steps at 0.01 s cannot finish by 15 s
    other = dl("o", deadline=60.0)
    d = pol.schedule([v2, other], ctx(b=1, now=11.0))
    assert d.batch == ["o"] and d.reject == []  # already running: demoted, not refused


@pytest.mark.parametrize("waiting_slo,first", [(True, "w"), (False, "a")])
def test_admission_deadline_of_a_waiting_request_is_honoured(waiting_slo, first):
    pol = SLOsServePolicy(waiting_slo=waiting_slo)
    a = dl("a", deadline=40.0, bound=1000, gen=10, running=True)  # latest start 40 - 990·0.01 ≈ 30 s
    w = dl("w", deadline=100.0)
    w.admit_by = 10.1  # the engine rejects it unless it starts within 0.1 s
    d = pol.schedule([a, w], ctx(b=1))
    assert d.batch == [first]


def _feasible(subset, t, p, share, is_new, c0, rate, U):
    """Brute-force check of one choice of new items against the DP's model (quantised new shares)."""
    units = np.ceil(share * U - 1e-9)
    slack = base = cf = 0.0
    u, prev = 0, 0.0
    for j in range(t.size):
        dt = t[j] - prev
        prev = t[j]
        slack += dt * rate * max(1.0 - c0 - cf - u / U, 0.0)
        base += dt * rate * max(1.0 - c0 - cf, 0.0)
        if is_new[j]:
            if j in subset:
                slack -= p[j]
                u += int(units[j])
                if slack < -1e-9 or u / U > 1.0 - c0 - cf + 1e-12:
                    return False
            continue
        slack -= p[j]
        base -= p[j]
        cf += share[j]
        if slack < min(base, 0.0) - 1e-6 or (u > 0 and u / U > 1.0 - c0 - cf + 1e-12):
            return False
    return True


def test_dp_finds_the_maximum_number_of_admissible_requests():
    from itertools import combinations

    rng = np.random.default_rng(7)
    U = 16
    pol = SLOsServePolicy(load_levels=U)
    for _ in range(150):
        k = int(rng.integers(1, 9))
        t = np.sort(rng.uniform(0.0, 2.0, k))
        p = rng.integers(0, 900, k).astype(float)
        share = rng.uniform(0.0, 0.4, k)
        is_new = rng.random(k) < 0.6
        c0 = float(rng.uniform(0.0, 0.8))
        take = pol._dp(t, p, share, is_new, c0, 1000.0)
        assert take[~is_new].all()
        chosen = set(np.flatnonzero(take & is_new).tolist())
        new = np.flatnonzero(is_new).tolist()
        assert _feasible(chosen, t, p, share, is_new, c0, 1000.0, U)
        best = max((r for r in range(len(new) + 1) for c in combinations(new, r)
                    if _feasible(set(c), t, p, share, is_new, c0, 1000.0, U)), default=0)
        assert len(chosen) == best


# ---------------------------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("on_decline", ["best_effort", "reject"])
def test_frame_invariants_on_synthetic_snapshots(on_decline):
    pol = SLOsServePolicy(on_decline=on_decline, max_candidates=16)
    rng = np.random.default_rng(0)
    for frame in range(6):
        views = synthetic_views(300, batch_size=16, seed=frame)
        b = int(rng.integers(1, 24))
        c = SchedContext(now=1000.0 + frame, batch_size=b, token_time=0.02, prefill_rate=3000.0,
                         kv_capacity_tokens=int(rng.integers(2_000, 50_000)))
        d = pol.schedule(views, c)
        ids = {v.req_id for v in views}
        running = {v.req_id for v in views if v.running}
        assert len(d.batch) <= b and len(set(d.batch)) == len(d.batch)
        assert set(d.batch) <= ids
        assert not set(d.batch) & set(d.preempt)
        assert not set(d.batch) & set(d.reject)
        assert set(d.preempt) <= running
        assert not set(d.reject) & running


def test_frame_cost_is_bounded_by_the_candidate_window():
    views = synthetic_views(3000, batch_size=64, seed=1)
    pol = SLOsServePolicy(max_candidates=8)
    d = pol.schedule(views, SchedContext(now=1000.0, batch_size=64, token_time=0.02, prefill_rate=5000.0))
    assert d.info["dp_items"] - d.info["admitted"] <= 8 + 64  # window + force-admitted running ones
    assert pol.declined + pol.admitted < 3000  # most requests are still undecided after one frame


# ---------------------------------------------------------------------------------------------- simulator
def _sim(jobs, policy, model=SMALL, waiting_time=None):
    analyzer = CompoundAnalyzer("none", DataSources.load(None), decode_s=model.decode_token_time(model.batch_size),
                                prefill_s=model.per_prefill_token_s, length_scale=0.1)
    eng = SimEngine(model, policy, LengthBounder("oracle"), analyzer, SimConfig(waiting_time=waiting_time, seed=0))
    return eng.run(jobs)


@pytest.mark.parametrize("waiting_time", [None, 5.0])
def test_low_load_simulation_serves_everything_within_slo(waiting_time):
    jobs = make_workload(60, 1.0, seed=3, length_scale=0.1)
    pol = SLOsServePolicy(delta_steps=50)
    out = _sim(jobs, pol, waiting_time=waiting_time)
    recs = out["jobs"]
    assert len(recs) == len(jobs) and not any(r["rejected"] for r in recs)
    by_id = {j.job_id: j for j in jobs}
    for r in recs:
        assert r["output_tokens"] == by_id[r["id"]].total_tokens[1]
    slo = [r for r in recs if r["kind"] in ("latency", "deadline", "compound")]
    assert {r["kind"] for r in slo} == {"latency", "deadline", "compound"}
    assert sum(r["slo_met"] for r in slo) >= 0.9 * len(slo)
    assert pol.admitted > 0


def test_overload_simulation_refuses_what_cannot_be_met():
    model = StepModel(**{**SMALL.to_dict(), "batch_size": 2, "name": "b2"})
    # 12 requests at once, 300 output tokens each (≈ 3.5 s of decode per pair) and a 6 s deadline:
    # only the first few can finish in time
    jobs = [Job(f"j{i}", "deadline", 0.0, "batch", [[CallSpec(50, 300)]], deadline=6.0) for i in range(12)]
    out = _sim(jobs, SLOsServePolicy(delta_steps=20, on_decline="reject"), model=model)
    recs = out["jobs"]
    rejected = [r for r in recs if r["rejected"]]
    served = [r for r in recs if not r["rejected"]]
    assert rejected and served
    assert all(r["output_tokens"] == 0 for r in rejected)
    assert all(r["slo_met"] for r in served)  # admitted requests keep their SLO
