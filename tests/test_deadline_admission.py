"""Deadline admission (``scheduler/admission.py``): an E2EL-deadline request is admitted only while its
deadline is still feasible at the engine's measured speed. Unit tests of the rule, then a real HTTP server
on 127.0.0.1 around the ``FakeEngine`` (whose step time is exact) and the real vLLM engine."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import httpx
import pytest

from jitflow_server.api.state import ServerSettings
from jitflow_server.engine.fake import FakeEngine
from jitflow_server.scheduler.admission import Commitment, ServiceRate, admission_deadline, fits_commitments
from jitflow_server.tracker.steps import StepTimeTracker
from test_api_fake_engine import MSG, serve

pytestmark = pytest.mark.usefixtures("env")

RATE = ServiceRate(base_s=0.01, per_decode_s=0.002, per_prefill_token_s=0.0001, wall_factor=1.25,
                   min_step_s=0.0, batch_size=8)


def test_service_time_is_prefill_plus_bound_steps_at_full_batch():
    step = (0.01 + 0.002 * 8) * 1.25  # 0.0325 s
    assert RATE.step_time(8) == pytest.approx(step)
    assert RATE.service_time(1000, 100) == pytest.approx(1000 * 0.0001 + 100 * step)
    alone = (0.01 + 0.002) * 1.25
    assert RATE.service_time(0, 100, batch=1) == pytest.approx(100 * alone)  # the batch it joins
    assert RATE.service_time(0, 100, batch=99) == pytest.approx(100 * step)  # at most B


def test_the_latest_start_uses_the_batch_the_request_joins():
    kw = dict(prompt_tokens=0, len_bound=100, rate=RATE)  # 3.25 s in a full batch, 1.5 s alone
    assert admission_deadline("deadline", 3.0, 5.0, **kw).refuse_now
    light = admission_deadline("deadline", 3.0, 5.0, batch=1, **kw)
    assert not light.refuse_now and light.waiting_time == pytest.approx(1.5)
    # the overcommitment test still prices the request at full-batch throughput: 3.25 slot-s on 8 slots
    full = [Commitment(2.9, 8 * 3.0 - 3.0)]  # 21 + 3.25 slot-s due by 3 s > 24
    assert admission_deadline("deadline", 3.0, 5.0, batch=1, held=full, now=0.0, **kw).reason == "overcommitted"
    room = [Commitment(2.9, 8 * 3.0 - 3.5)]
    assert not admission_deadline("deadline", 3.0, 5.0, batch=1, held=room, now=0.0, **kw).refuse_now


def test_only_deadline_requests_are_tightened():
    kw = dict(prompt_tokens=0, len_bound=100, rate=RATE)  # service 3.25 s
    adm = admission_deadline("deadline", 7.0, 5.0, **kw)
    assert adm.binding == "deadline" and adm.waiting_time == pytest.approx(7 - 3.25)
    assert not adm.refuse_now
    loose = admission_deadline("deadline", 60.0, 5.0, **kw)
    assert loose.binding == "waiting_time" and loose.waiting_time == 5.0
    assert admission_deadline("deadline", 3.0, 5.0, **kw).refuse_now
    for kind in ("latency", "compound", "best_effort"):
        assert admission_deadline(kind, 3.0, 5.0, **kw).waiting_time == 5.0
    assert admission_deadline("deadline", 3.0, 5.0, prompt_tokens=0, len_bound=100, rate=None).waiting_time == 5.0
    safer = admission_deadline("deadline", 10.0, None, safety=2.0, **kw)
    assert safer.waiting_time == pytest.approx(10 - 6.5) and safer.service_time == pytest.approx(6.5)


def test_promises_must_fit_on_b_slots_in_deadline_order():
    held = [Commitment(10.0, 8.0), Commitment(20.0, 8.0)]
    assert fits_commitments(0.0, Commitment(10.0, 2.0), held, batch_size=1)  # 10 s of work due by 10
    assert not fits_commitments(0.0, Commitment(10.0, 2.5), held, batch_size=1)  # the 10 s promise breaks
    assert not fits_commitments(0.0, Commitment(30.0, 15.0), held, batch_size=1)  # 31 s of work by 30 s...
    assert fits_commitments(0.0, Commitment(30.0, 15.0), held, batch_size=2)  # ...fits on two slots
    assert fits_commitments(0.0, Commitment(30.0, 31.0), [], batch_size=8)  # alone: the latest start's job
    assert fits_commitments(0.0, Commitment(15.0, 3.0), held, batch_size=1)
    assert not fits_commitments(0.0, Commitment(15.0, 5.0), held, batch_size=1)  # pushes the 20 s one late
    late = [Commitment(40.0, 45.0)]  # due after the new one and late without it: not held against it
    assert fits_commitments(0.0, Commitment(30.0, 5.0), late, batch_size=1)
    backlog = [Commitment(10.0, 12.0)]  # due before the new one and late: the new one waits behind it
    assert not fits_commitments(0.0, Commitment(30.0, 19.0), backlog, batch_size=1)
    assert fits_commitments(0.0, Commitment(30.0, 18.0), backlog, batch_size=1)
    one_slot = dataclasses.replace(RATE, batch_size=1, wall_factor=1.0)  # 100 tokens: 1.2 s of work
    kw = dict(prompt_tokens=0, len_bound=100, rate=one_slot, now=100.0)
    adm = admission_deadline("deadline", 10.0, 5.0, held=[Commitment(105.0, 4.0), Commitment(109.0, 5.0)], **kw)
    assert adm.refuse_now and adm.reason == "overcommitted"
    ok = admission_deadline("deadline", 10.0, 5.0, held=[Commitment(105.0, 4.0), Commitment(109.0, 4.5)], **kw)
    assert not ok.refuse_now and ok.waiting_time == 5.0


@pytest.mark.parametrize("bad", [None, [], {}, {**RATE.to_dict(), "base_s": float("nan")},
                                 {**RATE.to_dict(), "per_decode_s": -1.0}, {**RATE.to_dict(), "batch_size": 0},
                                 {**RATE.to_dict(), "wall_factor": 0.5},
                                 {**RATE.to_dict(), "base_s": "fast"}, {**RATE.to_dict(), "decode_batch": 0},
                                 {**RATE.to_dict(), "decode_batch": True}, {**RATE.to_dict(), "decode_batch": 2.5},
                                 {**RATE.to_dict(), "lone_step_s": 0.0}, {**RATE.to_dict(), "lone_step_s": float("nan")},
                                 {**RATE.to_dict(), "lone_step_s": "fast"}, {**RATE.to_dict(), "lone_step_s": True}])
def test_a_malformed_rate_is_ignored(bad):
    assert ServiceRate.from_dict(bad) is None
    assert ServiceRate.from_dict(RATE.to_dict()) == RATE


def test_a_rate_without_its_decode_batch_is_read():
    """An engine that does not report ``decode_batch`` still gives deadline admission its rate."""
    d = {k: v for k, v in dataclasses.replace(RATE, decode_batch=6).to_dict().items() if k != "decode_batch"}
    assert ServiceRate.from_dict(d) == RATE and RATE.decode_batch is None
    assert ServiceRate.from_dict({**d, "decode_batch": 6}).decode_batch == 6
    assert ServiceRate.from_dict({**d, "speed": 1.0}) == RATE  # a field a newer engine adds is ignored


def test_the_tracker_reports_the_batch_it_measured_at():
    """``decode_batch`` is the 90th percentile of the decoding requests per step, at most B; steps with
    only prefill do not count."""
    tr = StepTimeTracker()
    for i in range(100):
        n = 2 if i < 85 else 6  # a light engine with a few busier steps
        tr.record(0.02 + 0.005 * n, n, 0)
        tr.record(0.05, 0, 400)
    rate = tr.service_rate(32)
    assert rate is not None and rate.decode_batch == 6
    assert tr.service_rate(4).decode_batch == 4  # never above B


def test_the_tracker_reports_a_rate_only_after_measuring():
    tr = StepTimeTracker()
    assert tr.service_rate(4) is None
    for i in range(40):
        tr.record(0.02 + 0.005 * (i % 4), i % 4, 0)
    rate = tr.service_rate(4)
    assert rate is not None and rate.batch_size == 4 and rate.wall_factor == 1.0  # no wall times recorded
    assert rate.step_time(3) == pytest.approx(0.035, rel=1e-6)


def test_the_wall_factor_scales_the_fit_to_the_time_between_steps():
    tr = StepTimeTracker()
    for i in range(64):  # model execution 0.02 + 0.005·n; the wall time between steps is 1.2× that
        n = 1 + i % 4
        tr.record(0.02 + 0.005 * n, n, 0, period=1.2 * (0.02 + 0.005 * n))
    assert tr.wall_factor() == pytest.approx(1.2)
    assert tr.token_time(4) == pytest.approx(1.2 * 0.04)  # what GMAX uses as v_token
    rate = tr.service_rate(4)
    assert rate is not None and rate.step_time(4) == pytest.approx(1.2 * 0.04)
    tr.record(0.5, 0, 500, period=5.0)  # a pure prefill step (no decode) does not count
    assert tr.wall_factor() == pytest.approx(1.2, rel=0.02)


def test_a_request_alone_is_priced_no_slower_than_the_fastest_measured_step():
    capped = dataclasses.replace(RATE, lone_step_s=0.005)
    assert capped.step_time(1) == pytest.approx(0.005)  # (0.01 + 0.002)·1.25 = 0.015 without the cap
    assert capped.step_time(2) == pytest.approx(RATE.step_time(2))  # only a request alone
    assert capped.step_time(1, 100) == pytest.approx(RATE.step_time(1, 100))  # a step with prefill is not capped
    assert dataclasses.replace(RATE, lone_step_s=1.0).step_time(1) == pytest.approx(RATE.step_time(1))
    assert ServiceRate.from_dict(capped.to_dict()) == capped


def test_a_window_of_prefill_heavy_full_batches_does_not_price_a_lone_request_out():
    """Full batches, every other step with a prefill chunk: the floor (half the median step) times the wall
    factor (which counts the prefill chunks again) priced a request alone at several times any step the
    engine ran, and refused a deadline that a lone request meets easily."""
    tr = StepTimeTracker()
    for i in range(200):
        d = 0.06 if i % 2 else 0.30  # decode-only steps, and steps carrying a 2 000-token prefill chunk
        tr.record(d, 32, 0 if i % 2 else 2000, period=d)
    rate = tr.service_rate(32)
    assert rate is not None and rate.lone_step_s == pytest.approx(0.06)
    uncapped = dataclasses.replace(rate, lone_step_s=None)
    assert uncapped.step_time(1) > 4 * 0.06  # what admission priced it at before the cap
    assert rate.step_time(1) == pytest.approx(0.06)
    kw = dict(prompt_tokens=50, len_bound=192, batch=1)  # 192 tokens, a 20 s deadline
    assert admission_deadline("deadline", 20.0, 5.0, rate=uncapped, **kw).reason == "too_late"
    assert not admission_deadline("deadline", 20.0, 5.0, rate=rate, **kw).refuse_now


def _wait_for_rate(state, timeout: float = 10.0) -> None:
    t0 = time.time()
    while state.service is None:
        assert time.time() - t0 < timeout, "the engine's speed was never read"
        time.sleep(0.02)


def _chat(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG, **body}, timeout=60)


def test_an_infeasible_deadline_is_refused_at_once_and_never_reaches_the_engine():
    eng = FakeEngine(batch_size=1, step_s=0.01)
    with serve(eng) as (url, state):
        _wait_for_rate(state)
        r = _chat(url, max_tokens=200, ignore_eos=True, slo={"kind": "deadline", "deadline": 1.0})
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"], err["type"]) == ("deadline_infeasible", "slo.deadline", "admission_rejected")
        assert int(r.headers["Retry-After"]) >= 2  # about the 2 s the request needs
        assert not eng.requests and state.deadline_rejections == 1 and state.in_flight == 0
        ok = _chat(url, max_tokens=20, ignore_eos=True, slo={"kind": "deadline", "deadline": 1.0})
        assert ok.status_code == 200 and ok.json()["jitflow"]["slo_met"] is True


def test_a_request_that_would_break_earlier_promises_is_refused_at_once():
    eng = FakeEngine(batch_size=1, step_s=0.01)
    with serve(eng) as (url, state):
        _wait_for_rate(state)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futs = []
            for _ in range(3):  # 0.5 s of work each, due in 1.2 s, one slot: room for two
                futs.append(pool.submit(_chat, url, max_tokens=50, ignore_eos=True,
                                        slo={"kind": "deadline", "deadline": 1.2}))
                time.sleep(0.05)
            rs = [f.result() for f in futs]
        assert [r.status_code for r in rs] == [200, 200, 429], [r.text for r in rs]
        assert all(r.json()["jitflow"]["slo_met"] for r in rs[:2])
        err = rs[2].json()["error"]
        assert err["code"] == "deadline_infeasible" and "already admitted" in err["message"]
        assert len(eng.requests) == 2  # the refused one never reached the engine


def _queue_behind_a_long_request(url: str, deadline: float) -> tuple[httpx.Response, float, httpx.Response]:
    """A 3 s best-effort request holds the fake engine's one slot; a deadline request needing 0.5 s arrives
    behind it. Returns (deadline response, its latency s, long response)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(_chat, url, max_tokens=300, ignore_eos=True)
        time.sleep(0.3)
        t0 = time.time()
        r = _chat(url, max_tokens=50, ignore_eos=True, slo={"kind": "deadline", "deadline": deadline})
        return r, time.time() - t0, long.result()


