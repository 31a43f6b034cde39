"""The per-step prefill budget (scheduler/prefill_budget.py): the pure rules, the pacer that applies them, and
their effect in the simulator."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from jitflow_server.bench.estimates import LengthBounder
from jitflow_server.engine.jobs import CallSpec, Job
from jitflow_server.engine.sim import SimConfig, SimEngine
from jitflow_server.engine.step_model import StepModel
from jitflow_server.scheduler import make_policy
from jitflow_server.scheduler.prefill_budget import (
    MIN_PREFILL_TOKENS,
    PrefillPacer,
    min_decode_slack,
    next_token_slack,
    prefill_token_budget,
    prefills_to_defer,
)


def linear_step(base: float, per_decode: float, per_prefill: float):
    return lambda n, p: base + per_decode * n + per_prefill * p


def test_slack_is_the_time_left_until_the_next_token_is_due():
    # token 11 of a request that arrived at 100 s with TTFT 2 s and TBT 0.1 s is due at 103 s
    assert next_token_slack(100.0, 2.0, 0.1, 10, now=102.5) == pytest.approx(0.5)
    assert next_token_slack(100.0, 2.0, 0.1, 10, now=103.5) == pytest.approx(-0.5)


def test_the_tightest_on_time_request_sets_the_slack_and_late_ones_are_not_protected():
    decodes = [(0.0, 2.0, 0.1, 10), (0.0, 1.0, 0.1, 10), (0.0, 0.5, 0.01, 10)]  # due at 3.0, 2.0, 0.6
    assert min_decode_slack(decodes, now=1.0) == pytest.approx(1.0)
    assert min_decode_slack([(0.0, 0.5, 0.01, 10)], now=1.0) is None
    assert min_decode_slack([], now=1.0) is None


def test_budget_fits_the_step_inside_the_slack_less_one_decode_step_of_reserve():
    step = linear_step(0.04, 0.002, 0.0007)  # 10 decodes: 0.06 s; + 0.7 ms per prompt token
    b = prefill_token_budget(0.5, 10, step, 2048)
    prefill = b - 10
    # the step with that prefill, plus one more decode step, fits the 0.5 s of slack; one more block does not
    assert step(10, prefill) + step(10, 0) <= 0.5 + 1e-9
    assert step(10, prefill + 16) + step(10, 0) > 0.5
    assert MIN_PREFILL_TOKENS < prefill < 2048


def test_budget_is_the_engines_without_a_latency_decode_or_with_ample_slack_and_never_starves_prompts():
    step = linear_step(0.04, 0.002, 0.0007)
    assert prefill_token_budget(None, 10, step, 2048) == 2048
    assert prefill_token_budget(30.0, 10, step, 2048) == 2048
    # a slack below one decode step still lets the smallest chunk through
    assert prefill_token_budget(0.01, 10, step, 2048) == 10 + MIN_PREFILL_TOKENS
    # never more than the engine's budget, even when the decodes leave less than the smallest chunk
    assert prefill_token_budget(0.01, 2040, step, 2048) == 2048
    # prefill that costs nothing is never capped
    assert prefill_token_budget(0.01, 10, linear_step(0.04, 0.002, 0.0), 2048) == 2048


CPU_LIKE = StepModel(name="cpu-like", base_s=0.03, per_decode_s=0.003, per_prefill_token_s=0.0007,
                     per_ctx_token_s=0.0, hetero=0.0, kv_capacity_tokens=200_000, block_size=16,
                     max_batched_tokens=2048, sarathi_chunk=512, batch_size=8)


def _chat_and_long_prompts() -> list[Job]:
    """A chat request decoding when four 2,000-token prompts with a loose deadline arrive at 1 s."""
    chat = Job("chat", "latency", 0.0, "chat", [[CallSpec(20, 120)]], ttft=0.5, tbt=0.08)
    docs = [Job(f"doc{i}", "deadline", 1.0, "summary", [[CallSpec(2000, 20)]], deadline=60.0) for i in range(4)]
    return [chat, *docs]


@pytest.mark.parametrize("budget", ["slack", "fixed"])
def test_in_the_simulator_the_budget_keeps_a_chat_on_its_timeline_through_long_prefills(budget):
    pol = make_policy("gmax", prefill_budget=budget)
    out = SimEngine(CPU_LIKE, pol, LengthBounder("oracle"), None, SimConfig(waiting_time=None)).run(
        _chat_and_long_prompts())
    recs = {r["id"]: r for r in out["jobs"]}
    assert all(recs[f"doc{i}"]["slo_met"] for i in range(4)), recs  # the prompts lose nothing that counts
    if budget == "slack":
        assert recs["chat"]["slo_met"] is True, recs["chat"]
    else:
        # vLLM's fixed 2,048-token chunks stall the chat by ~1.4 s a step: its tokens fall past due
        assert recs["chat"]["slo_met"] is False, recs["chat"]
        assert recs["chat"]["goodput"] < 120


def test_running_prompts_ranked_below_a_waiting_latency_request_sit_the_step_out():
    rank = {"chat": 0, "doc": 1, "early": 0, "other": 2}
    assert prefills_to_defer({"doc": 0, "chat": 1}, ["doc"], ["chat"]) == set()  # the plan ranks the prompt first
    assert prefills_to_defer({"chat": 0, "doc": 1}, ["doc"], ["chat"]) == {"doc"}
    assert prefills_to_defer(rank, ["doc", "other"], []) == set()  # no latency request waits
    assert prefills_to_defer(rank, ["doc", "other"], ["not-in-plan"]) == set()
    assert prefills_to_defer({"chat": 1, "doc": 2, "early": 0}, ["doc", "early"], ["chat"]) == {"doc"}


@dataclass
class Req:
    """A request as the pacer sees it: prompt in the KV cache or not, and a latency SLO timeline or none."""

    rid: str
    decoding: bool
    timeline: tuple[float, float, float, int] | None = None


def make_pacer() -> PrefillPacer[Req]:
    return PrefillPacer(lambda r: r.rid, lambda r: r.decoding, lambda r: r.timeline)


def test_the_pacer_defers_a_prompt_for_a_waiting_chat_once_and_not_while_the_chat_cannot_be_admitted():
    pacer = make_pacer()
    doc, chat = Req("doc", False), Req("chat", False, (0.0, 2.0, 0.1, 0))
    rank = {"chat": 0, "doc": 1}
    step = pacer.step([doc], [chat], rank, 0.5, linear_step(0.04, 0.001, 0.0007), 2048)
    assert step.run == [] and step.deferred == [doc] and step.budget == 2048  # nothing decodes: no cut
    # the chat still waits in the next step (no free KV cache): the prompt goes on this time
    step = pacer.step([doc], [chat], rank, 0.6, linear_step(0.04, 0.001, 0.0007), 2048)
    assert step.run == [doc] and step.deferred == []
    # ... and once a step has not deferred for it, it may again
    step = pacer.step([doc], [chat], rank, 0.7, linear_step(0.04, 0.001, 0.0007), 2048)
    assert step.deferred == [doc]
    assert pacer.deferred_prefills == 2 and pacer.paced_steps == 0


def test_the_pacer_cuts_the_budget_to_a_decoding_chats_slack_and_puts_decodes_first():
    pacer = make_pacer()
    step_time = linear_step(0.04, 0.001, 0.0007)
    doc = Req("doc", False)
    # token 11 due at 0 + 1 + 10 * 0.1 = 2.0 s; at 1.5 s the slack is 0.5 s
    chat = Req("chat", True, (0.0, 1.0, 0.1, 10))
    step = pacer.step([doc, chat], [], {"doc": 0, "chat": 1}, 1.5, step_time, 2048)
    assert step.run == [chat, doc] and step.deferred == []
    assert step.budget == prefill_token_budget(0.5, 1, step_time, 2048) < 2048
    assert pacer.paced_steps == 1
    # a chat already past due is not protected: the engine's budget, in plan order
    late = Req("chat", True, (0.0, 1.0, 0.1, 10))
    step = pacer.step([doc, late], [], {"doc": 0, "chat": 1}, 2.5, step_time, 2048)
    assert step.run == [doc, late] and step.budget == 2048 and pacer.paced_steps == 1
    # only decodes and nothing waiting: nothing to pace
    step = pacer.step([chat], [], {"chat": 0}, 1.5, step_time, 2048)
    assert step.run == [chat] and step.budget == 2048


@pytest.mark.parametrize("budget", ["slack", "fixed"])
def test_in_the_simulator_a_chat_arriving_behind_a_long_prefill_gets_its_first_token_in_time(budget):
    # an 8,000-token prompt takes four 2,048-token steps of ~1.4 s; a chat arrives during the first
    doc = Job("doc", "deadline", 0.0, "summary", [[CallSpec(8000, 20)]], deadline=60.0)
    chat = Job("chat", "latency", 0.5, "chat", [[CallSpec(20, 20)]], ttft=2.0, tbt=0.2)
    out = SimEngine(CPU_LIKE, make_policy("gmax", prefill_budget=budget), LengthBounder("oracle"), None,
                    SimConfig(waiting_time=None)).run([doc, chat])
    recs = {r["id"]: r for r in out["jobs"]}
    assert recs["doc"]["slo_met"] is True
    if budget == "slack":
        assert recs["chat"]["slo_met"] is True and recs["chat"]["ttft"] < 2.0, recs["chat"]
    else:  # vLLM runs the running prompt's chunks first: the chat waits for all of them
        assert recs["chat"]["ttft"] > 2.0, recs["chat"]


def test_a_step_cap_bounds_the_step_with_or_without_a_decoding_latency_request():
    step = linear_step(0.04, 0.002, 0.0007)
    b = prefill_token_budget(None, 10, step, 2048, max_step_s=0.5)
    assert step(10, b - 10) <= 0.5 + 1e-9 < step(10, b - 10 + 16)
    # the tighter of the slack and the cap wins
    assert prefill_token_budget(30.0, 10, step, 2048, max_step_s=0.5) == b
    assert prefill_token_budget(0.3, 10, step, 2048, max_step_s=0.5) == prefill_token_budget(0.3, 10, step, 2048)


def test_the_pacer_caps_every_step_at_a_share_of_the_smallest_ttft_it_has_seen():
    step_time = linear_step(0.04, 0.001, 0.0007)
    doc = Req("doc", False)
    pacer = make_pacer()
    # before any latency request the engine's budget, with or without a share
    assert pacer.step([doc], [], {"doc": 0}, 0.0, step_time, 2048, ttft_share=0.25).budget == 2048
    chat = Req("chat", False, (0.0, 2.0, 0.1, 0))
    pacer.step([doc], [chat], {"chat": 0, "doc": 1}, 0.1, step_time, 2048, ttft_share=0.25)
    assert pacer.min_ttft == 2.0
    # the chat has come and gone: no latency request decodes or waits, and the step is still capped at 0.5 s
    capped = pacer.step([doc], [], {"doc": 0}, 5.0, step_time, 2048, ttft_share=0.25)
    assert capped.budget == prefill_token_budget(None, 0, step_time, 2048, max_step_s=0.5) < 2048
    assert pacer.step([doc], [], {"doc": 0}, 5.0, step_time, 2048).budget == 2048  # share 0: no cap
    # more requests unfinished than the batch holds: every step's prefill is queued work, and the cap is off
    assert pacer.step([doc], [], {"doc": 0}, 5.0, step_time, 2048, ttft_share=0.25, overloaded=True).budget == 2048


@pytest.mark.parametrize("share", [0.0, 0.25])
def test_in_the_simulator_a_step_cap_lets_a_chat_arriving_during_a_long_prefill_in_sooner(share):
    # a first chat sets the smallest TTFT (1.2 s) and is done before an 8,000-token prompt arrives at 1 s;
    # its first 2,048-token step runs ~1.4 s, and a second chat arrives 0.05 s into it
    first = Job("c1", "latency", 0.0, "chat", [[CallSpec(20, 5)]], ttft=1.2, tbt=0.2)
    doc = Job("doc", "deadline", 1.0, "summary", [[CallSpec(8000, 20)]], deadline=60.0)
    second = Job("c2", "latency", 1.05, "chat", [[CallSpec(20, 5)]], ttft=1.2, tbt=0.2)
    pol = make_policy("gmax", prefill_ttft_share=share)
    out = SimEngine(CPU_LIKE, pol, LengthBounder("oracle"), None, SimConfig(waiting_time=None)).run(
        [first, doc, second])
    recs = {r["id"]: r for r in out["jobs"]}
    assert recs["c1"]["slo_met"] is True and recs["doc"]["slo_met"] is True
    if share:  # steps of at most 0.3 s: the chat is in the engine within one
        assert recs["c2"]["slo_met"] is True and recs["c2"]["ttft"] < 0.6, recs["c2"]
    else:  # the chat waits for the whole step
        assert recs["c2"]["ttft"] > 1.2, recs["c2"]


def test_prefill_ttft_share_must_be_a_finite_non_negative_number():
    for bad in (-0.1, float("inf")):
        with pytest.raises(ValueError, match="prefill_ttft_share"):
            make_policy("gmax", prefill_ttft_share=bad)
