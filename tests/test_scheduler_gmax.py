"""GMAX policy core: window selection, infeasibility filter, δ anti-starvation, stage groups, limits."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from jitflow_server.scheduler import (
    POLICY_NAMES,
    GMAXPolicy,
    Kind,
    RequestView,
    SchedContext,
    SchedulingInputError,
    make_policy,
    on_time_tokens,
)
from jitflow_server.scheduler.synthetic import synthetic_views

FAST_PREFILL = 1e12  # prefill time negligible: priority = (input + output) / (output · v_token)


def ctx(now: float = 1.0, b: int = 2, v: float = 0.01, prefill: float = FAST_PREFILL, **kw) -> SchedContext:
    return SchedContext(now=now, batch_size=b, token_time=v, prefill_rate=prefill, **kw)


def dl(rid: str, inp: int, out: int, deadline: float = 1000.0, arrival: float = 0.0, **kw) -> RequestView:
    return RequestView(rid, Kind.DEADLINE, arrival, inp, 0, out, False, deadline=deadline, **kw)


def gmax(**kw) -> GMAXPolicy:
    """The paper's ranking (``gmax-paper``): these tests check JITServe §4.2's formulas."""
    kw.setdefault("jit", False)
    kw.setdefault("free_pause", True)
    kw.setdefault("adapt_p", False)
    kw.setdefault("starvation_delta", 0.0)
    kw.setdefault("request_weight", 0.0)  # the paper's token-only objective
    kw.setdefault("bound_share", 1.0)  # plans with the whole length bound (§4.1)
    kw.setdefault("deadline_soft_share", 0.0)  # feasible by the bound or not at all
    return GMAXPolicy(**kw)


def brute_force_window(prio: dict[str, float], inputs: dict[str, int], b: int, p: float,
                       protect: bool = False) -> set[str]:
    """Independent re-statement of Alg. 1: cutoff, sort by input length, best contiguous window.
    ``protect``: requests at or above ``bp/p`` are kept first and the window fills the other slots."""
    ranked = sorted(prio.values(), reverse=True)
    bp = ranked[b - 1]
    kept = sorted((r for r in prio if protect and prio[r] >= bp / p), key=lambda r: -prio[r])[:b]
    w = b - len(kept)
    cand = sorted((r for r in prio if prio[r] >= p * bp and r not in kept), key=lambda r: (inputs[r], -prio[r]))
    if w == 0:
        return set(kept)
    w = min(w, len(cand))
    best, best_sum = None, -math.inf
    for k in range(len(cand) - w + 1):
        s = sum(prio[r] for r in cand[k : k + w])
        if s > best_sum:
            best, best_sum = set(cand[k : k + w]), s
    return set(kept) | best


def window_scenario() -> list[RequestView]:
    # priority = 100·(1 + in/out):  A 340, B 105, C 350, D 300 ; input lengths 12, 20, 1000, 1010
    return [dl("A", 12, 5), dl("B", 20, 400), dl("C", 1000, 400), dl("D", 1010, 505)]


def test_best_summed_priority_window_wins_over_greedy_top_b():
    views = window_scenario()
    d = gmax(p=0.3).schedule(views, ctx(b=2))
    pr = d.priorities
    # the two individually best requests are C and A, but they are far apart in input length
    assert sorted(pr, key=pr.get, reverse=True)[:2] == ["C", "A"]
    # windows over the input-sorted list: (A,B) 445, (B,C) 455, (C,D) 650 -> (C,D)
    assert set(d.batch) == {"C", "D"}
    assert set(d.batch) == brute_force_window(pr, {v.req_id: v.input_len for v in views}, 2, 0.3)
    assert d.batch == sorted(d.batch, key=pr.get, reverse=True)


def test_cutoff_one_keeps_only_top_b_candidates():
    d = gmax(p=1.0).schedule(window_scenario(), ctx(b=2))
    assert set(d.batch) == {"C", "A"}


@pytest.mark.parametrize("window", ["paper", "protected"])
def test_window_matches_brute_force_on_random_sets(window):
    rng = random.Random(7)
    n_protected = 0
    for trial in range(60):
        views = [dl(f"r{i}", rng.randint(1, 4000), rng.randint(1, 800), deadline=1e6) for i in range(rng.randint(3, 40))]
        b = rng.randint(1, 8)
        p = rng.choice([0.5, 0.8, 0.95, 1.0])
        d = gmax(p=p, full_priorities=True, window=window).schedule(views, ctx(b=b))
        if len(views) <= b:
            assert set(d.batch) == {v.req_id for v in views}
            continue
        pr = d.priorities
        n_protected += d.info["protected"]
        expect = brute_force_window(pr, {v.req_id: v.input_len for v in views}, b, p, protect=window == "protected")
        assert len(set(d.batch)) == b, trial
        assert sum(pr[r] for r in d.batch) == pytest.approx(sum(pr[r] for r in expect), rel=1e-12), trial
    assert (n_protected > 0) == (window == "protected")  # the random sets exercise the protected path


def test_protected_window_keeps_an_urgent_short_request_the_paper_window_drops():
    # L: very high priority, long input; Y: short input, 20x the B-th priority; M1..M3 near the cutoff
    views = [dl("L", 3000, 5, deadline=1e6), dl("Y", 400, 3),
             dl("M1", 2000, 400), dl("M2", 2100, 400), dl("M3", 2200, 400)]
    paper = gmax(p=0.5, window="paper", full_priorities=True).schedule(views, ctx(b=3))
    pr = paper.priorities
    ranked = sorted(pr, key=pr.get, reverse=True)
    assert ranked[:3] == ["L", "Y", "M3"] and pr["Y"] >= pr["M3"] / 0.5  # Y is clearly inside the top B
    # the paper's windows over input length: (Y,M1,M2), (M1,M2,M3), (M2,M3,L): L's sum wins, Y is out
    assert set(paper.batch) == {"M2", "M3", "L"}
    prot = gmax(p=0.5, window="protected").schedule(views, ctx(b=3))
    assert set(prot.batch) == {"L", "Y", "M3"} and prot.info["protected"] == 2


def test_infeasible_deadline_request_is_demoted_not_blocking():
    # X: 1000 tokens at 0.01 s/token = 10 s of work, deadline in 5 s -> cannot make it even alone
    x = dl("X", 5000, 1000, deadline=6.0)
    y = dl("Y", 10, 100, deadline=100.0)
    pol = gmax()
    d = pol.schedule([x, y], ctx(now=1.0, b=1))
    assert d.batch == ["Y"]
    est = pol.last_estimates
    assert list(est.feasible) == [False, True]
    assert est.goodput[0] == 0.0 and est.goodput[1] == 110.0
    # the same request with a reachable deadline outranks Y: the demotion is what changed the order
    d2 = gmax().schedule([dl("X", 5000, 1000, deadline=20.0), y], ctx(now=1.0, b=1))
    assert d2.batch == ["X"]
    # with spare capacity the demoted request still runs (work conserving)
    d3 = gmax().schedule([x, y], ctx(now=1.0, b=2))
    assert set(d3.batch) == {"X", "Y"}


def test_infeasible_latency_request_is_demoted():
    # TBT of 1 ms is faster than the engine's 10 ms per token and TTFT expired: no token can be on time
    late = RequestView("L", Kind.LATENCY, 0.0, 10, 0, 100, False, ttft=1.0, tbt=0.001)
    ok = RequestView("M", Kind.LATENCY, 99.9, 10, 0, 100, False, ttft=2.0, tbt=0.1)
    pol = gmax()
    d = pol.schedule([late, ok], ctx(now=100.0, b=1))
    assert d.batch == ["M"]
    assert list(pol.last_estimates.feasible) == [False, True]


def test_latency_goodput_counts_tokens_that_can_catch_up():
    # arrival 0, TTFT 1 s, TBT 0.1 s, now 2 s: behind the timeline, decoding at 0.05 s/token catches up
    lat = RequestView("L", Kind.LATENCY, 0.0, 10, 0, 100, False, ttft=1.0, tbt=0.1)
    pol = gmax()
    pol.schedule([lat], ctx(now=2.0, b=1, v=0.05))
    # token j at 2 + 0.05 j, due at 1 + 0.1 (j-1): on time iff j >= 22 -> tokens 22..100 = 79
    assert pol.last_estimates.goodput[0] == 79.0


def test_on_time_tokens_matches_brute_force():
    rng = np.random.default_rng(3)
    for _ in range(200):
        now, v = rng.uniform(0, 20), rng.uniform(0.005, 0.3)
        pre, g, L = rng.uniform(0, 2), int(rng.integers(0, 50)), int(rng.integers(1, 200))
        arr, ttft, tbt = rng.uniform(0, now), rng.uniform(0.1, 5), rng.uniform(0.01, 0.3)
        brute = sum(
            1 for j in range(g + 1, g + L + 1) if now + pre + (j - g) * v <= arr + ttft + (j - 1) * tbt + 1e-12
        )
        got = on_time_tokens(now, np.array([pre]), v, np.array([float(g)]), np.array([float(L)]),
                            np.array([arr]), np.array([ttft]), np.array([tbt]))[0]
        assert got == brute


def test_delta_boost_eventually_schedules_starving_best_effort():
    v, delta_steps, delta = 0.01, 10, 0.05
    frame_s = v * delta_steps
    # S: best effort whose default deadline (0.5 s after arrival) has passed -> goodput 0, R = 200, t_gen = 1 s
    s = RequestView("S", Kind.BEST_EFFORT, 0.0, 100, 0, 100, False)

    def run(starvation_delta: float, frames: int) -> int | None:
        pol = gmax(delta_steps=delta_steps, starvation_delta=starvation_delta, best_effort_deadline=0.5)
        for k in range(frames):
            now = 1.0 + k * frame_s
            fresh = dl(f"C{k}", 100, 100, deadline=now + 100.0, arrival=now)  # priority 200 every frame
            if "S" in pol.schedule([s, fresh], ctx(now=now, b=1, v=v)).batch:
                return k
        return None

    # S's priority is δ·w·R/t_gen = 0.05 · (now/0.1) · 200 / 1 = 100·now; it passes 200 at now = 2 s
    k_expected = (2.0 - 1.0) / frame_s
    k = run(delta, 200)
    assert k is not None and abs(k - k_expected) <= 1.5
    assert run(0.0, 200) is None


def test_compound_stage_members_share_one_priority_and_finish_with_slowest():
    def call(rid, out, stage=0, task="T", **kw):
        return RequestView(rid, Kind.COMPOUND, 0.0, 100, 0, out, False, deadline=30.0, sub_deadline=15.0,
                           task_id=task, stage_index=stage, **kw)

    members = [call("a", 50), call("b", 300), call("c", 1200)]
    other_stage = call("d", 50, stage=1)
    other_task = call("e", 50, task="U")
    pol = gmax(full_priorities=True)
    d = pol.schedule([*members, other_stage, other_task], ctx(now=1.0, b=5, v=0.01))
    pr = d.priorities
    assert pr["a"] == pr["b"] == pr["c"]
    assert pr["d"] != pr["a"] and pr["e"] != pr["a"]
    # aggregate bandwidth: goodput of the group (its tokens) over the summed generation time
    group_tokens = 3 * 100 + 50 + 300 + 1200
    assert pr["a"] == pytest.approx(group_tokens / ((50 + 300 + 1200) * 0.01), rel=1e-4)
    # slowest member (1200 tokens = 12 s) decides feasibility: with 10 s left the whole stage is demoted
    pol2 = gmax()
    pol2.schedule(members, ctx(now=20.0, b=3, v=0.01))
    assert not pol2.last_estimates.feasible.any()
    pol3 = gmax()
    pol3.schedule(members[:2], ctx(now=20.0, b=3, v=0.01))  # without the straggler the stage fits
    assert pol3.last_estimates.feasible.all()


def test_a_stage_that_has_begun_is_priced_by_its_slowest_member():
    """``compound_priority="commit"``: a stage group is priced on its members' summed
    generation time until one of them runs, then on its slowest member's, so the rest of a begun stage
    outranks a fresh stage of the same work; "aggregate" keeps the sum either way."""
    def call(rid, out, task, running=False, generated=0):
        return RequestView(rid, Kind.COMPOUND, 0.0, 100, generated, out, running, deadline=30.0, sub_deadline=15.0,
                           task_id=task, stage_index=1, kv_tokens=100 + generated if running else 0)

    begun = [call("a", 50, "T", running=True, generated=10), call("b", 300, "T"), call("c", 1200, "T")]
    fresh = [call("x", 50, "U"), call("y", 300, "U"), call("z", 1200, "U")]
    tokens = 3 * 100 + 50 + 300 + 1200
    for priority, begun_s in (("commit", 1200 * 0.01), ("aggregate", (40 + 300 + 1200) * 0.01)):
        pr = gmax(full_priorities=True, compound_priority=priority).schedule(
            begun + fresh, ctx(now=1.0, b=6, v=0.01)).priorities
        assert pr["a"] == pr["b"] == pr["c"] and pr["x"] == pr["y"] == pr["z"]
        assert pr["b"] == pytest.approx(tokens / begun_s, rel=1e-4), priority
        assert pr["x"] == pytest.approx(tokens / ((50 + 300 + 1200) * 0.01), rel=1e-4), priority
    with pytest.raises(ValueError, match="compound_priority"):
        gmax(compound_priority="fastest")


def test_a_begun_stages_call_about_to_be_rejected_is_priced_on_its_own_time():
    """``compound_admit="member"``: a waiting call of a stage group whose sibling has started, that
    admission control rejects before the next decision, is priced on its own generation time (the
    group's tokens over its own time, so it gets a slot); a call with time left, or of a stage no member
    of which has started, keeps the group's price; "group" prices every member alike."""
    def call(rid, out, task, running=False, generated=0, admit_by=None):
        return RequestView(rid, Kind.COMPOUND, 0.0, 100, generated, out, running, deadline=300.0,
                           sub_deadline=150.0, task_id=task, stage_index=1, admit_by=admit_by,
                           kv_tokens=100 + generated if running else 0)

    begun = [call("a", 50, "T", running=True, generated=10), call("b", 300, "T", admit_by=1.2),
             call("c", 1200, "T", admit_by=9.0)]
    fresh = [call("x", 300, "U", admit_by=1.2), call("y", 1200, "U", admit_by=1.2)]
    tokens_t = 3 * 100 + 50 + 300 + 1200
    group_s = (40 + 300 + 1200) * 0.01
    c = ctx(now=1.0, b=5, v=0.01)  # horizon: 2 frames of Δ·v = 0.5 s
    kw = dict(adapt_p=False, starvation_delta=0.0, request_weight=0.0, full_priorities=True, bound_share=1.0)
    at_risk = 1.01  # never started: marginal = all its goodput, plus jit_fill (0.01) × goodput
    member = make_policy("gmax", **kw).schedule(begun + fresh, c).priorities  # the default
    group = make_policy("gmax", compound_admit="group", **kw).schedule(begun + fresh, c).priorities
    assert member["b"] == pytest.approx(at_risk * tokens_t / (300 * 0.01), rel=1e-4)  # rejected by 1.2 s
    assert group["b"] == pytest.approx(at_risk * tokens_t / group_s, rel=1e-4)
    for rid in ("a", "c", "x", "y"):  # running, 8 s left, or a stage that has not begun: the group's price
        assert member[rid] == pytest.approx(group[rid], rel=1e-9), rid
    with pytest.raises(ValueError, match="compound_admit"):
        gmax(compound_admit="task")


def test_compound_sub_deadline_feasibility_mode():
    calls = [RequestView(f"s{i}", Kind.COMPOUND, 0.0, 10, 0, 100, False, deadline=60.0, sub_deadline=5.0,
                         task_id="T", stage_index=1) for i in range(2)]
    lenient, strict = gmax(), gmax(compound_feasibility="stage")
    lenient.schedule(calls, ctx(now=10.0, b=2))  # sub-deadline passed, task deadline still reachable
    strict.schedule(calls, ctx(now=10.0, b=2))
    assert lenient.last_estimates.feasible.all()
    assert not strict.last_estimates.feasible.any()


def test_oracle_uses_true_lengths():
    a = dl("short", 100, 500, true_len=50)
    b = dl("long", 100, 500, true_len=500)
    d_gmax = gmax(full_priorities=True).schedule([a, b], ctx(b=1))
    assert d_gmax.priorities["short"] == d_gmax.priorities["long"]
    d_oracle = make_policy("oracle", adapt_p=False, starvation_delta=0.0).schedule([b, a], ctx(b=1))
    assert d_oracle.batch == ["short"]


def test_gmax_jit_prefers_the_request_about_to_miss():
    # U: low density but only 0.3 s of slack (< one 0.5 s frame); R: high density, plenty of slack
    u = dl("U", 10, 100, deadline=2.3)  # t_gen 1 s, now 1 -> laxity 0.3 s
    r = dl("R", 3000, 100, deadline=500.0)
    assert make_policy("gmax-paper", adapt_p=False, starvation_delta=0.0).schedule([u, r], ctx(now=1.0, b=1)).batch == ["R"]
    assert make_policy("gmax", adapt_p=False, starvation_delta=0.0).schedule([u, r], ctx(now=1.0, b=1)).batch == ["U"]
    # with more slack than the horizon (2 frames of 0.5 s) U can wait: the dense request runs first
    u_lax = dl("U", 10, 100, deadline=4.0)
    assert make_policy("gmax", adapt_p=False, starvation_delta=0.0).schedule([u_lax, r], ctx(now=1.0, b=1)).batch == ["R"]


def test_gmax_jit_admits_a_request_before_admission_control_rejects_it():
    # A: low density, lots of slack, but never scheduled and rejected at admit_by (JITServe §5)
    r = dl("R", 3000, 100, deadline=500.0)
    pol = make_policy("gmax", adapt_p=False, starvation_delta=0.0, admit_horizon=1.0)
    far = dl("A", 10, 100, deadline=500.0, admit_by=5.0)
    assert pol.schedule([far, r], ctx(now=1.0, b=1)).batch == ["R"]  # 4 s left > horizon: A can wait
    near = dl("A2", 10, 100, deadline=500.0, admit_by=1.3)
    assert pol.schedule([near, r], ctx(now=1.0, b=1)).batch == ["A2"]  # rejected before the next decision
    # the default horizon is unbounded: admission is irreversible, so waiting requests are admitted early
    assert make_policy("gmax", adapt_p=False, starvation_delta=0.0).schedule([far, r], ctx(now=1.0, b=1)).batch == ["A"]
    # a running request's admit_by is ignored (it was admitted)
    run = RequestView("A3", Kind.DEADLINE, 0.0, 10, 5, 100, True, kv_tokens=15, deadline=500.0, admit_by=1.3)
    # (jit_commit off: a started deadline request is otherwise urgent for its own reason)
    d = make_policy("gmax", adapt_p=False, starvation_delta=0.0, full_priorities=True,
                    jit_commit=False).schedule([run, r], ctx(now=1.0, b=1))
    assert d.priorities["A3"] < d.priorities["R"]


def test_gmax_jit_horizon_follows_the_gaps_between_frames():
    pol = make_policy("gmax", adapt_p=False, starvation_delta=0.0)
    c = ctx(now=1.0, b=1)  # Δ·v = 0.5 s
    assert pol.horizon_s(c) == 2 * 0.5  # no frame seen yet: jit_horizon frames
    views = [dl("R", 10, 10, deadline=500.0)]
    for k in range(5):  # frames every 0.1 s (arrivals/finishes recompute them before Δ steps pass)
        pol.schedule(views, ctx(now=1.0 + 0.1 * k, b=1))
    assert abs(pol.horizon_s(c) - 2 * 0.1) < 1e-9
    # a request with 0.5 s of laxity is urgent under a whole-frame horizon, not under the measured one
    u = dl("U", 10, 100, deadline=3.0)  # t_gen 1 s at now 1.5 -> laxity 0.5 s
    dense = dl("D", 3000, 100, deadline=500.0)
    assert pol.schedule([u, dense], ctx(now=1.5, b=1)).batch == ["D"]
    fresh = make_policy("gmax", adapt_p=False, starvation_delta=0.0)
    assert fresh.schedule([u, dense], ctx(now=1.5, b=1)).batch == ["U"]


def test_fairness_blend_prefers_least_attained_when_f_is_one():
    rich = dl("rich", 3000, 100, attained_service=5000.0)
    poor = dl("poor", 10, 100, attained_service=10.0)
    assert gmax().schedule([rich, poor], ctx(b=1)).batch == ["rich"]
    assert gmax(fairness=1.0).schedule([rich, poor], ctx(b=1)).batch == ["poor"]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_batch_never_exceeds_b_and_decision_is_consistent(name):
    rng = random.Random(11)
    for trial in range(6):
        n, b = rng.randint(0, 400), rng.randint(1, 40)
        views = synthetic_views(n, batch_size=min(b + 5, n), seed=trial)
        pol = make_policy(name)
        for step in range(3):
            c = SchedContext(now=1000.0 + step, batch_size=b, token_time=0.02, prefill_rate=3000.0,
                             kv_capacity_tokens=rng.choice([None, 10**6, 5000]))
            d = pol.schedule(views, c)
            ids = {v.req_id for v in views}
            running = {v.req_id for v in views if v.running}
            # full, less the waiting requests GMAX leaves out for lack of KV (GMAXParams.kv_fit)
            assert len(d.batch) == min(n, b) - d.info.get("kv_left", 0)
            assert len(set(d.batch)) == len(d.batch) and set(d.batch) <= ids
            assert set(d.preempt) <= running and not set(d.preempt) & set(d.batch)
            assert set(d.batch) <= set(d.priorities)


def test_needs_recompute_frames_of_delta_steps():
    pol = gmax(delta_steps=50)
    assert pol.needs_recompute(0, False)
    assert not pol.needs_recompute(10, False)
    assert not pol.needs_recompute(49, False)
    assert pol.needs_recompute(50, False)
    assert pol.needs_recompute(60, True)  # an arrival starts a new frame
    assert not pol.needs_recompute(100, False)
    assert pol.needs_recompute(110, False)


def test_bad_input_raises_typed_errors():
    pol = gmax()
    with pytest.raises(SchedulingInputError, match="no deadline"):
        pol.schedule([RequestView("x", Kind.DEADLINE, 0.0, 1, 0, 1, False)], ctx())
    with pytest.raises(SchedulingInputError, match="duplicate"):
        pol.schedule([dl("x", 1, 1), dl("x", 1, 1)], ctx())
    with pytest.raises(SchedulingInputError, match="batch_size"):
        pol.schedule([dl("y", 1, 1)], ctx(b=0))
    with pytest.raises(SchedulingInputError, match="generated"):
        pol.schedule([RequestView("z", Kind.DEADLINE, 0.0, 1, -1, 1, False, deadline=9.0)], ctx())
    with pytest.raises(SchedulingInputError, match="kind"):
        pol.schedule([RequestView("k", "urgent", 0.0, 1, 0, 1, False)], ctx())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cutoff p"):
        GMAXPolicy(p=1.5)
    with pytest.raises(ValueError, match="unknown GMAX parameter"):
        GMAXPolicy(bogus=1)


def test_snapshot_cache_with_churn_matches_fresh_computation():
    """The per-id cache (static columns, compaction, group renumbering) must not change any decision."""
    pool = synthetic_views(3000, batch_size=0, seed=5)
    cached = gmax(full_priorities=True)
    k, n = 40, 600
    for frame in range(40):  # 40·40 = 1600 departures: several compactions of the cache
        views = pool[frame * k : frame * k + n]
        c = SchedContext(now=1000.0 + frame, batch_size=16, token_time=0.02, prefill_rate=3000.0)
        got = cached.schedule(views, c)
        ref = gmax(full_priorities=True).schedule(views, c)
        assert got.batch == ref.batch
        assert got.priorities == pytest.approx(ref.priorities)
    assert cached._cache._size <= 2 * n + 1024 + k


def test_served_times_survive_cache_compaction():
    from jitflow_server.scheduler.snapshot import SnapshotCache

    cache = SnapshotCache()
    keep = [dl(f"k{i}", 10, 10) for i in range(5)]
    snap = cache.build(keep)
    cache.served[snap.rows] = [1.0, 2.0, 3.0, 4.0, 5.0]
    for frame in range(30):  # 30·100 transient requests force compactions
        snap = cache.build(keep + [dl(f"t{frame}_{j}", 10, 10) for j in range(100)])
    assert cache._size < 30 * 100
    assert list(cache.served[snap.rows[:5]]) == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_invalidate_rereads_static_fields():
    pol = gmax()
    a = dl("a", 10, 100, deadline=1000.0)
    b = dl("b", 10, 100, deadline=1000.0)
    pol.schedule([a, b], ctx(b=1))
    a.deadline = 1.5  # the engine tightens a's SLO: t_gen 1 s no longer fits from now = 1
    pol.invalidate("a")
    pol.schedule([a, b], ctx(now=1.0, b=1))
    assert list(pol.last_estimates.feasible) == [False, True]


def test_request_weight_values_meeting_a_request_not_only_its_tokens():
    """A chat reply (latency: goodput = its output tokens) against a deadline request of the same size
    (goodput = input + output): the token objective ranks the deadline request 6× higher; with
    request_weight each request is also worth w × the mean call's base goodput, once."""
    chat = RequestView("chat", Kind.LATENCY, 1.0, 1000, 0, 200, False, ttft=2.0, tbt=0.1)
    batch = dl("batch", 1000, 200, deadline=100.0, arrival=1.0)
    c = ctx(now=1.0, b=1)
    tokens = gmax(full_priorities=True).schedule([chat, batch], c).priorities
    assert tokens["batch"] / tokens["chat"] == pytest.approx(1200 / 200, rel=1e-3)
    both = gmax(full_priorities=True, request_weight=1.0).schedule([chat, batch], c).priorities
    unit = (1200 + 1200) / 2  # mean base goodput R of the two calls
    assert both["batch"] / both["chat"] == pytest.approx((1200 + unit) / (200 + unit), rel=1e-3)
    # a compound stage group gets the value once, not once per member
    members = [RequestView(f"m{i}", Kind.COMPOUND, 1.0, 100, 0, 50, False, deadline=1000.0, task_id="T",
                           stage_index=0, task_tokens_est=600) for i in range(3)]
    pol = gmax(request_weight=2.0, compound_value="task")
    pol.schedule(members, ctx(now=1.0, b=3))
    assert list(pol.last_estimates.goodput) == [600 + 2.0 * 150] * 3
    # a latency request that can no longer have every token on time gets no request value
    late = RequestView("late", Kind.LATENCY, 0.0, 10, 0, 50, False, ttft=0.5, tbt=0.1)
    pol = gmax(request_weight=1.0)
    pol.schedule([late], ctx(now=1.0, b=1))
    assert 0 < pol.last_estimates.goodput[0] < 50


def test_future_margin_makes_a_later_stage_urgent_earlier():
    """The analyzer's estimate of a task's later stages (task_rem_gen_time) is scaled by future_margin in
    the laxity: with margin 2 a stage whose task has 40 s of slack for 30 s of later work is infeasible."""
    def stage(rem: float) -> RequestView:
        return RequestView("s", Kind.COMPOUND, 0.0, 100, 0, 100, False, deadline=41.0, task_id="T",
                           stage_index=1, task_rem_gen_time=rem)

    for margin, feasible in ((1.0, True), (2.0, False)):
        pol = gmax(future_margin=margin, soft_feasibility=0.0)
        pol.schedule([stage(30.0)], ctx(now=0.0, b=1))
        assert bool(pol.last_estimates.feasible[0]) is feasible
    for bad in (0.5, math.inf):
        with pytest.raises(ValueError, match="future_margin"):
            GMAXPolicy(future_margin=bad)
    with pytest.raises(ValueError, match="request_weight"):
        GMAXPolicy(request_weight=-1.0)


def test_soft_feasibility_keeps_a_share_of_the_value_of_a_stage_the_margin_gives_up_on():
    """A stage that can finish in time with the analyzer's estimate of its task's later stages but not with
    future_margin times it keeps soft_feasibility of its value, and ranks as urgent (just in time: no slack
    is left under the margin); a stage that cannot finish even with the estimate as is keeps nothing."""
    def stage(rid: str, rem: float) -> RequestView:  # 100 tokens at 0.01 s: 1 s of generation, 41 s left
        return RequestView(rid, Kind.COMPOUND, 0.0, 100, 0, 100, False, deadline=41.0, task_id=f"T{rid}",
                           stage_index=1, task_rem_gen_time=rem, task_tokens_est=1000)

    def run(rem: float, **kw):
        pol = GMAXPolicy(future_margin=2.0, request_weight=0.0, adapt_p=False, starvation_delta=0.0, **kw)
        pol.schedule([stage("s", rem)], ctx(now=0.0, b=1))
        return pol.last_estimates

    sure, doubtful, lost = (run(rem, soft_feasibility=0.25) for rem in (10.0, 30.0, 45.0))
    assert sure.feasible[0] and sure.goodput[0] == pytest.approx(1000)  # 41 − 2·10 ≥ 1 s
    assert doubtful.feasible[0] and doubtful.goodput[0] == pytest.approx(250)  # 41 − 2·30 < 1 s ≤ 41 − 30
    assert doubtful.marginal[0] == pytest.approx(250)  # deferring it loses that share: urgent
    assert not lost.feasible[0] and lost.goodput[0] == 0.0  # 41 − 45 < 1 s
    off = run(30.0, soft_feasibility=0.0)  # the rule before: infeasible under the margin is infeasible
    assert not off.feasible[0] and off.goodput[0] == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="soft_feasibility"):
            GMAXPolicy(soft_feasibility=bad)