def test_a_queued_deadline_request_is_rejected_at_its_latest_feasible_start():
    eng = FakeEngine(batch_size=1, step_s=0.01)
    with serve(eng) as (url, state):
        _wait_for_rate(state)
        r, waited, long = _queue_behind_a_long_request(url, deadline=2.0)
        assert long.status_code == 200
        assert r.status_code == 429 and r.json()["error"]["code"] == "deadline_infeasible", r.text
        assert 1.2 < waited < 2.2  # latest start = 2 − 50·0.01 s, not the 5 s waiting time
        assert eng.rejected == 1 and state.deadline_rejections == 1
        (late,) = [q for q in eng.requests.values() if q.max_tokens == 50]
        assert late.hints.waiting_time == pytest.approx(1.5, abs=0.05)  # the engine got the tighter deadline


def test_a_feasible_queued_request_is_admitted_and_meets_its_deadline():
    eng = FakeEngine(batch_size=1, step_s=0.01)
    with serve(eng) as (url, _):
        _wait_for_rate(_)
        r, waited, _long = _queue_behind_a_long_request(url, deadline=6.0)
        assert r.status_code == 200 and r.json()["jitflow"]["slo_met"] is True
        assert waited > 2.0  # it did wait behind the long request


def test_without_deadline_admission_the_request_starts_late_and_misses():
    eng = FakeEngine(batch_size=1, step_s=0.01)
    with serve(eng, ServerSettings(deadline_admission=False)) as (url, state):
        r, _waited, _long = _queue_behind_a_long_request(url, deadline=2.0)
        assert r.status_code == 200 and r.json()["jitflow"]["slo_met"] is False
        assert state.deadline_rejections == 0  # the speed is still read, for the analyzer


