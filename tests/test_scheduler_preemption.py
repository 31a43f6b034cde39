"""Cost-aware preemption (JITServe §4.2): preempt only when the projected gain exceeds the stall loss."""

from __future__ import annotations

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
    kw.setdefault("preempt_margin", 0.1)
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
