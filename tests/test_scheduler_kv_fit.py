"""Admission by the KV cache (``GMAXParams.kv_fit``): a waiting prompt the KV cache cannot hold whole waits."""

from __future__ import annotations

from jitflow_server.bench.estimates import CompoundAnalyzer, LengthBounder
from jitflow_server.bench.workload import DataSources
from jitflow_server.engine.jobs import CallSpec, Job
from jitflow_server.engine.sim import SimConfig, SimEngine
from jitflow_server.engine.step_model import StepModel
from jitflow_server.scheduler import GMAXPolicy, Kind, RequestView, SchedContext, make_policy

V, PREFILL = 0.01, 1000.0


def _deadline(rid: str, inp: int, out: int, running: bool = False, kv: int = 0, gen: int = 0) -> RequestView:
    return RequestView(rid, Kind.DEADLINE, 0.0, inp, gen, out, running, kv_tokens=kv, deadline=1000.0)


def _policy(**kw) -> GMAXPolicy:
    kw.setdefault("request_weight", 0.0)  # rank by tokens alone, so that BIG outranks SMALL
    return GMAXPolicy(adapt_p=False, starvation_delta=0.0, jit=False, full_priorities=True, **kw)


def _ctx(capacity: int | None) -> SchedContext:
    return SchedContext(now=1.0, batch_size=4, token_time=V, prefill_rate=PREFILL, kv_capacity_tokens=capacity)


def _views() -> list[RequestView]:
    # R runs and holds 6 000 tokens; BIG (5 000-token prompt) outranks SMALL (500) but cannot fit beside R
    return [_deadline("R", 6000, 100, running=True, kv=6010, gen=10), _deadline("BIG", 5000, 100),
            _deadline("SMALL", 500, 100)]


def test_a_prompt_the_kv_cache_cannot_hold_whole_waits_and_a_smaller_one_takes_the_room():
    d = _policy().schedule(_views(), _ctx(10_000))
    assert d.priorities["BIG"] > d.priorities["SMALL"]
    assert set(d.batch) == {"R", "SMALL"} and d.preempt == []
    assert d.info["kv_left"] == 1
    # left to the engine (kv_fit off), BIG is admitted: the engine would take its first chunk and then
    # preempt R or SMALL for the rest of its prompt
    off = _policy(kv_fit=False).schedule(_views(), _ctx(10_000))
    assert set(off.batch) == {"R", "BIG", "SMALL"}


def test_nothing_changes_while_the_kv_cache_holds_the_batch():
    for capacity in (100_000, None):
        d = _policy().schedule(_views(), _ctx(capacity))
        assert set(d.batch) == {"R", "BIG", "SMALL"} and d.info["kv_left"] == 0


def test_kv_fit_is_validated():
    try:
        _policy(kv_fit="yes")
    except ValueError as exc:
        assert "kv_fit" in str(exc)
    else:
        raise AssertionError("kv_fit='yes' was accepted")


GIANT = StepModel(name="kv-bound", base_s=0.01, per_decode_s=0.0005, per_prefill_token_s=0.0001, per_ctx_token_s=1e-7,
                  hetero=0.0, kv_capacity_tokens=40_000, block_size=16, max_batched_tokens=2048, sarathi_chunk=256,
                  batch_size=16)


def _run(kv_fit: bool) -> dict:
    # a KV-bound mix: a 30 000-token prompt among 2 000-token ones, all arriving within a second
    jobs = [Job(f"s{i}", "deadline", 0.05 * i, "batch", [[CallSpec(2000, 200)]], deadline=60.0) for i in range(12)]
    jobs += [Job(f"g{i}", "deadline", 0.3 + 0.2 * i, "batch", [[CallSpec(30_000, 50)]], deadline=60.0) for i in range(2)]
    jobs.sort(key=lambda j: j.arrival)
    pol = make_policy("gmax", kv_fit=kv_fit)
    an = CompoundAnalyzer("none", DataSources.load(None), decode_s=GIANT.decode_token_time(GIANT.batch_size),
                          prefill_s=GIANT.per_prefill_token_s)
    return SimEngine(GIANT, pol, LengthBounder("oracle"), an, SimConfig(seed=0, waiting_time=None)).run(jobs)


def test_in_the_simulator_long_prompts_no_longer_preempt_running_requests_for_kv():
    off, on = _run(False), _run(True)
    assert off["preemptions_by_reason"].get("kv", 0) > 0  # the engine preempted for the giants' later chunks
    assert on["preemptions_by_reason"].get("kv", 0) == 0
    prompts = 12 * 2000 + 2 * 30_000
    assert off["prefill_tokens"] > prompts  # prompts computed again after their preemption
    assert on["prefill_tokens"] == prompts  # every prompt computed once
    assert sum(r["slo_met"] for r in on["jobs"]) == 14
    assert on["makespan"] < off["makespan"]


def test_with_nothing_running_a_request_larger_than_the_kv_cache_still_runs():
    # it could otherwise never start; whether it fits is the engine's to decide (its model length)
    views = [_deadline("HUGE", 20_000, 100), _deadline("SMALL", 500, 100)]
    d = _policy().schedule(views, _ctx(10_000))
    assert "HUGE" in d.batch and "SMALL" not in d.batch and d.info["kv_left"] == 1