def test_deadline_soft_share_keeps_a_share_of_the_value_of_a_request_feasible_only_if_its_answer_is_short():
    """A deadline request bounded at 1 000 tokens, none generated, at 0.01 s a token: planned with 0.7 of
    the bound it needs 7 s. With 7.5 s left it is feasible at its whole value; with 5 s left only an answer
    of at most 0.5 of the bound would finish, so it keeps soft_feasibility of its value and ranks as urgent
    (deferring it loses that share); with 3 s left even 0.35 of the bound (3.5 s) is too late: nothing."""
    def run(deadline: float, **kw):
        pol = GMAXPolicy(request_weight=0.0, adapt_p=False, starvation_delta=0.0, bound_share=0.7,
                         soft_feasibility=0.25, **kw)
        pol.schedule([dl("d", 100, 1000, deadline=deadline)], ctx(now=0.0, b=1))
        return pol.last_estimates

    sure, doubtful, lost = (run(d, deadline_soft_share=0.5) for d in (7.5, 5.0, 3.0))
    assert sure.feasible[0] and sure.goodput[0] == pytest.approx(100 + 700)
    assert doubtful.feasible[0] and doubtful.goodput[0] == pytest.approx(0.25 * 800)
    assert doubtful.marginal[0] == pytest.approx(0.25 * 800)
    assert not lost.feasible[0] and lost.goodput[0] == 0.0
    off = run(5.0, deadline_soft_share=0.0)  # the rule before: infeasible by the planned share
    assert not off.feasible[0] and off.goodput[0] == 0.0
    assert make_policy("gmax-paper").params.deadline_soft_share == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="deadline_soft_share"):
            GMAXPolicy(deadline_soft_share=bad)


