"""Peer baselines vllm-priority, tempo and qlm: ordering, preemption and rejection semantics, parameter
validation, frame invariants, and a short simulator run of each."""

from __future__ import annotations

import numpy as np
import pytest

from jitflow_server.scheduler import (
    POLICY_NAMES,
    Kind,
    QLMPolicy,
    RequestView,
    SchedContext,
    TempoPolicy,
    VLLMPriorityPolicy,
    make_policy,
)

PEERS = ("vllm-priority", "tempo", "qlm")


def ctx(b: int, now: float = 10.0, **kw) -> SchedContext:
    return SchedContext(now=now, batch_size=b, token_time=0.02, prefill_rate=2000.0, **kw)


def req(rid: str, kind: Kind = Kind.BEST_EFFORT, arrival: float = 0.0, gen: int = 0, bound: int = 100,
        running: bool = False, inp: int = 50, **kw) -> RequestView:
    return RequestView(rid, kind, arrival, inp, gen, bound, running, kv_tokens=inp + gen if running else 0, **kw)


# ---------------------------------------------------------------------------------------------- registry
def test_peers_are_registered_and_served():
    from jitflow_server.serve import served_policies

    for name in PEERS:
        assert name in POLICY_NAMES
        assert name in served_policies()
        assert make_policy(name).name == name
    from jitflow_server.scheduler import SLOsServePolicy

    assert "slos-serve" in served_policies() and isinstance(make_policy("slos-serve"), SLOsServePolicy)
    assert isinstance(make_policy("vllm-priority"), VLLMPriorityPolicy)
    assert isinstance(make_policy("tempo"), TempoPolicy)
    assert isinstance(make_policy("qlm"), QLMPolicy)


@pytest.mark.parametrize("name,params", [
    ("vllm-priority", {"delta_steps": 0}),
    ("vllm-priority", {"best_effort_deadline": -1.0}),
    ("vllm-priority", {"preempt_for_waiting": "yes"}),
    ("tempo", {"default_ttft": 0.0}),
    ("tempo", {"default_tbt": float("nan")}),
    ("tempo", {"alpha": 0.0}),
    ("tempo", {"reserve": 1.5}),
    ("tempo", {"w_out": -2.0}),
    ("tempo", {"defer_slack": -1.0}),
    ("qlm", {"attainment": 1.0}),
    ("qlm", {"group_factor": 0}),
    ("qlm", {"slo_ratio": 1.0}),
    ("qlm", {"on_infeasible": "scale-up"}),
    ("qlm", {"min_history": 2.5}),
    ("qlm", {"delta_steps": 1.5}),
    ("qlm", {"waiting_slo": "no"}),
    ("qlm", {"group_factor": float("inf")}),
])
def test_bad_parameters_raise(name, params):
    with pytest.raises(ValueError):
        make_policy(name, **params)


@pytest.mark.parametrize("name,extra", [("vllm-priority", "preempt_for_waiting"), ("tempo", "reserve"),
                                        ("qlm", "on_infeasible")])
def test_unknown_parameter_lists_the_valid_ones(name, extra):
    with pytest.raises(ValueError, match=f"valid: best_effort_deadline.*{extra}"):
        make_policy(name, lookback=3)


# ---------------------------------------------------------------------------------------------- vllm-priority
def test_vllm_priority_orders_waiting_by_integer_due_second_then_arrival():
    views = [
        req("be", arrival=0.0),  # 0 + 60 -> priority 60
        req("d_late", Kind.DEADLINE, arrival=5.0, deadline=30.4),  # priority 30, arrived later
        req("d_early", Kind.DEADLINE, arrival=1.0, deadline=30.9),  # priority 30, arrived first
        req("lat", Kind.LATENCY, arrival=9.0, ttft=2.0, tbt=0.1),  # 9 + 2 -> 11
        req("comp", Kind.COMPOUND, arrival=2.0, deadline=99.0, sub_deadline=20.0, task_id="t", stage_index=0),
    ]
    d = make_policy("vllm-priority").schedule(views, ctx(5))
    assert d.batch == ["lat", "comp", "d_early", "d_late", "be"]
    assert d.priorities["lat"] == -11.0 and d.priorities["d_late"] == d.priorities["d_early"] == -30.0