def test_the_analyzer_plans_with_the_speed_the_engine_reports(monkeypatch):
    """Through the HTTP server: once the engine reports its step model, ``GET /v1/jitflow/engine`` shows
    the analyzer's call-time model measured from it (the fake's 0.01 s steps), also with deadline admission
    off; ``$JITFLOW_TIME_MODEL`` pins it."""
    for settings in (ServerSettings(), ServerSettings(deadline_admission=False)):
        with serve(FakeEngine(batch_size=2, step_s=0.01), settings) as (url, state):
            t0 = time.time()
            while (tm := httpx.get(url + "/v1/jitflow/engine").json()["analyzer"]["time_model"])["source"] != "measured":
                assert time.time() - t0 < 10, tm
                time.sleep(0.05)
            assert tm["decode_s_per_token"] == pytest.approx(0.01)
            assert state.tasks.advisor.time_model.decode_s_per_token == pytest.approx(0.01)
    monkeypatch.setenv("JITFLOW_TIME_MODEL", "0.2,0.002")
    with serve(FakeEngine(batch_size=2, step_s=0.01)) as (url, state):
        _wait_for_rate(state)
        time.sleep(1.2)  # two more polls (every 0.5 s), each of which would have replaced a built-in model
        tm = httpx.get(url + "/v1/jitflow/engine").json()["analyzer"]["time_model"]
        assert tm == {"decode_s_per_token": 0.2, "prefill_s_per_token": 0.002, "source": "JITFLOW_TIME_MODEL"}


def test_compound_waiting_time_is_the_later_of_waiting_time_and_sub_deadline():
    from jitflow_server.scheduler.admission import compound_waiting_time

    assert compound_waiting_time(5.0, 30.0, "sub_deadline") == 30.0
    assert compound_waiting_time(5.0, 2.0, "sub_deadline") == 5.0  # never shorter than the waiting time
    assert compound_waiting_time(5.0, 30.0) == 5.0  # the default holds it to the waiting time
    assert compound_waiting_time(None, 30.0, "sub_deadline") is None  # no admission control stays none
    assert compound_waiting_time(5.0, None, "sub_deadline") == 5.0  # no analyzer: the waiting time
    with pytest.raises(ValueError, match="compound_waiting"):
        compound_waiting_time(5.0, 30.0, "forever")
    with pytest.raises(ValueError, match="compound_waiting"):
        ServerSettings(compound_waiting="forever")