def test_compound_value_prices_a_stage_group_by_the_task_or_by_its_own_calls():
    members = [RequestView(f"m{i}", Kind.COMPOUND, 1.0, 100, 0, 50, False, deadline=1000.0, task_id="T",
                           stage_index=0, task_tokens_est=6000) for i in range(2)]
    for value, expected in (("task", 6000.0), ("stage", 2 * (100 + 50))):
        pol = gmax(compound_value=value)
        pol.schedule(members, ctx(now=1.0, b=2))
        assert list(pol.last_estimates.goodput) == [expected] * 2
    with pytest.raises(ValueError, match="compound_value"):
        GMAXPolicy(compound_value="job")


def test_jit_pacing_stage_makes_a_stage_urgent_at_its_sub_deadline():
    """A stage with a near sub-deadline but a large task slack (the analyzer's estimate of the later
    stages is small): "task" pacing lets it wait behind a dense request, "stage" pacing runs it first."""
    stage = RequestView("st", Kind.COMPOUND, 0.0, 10, 0, 100, False, deadline=500.0, sub_deadline=2.3,
                        task_id="T", stage_index=0, task_rem_gen_time=1.0)  # t_gen 1 s at v = 0.01
    dense = dl("R", 3000, 100, deadline=500.0)
    pick = {mode: make_policy("gmax", adapt_p=False, starvation_delta=0.0, jit_pacing=mode)
            .schedule([stage, dense], ctx(now=1.0, b=1)).batch for mode in ("task", "stage")}
    assert pick == {"task": ["R"], "stage": ["st"]}
    with pytest.raises(ValueError, match="jit_pacing"):
        gmax(jit_pacing="soon")