def test_vllm_priority_is_fixed_at_arrival():
    pol = make_policy("vllm-priority")
    comp = req("c", Kind.COMPOUND, arrival=0.0, deadline=200.0, sub_deadline=100.0, task_id="t", stage_index=0)
    dl = req("d", Kind.DEADLINE, arrival=1.0, deadline=50.0)
    assert pol.schedule([comp, dl], ctx(1)).batch == ["d"]
    comp.sub_deadline = 5.0  # the analyzer tightens the stage later: a vLLM priority does not change
    assert pol.schedule([comp, dl], ctx(1)).batch == ["d"]
    assert make_policy("vllm-priority").schedule([comp, dl], ctx(1)).batch == ["c"]  # a new policy sees 5


def test_vllm_priority_v1_running_keep_their_slots_sorted_worst_last():
    views = [req("r_bad", Kind.DEADLINE, deadline=90.0, running=True, gen=3),
             req("r_good", Kind.DEADLINE, deadline=40.0, running=True, gen=3),
             req("w_best", Kind.DEADLINE, arrival=5.0, deadline=12.0)]
    d = make_policy("vllm-priority").schedule(views, ctx(2))
    # installed vLLM v1: no preemption for a waiting request; the engine's KV victim is the last running
    assert d.batch == ["r_good", "r_bad"] and d.preempt == []
    d3 = make_policy("vllm-priority").schedule(views, ctx(3))
    assert d3.batch == ["r_good", "r_bad", "w_best"]


def test_vllm_priority_v0_preempts_only_for_a_strictly_better_waiting_request():
    pol = make_policy("vllm-priority", preempt_for_waiting=True)
    views = [req("r_bad", Kind.DEADLINE, deadline=90.0, running=True, gen=3),
             req("r_good", Kind.DEADLINE, deadline=40.0, running=True, gen=3),
             req("w_best", Kind.DEADLINE, arrival=5.0, deadline=12.0),
             req("w_worse", Kind.DEADLINE, arrival=5.0, deadline=95.0)]
    d = pol.schedule(views, ctx(2))
    assert d.batch == ["r_good", "w_best"] and d.preempt == ["r_bad"]
    # same (priority, arrival) as the worst running request: no inversion, no preemption
    tie = [req("r", Kind.DEADLINE, arrival=1.0, deadline=30.2, running=True, gen=3),
           req("w", Kind.DEADLINE, arrival=1.0, deadline=30.7)]
    d = make_policy("vllm-priority", preempt_for_waiting=True).schedule(tie, ctx(1))
    assert d.batch == ["r"] and d.preempt == []
    # a free slot but no KV room: the worse running request makes room
    kv = [req("r", Kind.DEADLINE, deadline=90.0, running=True, gen=50, inp=900),
          req("w", Kind.DEADLINE, arrival=3.0, deadline=20.0, inp=500)]
    d = make_policy("vllm-priority", preempt_for_waiting=True).schedule(kv, ctx(2, kv_capacity_tokens=1200))
    assert d.batch == ["w"] and d.preempt == ["r"]
    roomy = make_policy("vllm-priority", preempt_for_waiting=True).schedule(kv, ctx(2, kv_capacity_tokens=5000))
    assert roomy.batch == ["r", "w"] and roomy.preempt == []


# ---------------------------------------------------------------------------------------------- tempo
def test_tempo_ranks_by_service_gain_density():
    pol = make_policy("tempo", reserve=0.0)
    # both urgent (deadline soon); short: (50 + 2·50) / (0.025 + 50·0.02) > long: (50 + 2·500) / (0.025 + 10)
    views = [req("long", Kind.DEADLINE, deadline=20.0, bound=500), req("short", Kind.DEADLINE, deadline=11.5, bound=50)]
    d = pol.schedule(views, ctx(1))
    assert d.batch == ["short"] and d.priorities["short"] > d.priorities["long"]
    # a hopeless deadline (long past) decays the gain (f = 1/(1 + alpha·x)): the other one wins
    late = [req("gone", Kind.DEADLINE, arrival=0.0, deadline=1.0, bound=50),
            req("ok", Kind.DEADLINE, arrival=9.0, deadline=11.0, bound=60)]
    assert make_policy("tempo", reserve=0.0, alpha=5.0).schedule(late, ctx(1)).batch == ["ok"]


