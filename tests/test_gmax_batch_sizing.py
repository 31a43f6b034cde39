"""GMAX's batch sizing. The default fills B slots (JITServe Alg. 1); with ``batch_sizing="goodput"``, on an
engine whose step time grows with the batch, the frame runs the number of requests that earns the most
goodput per second, not always B."""

from __future__ import annotations

import pytest

from jitflow_server.scheduler import Kind, RequestView, SchedContext, TokenTimeModel, make_policy
from jitflow_server.tracker.steps import StepTimeTracker

#: 0.02 s + 0.01 s per decoding request: 0.10 s per token at B = 8, 0.07 s at 5.
CPU_LIKE = TokenTimeModel(base_s=0.02, per_request_s=0.01)


def ctx(model: TokenTimeModel | None, b: int = 8) -> SchedContext:
    v = model.token_time(b) if model else 0.05
    return SchedContext(now=100.0, batch_size=b, token_time=v, prefill_rate=1e12, token_time_model=model)


def deadline_requests(n: int, deadline_s: float, out: int = 100) -> list[RequestView]:
    """``n`` waiting deadline requests of ``out`` tokens due ``deadline_s`` after now (t = 100 s)."""
    return [RequestView(f"d{i}", Kind.DEADLINE, 100.0, 50, 0, out, False, deadline=100.0 + deadline_s)
            for i in range(n)]


def test_a_full_batch_that_breaks_every_deadline_is_shrunk_to_the_size_that_meets_them():
    # 12 requests for 8 slots, 100 tokens each by 7.5 s: at 8 (0.10 s/token) and 6 (0.08) every request is
    # late; at 5 (0.07) it is on time.
    views = deadline_requests(12, 7.5)
    sized = make_policy("gmax", batch_sizing="goodput", bound_share=1.0)  # the bounds are the lengths
    d = sized.schedule(views, ctx(CPU_LIKE))
    assert d.info["batch_size"] == 5
    assert len(d.batch) == 5


def test_with_no_more_requests_than_slots_every_request_runs():
    # the same 100-token requests, 8 of them for 8 slots: the batch is not shrunk below N at moderate load
    d = make_policy("gmax", batch_sizing="goodput").schedule(deadline_requests(8, 7.5), ctx(CPU_LIKE))
    assert len(d.batch) == 8


def test_the_default_the_paper_variant_and_batch_sizing_full_always_fill_b():
    views = deadline_requests(12, 7.5)  # the case the goodput sizing shrinks to 5 (first test)
    assert len(make_policy("gmax").schedule(views, ctx(CPU_LIKE)).batch) == 8
    assert len(make_policy("gmax-paper").schedule(views, ctx(CPU_LIKE)).batch) == 8
    assert len(make_policy("gmax", batch_sizing="full").schedule(views, ctx(CPU_LIKE)).batch) == 8


def test_throughput_wins_when_every_request_is_on_time_at_full_batch():
    views = deadline_requests(12, 60.0)  # 10 s of work at B = 8: every deadline holds
    d = make_policy("gmax", batch_sizing="goodput").schedule(views, ctx(CPU_LIKE))
    assert d.info["batch_size"] == 8 and len(d.batch) == 8


def test_without_a_token_time_model_or_with_a_flat_one_the_batch_is_b():
    views = deadline_requests(12, 7.5)
    assert len(make_policy("gmax", batch_sizing="goodput").schedule(views, ctx(None)).batch) == 8
    flat = TokenTimeModel(base_s=0.05, per_request_s=0.0)
    assert len(make_policy("gmax", batch_sizing="goodput").schedule(views, ctx(flat)).batch) == 8


def test_chat_tbt_slos_shrink_the_batch_only_as_far_as_they_need():
    # TBT SLO 0.075 s: on time at up to 5 requests (0.07 s), late beyond; 12 chat requests waiting.
    views = [RequestView(f"c{i}", Kind.LATENCY, 100.0, 50, 0, 100, False, ttft=0.5, tbt=0.075) for i in range(12)]
    sized = make_policy("gmax", batch_sizing="goodput", bound_share=1.0)  # the bounds are the lengths
    d = sized.schedule(views, ctx(CPU_LIKE))
    assert d.info["batch_size"] == 5


def chat_requests(n: int, tbt: float = 0.075) -> list[RequestView]:
    """``n`` waiting chat requests of 100 tokens with a TBT SLO of ``tbt`` s (t = 100 s)."""
    return [RequestView(f"c{i}", Kind.LATENCY, 100.0, 50, 0, 100, False, ttft=0.5, tbt=tbt) for i in range(n)]


def test_slo_sizing_shrinks_below_n_only_when_all_n_would_break_a_tbt_slo():
    # 7 chat requests for 8 slots: all 7 together take 0.09 s per token, past the 0.075 s SLO; 5 keep it
    views = chat_requests(7)
    slo = make_policy("gmax", batch_sizing="slo", bound_share=1.0)
    d = slo.schedule(views, ctx(CPU_LIKE))
    assert d.info["batch_size"] == 5 and len(d.batch) == 5
    # "goodput" runs every request while N <= B
    sized = make_policy("gmax", batch_sizing="goodput", bound_share=1.0)
    assert len(sized.schedule(views, ctx(CPU_LIKE)).batch) == 7
    # with a TBT SLO that all 7 keep (0.09 s <= 0.1 s), "slo" runs every request too
    loose = make_policy("gmax", batch_sizing="slo", bound_share=1.0).schedule(chat_requests(7, 0.1), ctx(CPU_LIKE))
    assert len(loose.batch) == 7 and loose.info["batch_size"] == 8
    # deadline requests alone never trigger it, however late the whole batch makes them
    dl = make_policy("gmax", batch_sizing="slo", bound_share=1.0).schedule(deadline_requests(8, 7.5), ctx(CPU_LIKE))
    assert len(dl.batch) == 8