def test_gmax_jit_commit_keeps_a_started_deadline_request_running():
    # S started (50 of 100 tokens) with plenty of slack; N just arrived and is urgent until admitted
    s = RequestView("S", Kind.DEADLINE, 0.0, 10, 50, 100, True, kv_tokens=60, deadline=500.0)
    n = dl("N", 10, 100, deadline=500.0, arrival=0.9, admit_by=5.0)
    c = ctx(now=1.0, b=1, kv_capacity_tokens=10_000)  # the KV fits: S would only be paused
    assert make_policy("gmax", adapt_p=False, starvation_delta=0.0, jit_commit=False).schedule([s, n], c).batch == ["N"]
    committed = make_policy("gmax", adapt_p=False, starvation_delta=0.0, jit_commit=True)
    assert committed.schedule([s, n], c).batch == ["S"]
    # a started request that can no longer finish is not held on to
    late = RequestView("L", Kind.DEADLINE, 0.0, 10, 50, 100, True, kv_tokens=60, deadline=1.1)
    assert committed.schedule([late, n], c).batch == ["N"]


def test_jit_slack_makes_a_stage_urgent_while_a_slower_engine_could_still_meet_it():
    """Stage st needs 1 s at the measured speed and has 1.6 s to its sub-deadline (one frame of look-ahead:
    0.5 s): exact pacing lets it wait behind a denser request; with 30 % slack (1.3 s of work) it runs now."""
    stage = RequestView("st", Kind.COMPOUND, 0.0, 10, 0, 100, False, deadline=500.0, sub_deadline=2.6,
                        task_id="T", stage_index=0, task_rem_gen_time=1.0)  # t_gen 1 s at v = 0.01
    dense = dl("R", 3000, 100, deadline=500.0)

    def pick(slack: float) -> list[str]:
        pol = make_policy("gmax", adapt_p=False, starvation_delta=0.0, jit_slack=slack, jit_horizon=1.0,
                          delta_steps=50, bound_share=1.0)  # horizon: 50 steps of 0.01 s
        return pol.schedule([stage, dense], ctx(now=1.0, b=1)).batch

    assert pick(0.0) == ["R"]
    assert pick(0.3) == ["st"]
    with pytest.raises(ValueError, match="jit_slack"):
        gmax(jit_slack=-0.1)