def test_tempo_defers_requests_ahead_of_their_schedule():
    pol = make_policy("tempo", reserve=0.0, defer_slack=1.0)
    views = [
        # high density but 90 s of slack: deferred
        req("slack", Kind.DEADLINE, deadline=100.0, bound=20),
        # lower density (longer), due soon: urgent, served first
        req("urgent", Kind.DEADLINE, deadline=16.0, bound=250),
        # latency request ahead of its timeline: next token due 9 + 1 + 40·0.1 = 14 s, 4 s away -> deferred
        req("ahead", Kind.LATENCY, arrival=9.0, gen=40, bound=100, running=True, ttft=1.0, tbt=0.1),
        # latency request behind its timeline: urgent
        req("behind", Kind.LATENCY, arrival=0.0, gen=10, bound=100, running=True, ttft=1.0, tbt=0.1),
    ]
    est = pol.estimates(pol._cache.build(views), ctx(4))
    assert est["density"][0] > est["density"][1]
    d = pol.schedule(views, ctx(2, kv_capacity_tokens=10**6))
    assert set(d.batch) == {"urgent", "behind"} and d.info["urgent"] == 2
    assert d.preempt == []  # the deferred running request keeps its KV (paused)


def test_tempo_reserves_best_effort_slots_fcfs():
    views = [req("u1", Kind.DEADLINE, deadline=11.0), req("u2", Kind.DEADLINE, deadline=11.0),
             req("be_new", arrival=5.0), req("be_old", arrival=1.0)]
    assert make_policy("tempo", reserve=0.5).schedule(views, ctx(2)).batch == ["be_old", "u1"]
    assert set(make_policy("tempo", reserve=0.0).schedule(views, ctx(2)).batch) == {"u1", "u2"}


def test_tempo_prices_a_stage_by_its_longest_call():
    pol = make_policy("tempo", reserve=0.0)
    views = [req("short_call", Kind.COMPOUND, deadline=99.0, sub_deadline=30.0, bound=20, task_id="t", stage_index=0),
             req("long_call", Kind.COMPOUND, deadline=99.0, sub_deadline=30.0, bound=800, task_id="t", stage_index=0),
             req("solo", Kind.COMPOUND, deadline=99.0, sub_deadline=30.0, bound=20, task_id="u", stage_index=0)]
    est = pol.estimates(pol._cache.build(views), ctx(3))
    # same stage: the short call's completion time is the stage's, so its density is far lower than alone
    assert est["exec"][0] == pytest.approx(est["exec"][1])
    assert est["density"][0] < est["density"][2] / 10


def test_tempo_preempts_only_when_the_gain_pays_for_the_stall():
    # waiting and running both urgent; the waiting one is denser by a small margin
    run_big = req("run", Kind.DEADLINE, deadline=20.0, bound=210, running=True, gen=10, inp=4000)
    wait = req("wait", Kind.DEADLINE, arrival=9.0, deadline=20.0, bound=200)
    d = make_policy("tempo", reserve=0.0, defer_slack=100.0).schedule([run_big, wait], ctx(1))
    assert d.batch == ["run"] and d.preempt == []  # 4 000 tokens of KV: a 2 s stall is not worth it
    run_small = req("run", Kind.DEADLINE, deadline=20.0, bound=2000, running=True, gen=10, inp=10)
    d = make_policy("tempo", reserve=0.0, defer_slack=100.0).schedule([run_small, wait], ctx(1))
    assert d.batch == ["wait"] and d.preempt == ["run"]


# ---------------------------------------------------------------------------------------------- qlm
def test_qlm_keeps_fcfs_virtual_queue_while_slos_hold():
    pol = make_policy("qlm")
    views = [req("b", Kind.DEADLINE, arrival=2.0, deadline=500.0), req("a", Kind.DEADLINE, arrival=1.0, deadline=500.0),
             req("e", arrival=0.5)]
    d = pol.schedule(views, ctx(2))
    assert d.batch == ["e", "a"] and pol.replans == 0  # groups in creation order, FCFS inside a group