def test_latency_slo_broken_reads_the_smallest_tbt_of_the_latency_requests():
    from jitflow_server.scheduler.gmax import latency_slo_broken
    from jitflow_server.scheduler.snapshot import build_snapshot

    tight = RequestView("tight", Kind.LATENCY, 100.0, 50, 0, 100, False, ttft=0.5, tbt=0.05)
    mixed = [*chat_requests(2, 0.2), tight, *deadline_requests(2, 7.5)]
    assert latency_slo_broken(build_snapshot(mixed), CPU_LIKE)  # 5 requests: 0.07 s > 0.05 s
    assert not latency_slo_broken(build_snapshot(mixed[:2] + mixed[3:]), CPU_LIKE)  # 0.06 s <= 0.2 s
    assert not latency_slo_broken(build_snapshot(deadline_requests(8, 1.0)), CPU_LIKE)  # no latency request


def test_invalid_batch_sizing_parameters_are_refused():
    with pytest.raises(ValueError, match="batch_sizing"):
        make_policy("gmax", batch_sizing="half")
    with pytest.raises(ValueError, match="batch_margin"):
        make_policy("gmax", batch_margin=-1.0)


def test_the_tracker_gives_its_token_time_as_a_line_in_the_batch_size():
    tr = StepTimeTracker()
    assert tr.token_time_model() is None  # nothing measured yet
    for n in (1, 4, 8, 16, 32, 2, 24, 12):
        tr.record(0.01 + 0.002 * n, n, 0, period=0.012 + 0.0024 * n)
    model = tr.token_time_model()
    assert model is not None and model.per_request_s > 0
    for k in (1, 8, 32):
        assert model.token_time(k) == pytest.approx(tr.token_time(k), rel=1e-6)


@pytest.mark.parametrize("params", [{}, {"jit": False}, {"fairness": 0.3}, {"compound_priority": "aggregate"}])
def test_scoring_every_size_at_once_equals_scoring_each_size_alone(params):
    """The sizes are scored in one vectorised pass (``score_speeds``): each row must be exactly what
    ``score`` gives at that size's token time, for every kind (latency, deadline, compound, best effort)."""
    from dataclasses import replace

    import numpy as np

    from jitflow_server.scheduler.snapshot import build_snapshot
    from jitflow_server.scheduler.synthetic import synthetic_views

    views = synthetic_views(400, batch_size=32, seed=3)
    for i, v in enumerate(views):  # a third not yet admitted, some about to be refused by admission control
        if not v.running and i % 3 == 0:
            v.admit_by = 1000.0 + (i % 7) * 0.5
    pol = make_policy("gmax", **params)
    pol._gaps.extend([0.3, 0.05])  # a measured frame gap shorter than some sizes' frames (the JIT horizon)
    base = SchedContext(now=1000.0, batch_size=32, token_time=0.05, prefill_rate=4000.0, token_time_model=CPU_LIKE)
    snap = build_snapshot(views)
    ctxs = [replace(base, batch_size=k, token_time=CPU_LIKE.token_time(k)) for k in (32, 24, 16, 8)]
    prios, ests = pol.score_speeds(snap, ctxs)
    assert prios.shape == (4, snap.n) and ests.goodput.shape == (4, snap.n)
    for r, c in enumerate(ctxs):
        prio, est = pol.score(snap, c)
        np.testing.assert_array_equal(prios[r], prio)
        row = ests.row(r)
        for field in ("t_gen", "t_rem", "goodput", "base", "feasible", "marginal"):
            np.testing.assert_array_equal(getattr(row, field), getattr(est, field), err_msg=field)
    assert len({float(p.sum()) for p in prios}) == 4  # the speeds do change the priorities


def test_the_chosen_size_is_the_one_a_size_by_size_search_picks():
    import numpy as np

    from jitflow_server.scheduler.gmax import BATCH_FRACTIONS
    from jitflow_server.scheduler.synthetic import synthetic_views

    views = synthetic_views(200, batch_size=32, seed=8)
    pol = make_policy("gmax", batch_sizing="goodput")
    c = SchedContext(now=1000.0, batch_size=32, token_time=CPU_LIKE.token_time(32), prefill_rate=4000.0,
                     token_time_model=CPU_LIKE)
    d = pol.schedule(views, c)
    from dataclasses import replace

    from jitflow_server.scheduler.snapshot import build_snapshot

    snap = build_snapshot(views)
    ref = make_policy("gmax")
    best = None
    for k in sorted({32, *(round(32 * f) for f in BATCH_FRACTIONS)}, reverse=True):
        prio, est = ref.score(snap, replace(c, batch_size=k, token_time=CPU_LIKE.token_time(k)))
        idx = np.argpartition(-prio, k - 1)[:k]
        rate = float((est.goodput[idx] / np.maximum(est.t_gen[idx], 1e-9)).sum())
        if best is None or rate > best[0] * (1.0 + ref.params.batch_margin):
            best = (rate, k)
    assert d.info["batch_size"] == best[1]