def test_bound_share_plans_with_a_share_of_the_remaining_bound():
    """A deadline request bounded at 1 000 tokens, 300 of them generated, 6 s left at 0.01 s a token:
    planned with the whole bound (7 s) it cannot finish and is worth nothing; with half of what the bound
    leaves (3.5 s) it can. A request whose true length is known (the oracle) plans with that length."""
    req = RequestView("d", Kind.DEADLINE, 0.0, 100, 300, 1000, True, deadline=7.0, kv_tokens=400)
    whole = gmax()
    whole.schedule([req], ctx(now=1.0, b=1))
    assert whole.last_estimates.len_rem[0] == pytest.approx(700)
    assert not whole.last_estimates.feasible[0] and whole.last_estimates.goodput[0] == 0.0
    half = gmax(bound_share=0.5)
    half.schedule([req], ctx(now=1.0, b=1))
    assert half.last_estimates.len_rem[0] == pytest.approx(350)
    # worth its input and the output it is planned at (300 generated + 350)
    assert half.last_estimates.feasible[0] and half.last_estimates.goodput[0] == pytest.approx(750)
    known = RequestView("k", Kind.DEADLINE, 0.0, 100, 300, 1000, True, deadline=7.0, kv_tokens=400, true_len=900)
    oracle = gmax(bound_share=0.5, use_true_len=True)
    oracle.schedule([known], ctx(now=1.0, b=1))
    assert oracle.last_estimates.len_rem[0] == pytest.approx(600)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="bound_share"):
            GMAXPolicy(bound_share=bad)