def test_qlm_replans_on_a_predicted_violation_and_evicts():
    pol = make_policy("qlm")
    views = [req("loose", Kind.DEADLINE, arrival=0.0, deadline=900.0, running=True, gen=5, bound=400),
             req("tight", Kind.DEADLINE, arrival=9.5, deadline=14.0, bound=100)]
    d = pol.schedule(views, ctx(1))
    assert pol.replans == 1 and pol.infeasible == 0
    assert d.batch == ["tight"] and d.preempt == ["loose"]
    assert d.reject == []


def test_qlm_holds_groups_to_the_admission_deadline_of_their_waiting_members():
    views = [req("old", Kind.DEADLINE, arrival=1.0, deadline=501.0),
             req("new", Kind.DEADLINE, arrival=9.0, deadline=109.0, admit_by=10.1)]
    assert make_policy("qlm", waiting_slo=False).schedule(views, ctx(1)).batch == ["old"]
    pol = make_policy("qlm")
    assert pol.schedule(views, ctx(1)).batch == ["new"] and pol.replans == 1


def test_qlm_smith_rule_puts_short_groups_first_within_deadlines():
    pol = QLMPolicy()
    work = np.array([5.0, 1.0, 3.0])
    zero = np.zeros(3)
    # loose deadlines: shortest work first (minimises the sum of completion times, Eq. 13)
    assert pol._smith(work, zero, zero, zero, np.full(3, 100.0), 0.0).tolist() == [1, 2, 0]
    # group 0 must start by t = 0.5: it goes first although it is the longest
    slo = np.array([5.0, 100.0, 100.0])
    C = np.array([4.5, 0.0, 0.0])
    assert pol._smith(work, zero, C, zero, slo, 0.0).tolist() == [0, 1, 2]
    # by t = 1 it may wait for the shortest group
    assert pol._smith(work, zero, C, zero, slo + 0.5, 0.0).tolist() == [1, 0, 2]
    # impossible: two groups that each must start at 0
    assert pol._smith(work[:2], zero[:2], zero[:2], zero[:2], np.array([0.5, 0.5]), 0.0) is None


def test_qlm_drops_unmeetable_waiting_requests_only_when_asked():
    views = [req("hopeless", Kind.DEADLINE, arrival=5.0, deadline=10.5, bound=2000),  # needs 40 s
             req("hopeless_run", Kind.DEADLINE, arrival=4.0, deadline=10.5, bound=2000, running=True, gen=1),
             req("fine", Kind.DEADLINE, arrival=6.0, deadline=200.0, bound=50)]
    edf = make_policy("qlm").schedule(views, ctx(2))
    assert edf.reject == []
    pol = make_policy("qlm", on_infeasible="drop")
    d = pol.schedule(views, ctx(2))
    assert pol.infeasible == 0  # the hopeless group's constraint is relaxed, the rest is feasible
    assert d.reject == ["hopeless"]  # running (already scheduled) requests are never refused
    assert "hopeless" not in d.batch and "fine" in d.batch


def test_qlm_fits_output_lengths_per_class_from_finished_requests():
    pol = make_policy("qlm", min_history=3)
    for k in range(3):
        r = req(f"f{k}", Kind.DEADLINE, deadline=500.0, bound=1000, gen=40, running=True)
        pol.schedule([r], ctx(1))
        pol.on_finished(r.req_id, 0.0, 10.0)
    probe = req("p", Kind.DEADLINE, deadline=500.0, bound=1000)
    snap = pol._cache.build([probe])
    gid = np.zeros(1, np.int64)
    pol._assign(snap, np.array([0]), gid, 1)
    est = pol._estimates(snap, ctx(1), pol._grp_cls[gid])
    assert est["exec"][0] == pytest.approx(50 / 2000 + 40 * 0.02)  # mean 40 tokens, not the 1000 bound


# ---------------------------------------------------------------------------------------------- invariants
def _random_views(rng: np.random.Generator, n: int, now: float) -> list[RequestView]:
    views = []
    kinds = list(Kind)
    for i in range(n):
        k = kinds[int(rng.integers(len(kinds)))]
        arr = float(rng.uniform(0.0, now))
        gen = int(rng.integers(0, 50))
        running = bool(rng.random() < 0.3)
        inp = int(rng.integers(1, 400))
        kw: dict = {}
        if k is Kind.LATENCY:
            kw = {"ttft": float(rng.uniform(0.5, 3)), "tbt": float(rng.uniform(0.03, 0.2))}
        elif k is Kind.DEADLINE:
            kw = {"deadline": arr + float(rng.uniform(1, 60))}
        elif k is Kind.COMPOUND:
            kw = {"deadline": arr + 80.0, "sub_deadline": arr + float(rng.uniform(1, 40)),
                  "task_id": f"t{i % 7}", "stage_index": i % 2}
        views.append(RequestView(f"r{i}", k, arr, inp, gen if running else 0, gen + int(rng.integers(1, 300)),
                                 running, kv_tokens=inp + gen if running else 0, **kw))
    return views


@pytest.mark.parametrize("name,params", [("vllm-priority", {}), ("vllm-priority", {"preempt_for_waiting": True}),
                                         ("tempo", {}), ("qlm", {}), ("qlm", {"on_infeasible": "drop"})])
@pytest.mark.parametrize("kv", [None, 20_000])
def test_decisions_respect_batch_and_disjointness(name, params, kv):
    rng = np.random.default_rng(7)
    pol = make_policy(name, **params)
    for frame in range(6):
        now = 30.0 + frame
        views = _random_views(rng, 120, now)
        d = pol.schedule(views, ctx(8, now=now, kv_capacity_tokens=kv))
        by_id = {v.req_id: v for v in views}
        assert len(d.batch) <= 8 and len(set(d.batch)) == len(d.batch)
        assert not set(d.batch) & set(d.preempt)
        assert all(by_id[r].running for r in d.preempt)
        assert not set(d.reject) & set(d.batch)
        assert all(not by_id[r].running and by_id[r].generated == 0 for r in d.reject)
        if d.batch:
            assert set(d.batch) <= set(by_id)


@pytest.mark.parametrize("name", PEERS)
def test_empty_frame_and_recompute_clock(name):
    pol = make_policy(name, delta_steps=5)
    assert pol.schedule([], ctx(4)).batch == []
    assert pol.needs_recompute(0, False)
    assert not pol.needs_recompute(3, False)
    assert pol.needs_recompute(4, True)
    assert pol.needs_recompute(9, False)
    pol.invalidate("nope")
    pol.on_finished("nope", 0.0, 1.0)


# ---------------------------------------------------------------------------------------------- simulator
@pytest.mark.parametrize("name", PEERS)
def test_short_simulation_completes_and_serves(name):
    from jitflow_server.bench.estimates import CompoundAnalyzer, LengthBounder
    from jitflow_server.bench.workload import DataSources, make_workload
    from jitflow_server.engine.sim import SimConfig, SimEngine
    from jitflow_server.engine.step_model import StepModel

    model = StepModel(name="test", base_s=0.01, per_decode_s=0.0005, per_prefill_token_s=0.0002,
                      per_ctx_token_s=1e-7, hetero=0.1, kv_capacity_tokens=60_000, block_size=16,
                      max_batched_tokens=1024, sarathi_chunk=256, batch_size=8)
    an = CompoundAnalyzer("none", DataSources.load(None), decode_s=model.decode_token_time(model.batch_size),
                          prefill_s=model.per_prefill_token_s, length_scale=0.1)
    jobs = make_workload(60, 6.0, seed=3, length_scale=0.1)
    out = SimEngine(model, make_policy(name, delta_steps=5), LengthBounder("noisy"), an,
                    SimConfig(waiting_time=None, seed=0)).run(jobs)
    recs = out["jobs"]
    assert len(recs) == len(jobs)
    served = [r for r in recs if not r["rejected"]]
    assert served and sum(r["output_tokens"] for r in served) > 0
    done = [r for r in served if r["output_tokens"] == next(j for j in jobs if j.job_id == r["id"]).total_tokens[1]]
    assert len(done) >= len(jobs) // 2  # every request finishes (waiting_time=None): most generate fully
