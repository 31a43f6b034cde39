"""Stage length bounds of compound calls (pattern history, refined as tokens are generated; JITServe §4.1)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from jitflow_server.analyzer.advisor import CompoundAdvisor
from jitflow_server.analyzer.matcher import Matcher
from jitflow_server.analyzer.stage_length import (
    StageCalibrator,
    StageLengthSamples,
    evaluate_stage_bounds,
    render_stage_markdown,
    stage_pools,
)
from jitflow_server.store.graph import PatternGraph
from jitflow_server.store.history import HistoryStore

DEEP = Path(__file__).resolve().parents[2] / "shared" / "data" / "deepresearch" / "deepresearch_training.json"


def test_bound_is_the_conditional_quantile_above_k() -> None:
    s = StageLengthSamples(tuple(range(1, 101)), tuple(range(1, 1001)), 0.9, 0)
    assert s.bound(0) == int(np.ceil(np.quantile(np.arange(1, 101), 0.9)))
    prev = 0
    for k in (0, 20, 50, 80, 89):  # survival conditioning: non-decreasing in k, always above k
        b = s.bound(k)
        assert b is not None and b >= max(prev, k + 1)
        prev = b
    # fewer than 10 neighbour lengths above k: the app's pool of the stage takes over
    pooled = np.arange(1, 1001)
    assert s.bound(95) == int(np.ceil(np.quantile(pooled[pooled > 95], 0.9)))
    assert StageLengthSamples((5, 6), (), 0.9, 0).bound(10) is None
    assert StageLengthSamples((), (50,) * 3, 0.9, 0).bound(10) == 50  # a small pool still answers


def test_calibrator_moves_coverage_toward_q() -> None:
    rng = np.random.default_rng(0)
    cal = StageCalibrator(0.9, step=0.05)
    hits = []
    for t in range(3000):  # raw bound 100, true lengths log-normal around 100: raw covers ~50 %
        y = int(100 * np.exp(0.5 * rng.normal()))
        b = cal.apply("app", 2, 0, 100)
        if t > 1000:
            hits.append(y <= b)
        cal.observe("app", 2, [(0, b)], y)
    assert 0.87 <= float(np.mean(hits)) <= 0.93
    assert cal.apply("other", 5, 0, 100) >= 100  # an unseen group starts from the global offset


def _graphs(n: int, seed: int, model: str = "llama3-8b") -> list[PatternGraph]:
    """Tasks of two kinds: short stage-1 answers when the first stage is short, long ones otherwise."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        long_task = i % 2 == 0
        s0 = int(rng.integers(300, 400) if long_task else rng.integers(20, 40))
        s1 = [(100, int(rng.integers(600, 900) if long_task else rng.integers(30, 60))) for _ in range(2)]
        out.append(PatternGraph.from_stage_lengths("app", [[(50, s0)], s1, [(400, int(rng.integers(80, 120)))]],
                                                   model=model, task_id=str(i)))
    return out


def test_evaluation_reserves_less_than_the_single_best_match() -> None:
    res = evaluate_stage_bounds(_graphs(120, 1), warmup=20)
    m = res["methods"]
    assert res["n_calls"] == 120 * 4
    for k in ("0", "100"):  # near q, and fewer KV tokens reserved for nothing than the padded best match
        assert 0.85 <= m["knn_calibrated"][k]["coverage"] <= 0.95
        assert m["knn"][k]["over_reservation"] < m["previous"][k]["over_reservation"]
    assert "| k |" in render_stage_markdown(res)
    with pytest.raises(ValueError):
        evaluate_stage_bounds(_graphs(3, 0))


def test_advisor_gives_samples_and_keeps_the_best_match_sub_deadline() -> None:
    hist = _graphs(60, 2)
    task = _graphs(2, 3)[0]
    partial = task.prefix(1, open_next=True)
    one = Matcher.from_graphs(hist)
    adv = CompoundAdvisor(matcher_for=lambda app: one)
    a = adv.advise("app", partial, 1, 0.0, 100.0)
    assert a.len_samples is not None and len(a.len_samples.neighbours) == 2 * 16
    assert a.len_bound == a.len_samples.bound(0)
    assert a.len_samples.pool == stage_pools(hist)[("app", 1)]
    # the sub-deadline is the best match's, as with a single-neighbour match
    single = CompoundAdvisor(matcher_for=lambda app: one, bound_top_k=1).advise("app", partial, 1, 0.0, 100.0)
    assert a.sub_deadline == pytest.approx(single.sub_deadline)
    assert a.task_rem_gen_time == pytest.approx(single.task_rem_gen_time)


@pytest.mark.skipif(not DEEP.is_file(), reason="../shared/data/deepresearch absent")
def test_deep_research_stage_bounds_cover_and_refine() -> None:
    from jitflow_server.analyzer.patterns import load_deepresearch

    m = evaluate_stage_bounds(load_deepresearch(DEEP))["methods"]
    for k in ("0", "50", "100", "200", "400"):
        assert m["knn_calibrated"][k]["coverage"] >= 0.87
        assert m["knn"][k]["coverage"] > m["previous"][k]["coverage"]
    assert m["knn_calibrated"]["100"]["p90_ratio"] < 3.0 and m["knn_calibrated"]["400"]["p90_ratio"] < 2.2


def test_served_pattern_bound_is_refined_while_the_call_runs(tmp_path, monkeypatch) -> None:
    """A real HTTP server on 127.0.0.1 with history in SQLite: a compound call's bound comes from the
    matched graphs and is pushed to the engine again as the call passes 50-token boundaries."""
    from jitflow_server.engine.fake import FakeEngine
    from test_api_fake_engine import _chat, serve

    db = tmp_path / "history.db"
    monkeypatch.setenv("JITFLOW_HISTORY_DB", str(db))
    monkeypatch.delenv("JITFLOW_PATTERNS", raising=False)
    monkeypatch.delenv("JITFLOW_LENGTH_TELEMETRY", raising=False)
    store = HistoryStore(db)
    rng = np.random.default_rng(5)
    store.insert_many([PatternGraph.from_stage_lengths("agent", [[(30, int(rng.integers(100, 300)))]], model="fake",
                                                       task_id=f"h{i}") for i in range(40)])
    store.close()
    eng = FakeEngine(eos_after=240)
    with serve(eng) as (url, state):
        assert httpx.post(url + "/v1/tasks", json={"task_id": "t", "app": "agent", "deadline": 60}).status_code == 201
        r = _chat(url, max_tokens=1000, jitflow={"task_id": "t", "stage_index": 0, "call_id": "c0"})
        assert r.status_code == 200, r.text
        (req,) = eng.requests.values()
        first = req.hints.len_bound
        assert 250 <= first <= 330  # ~ the 0.9-quantile of U(100, 300), calibrated
        t0 = time.time()
        while not eng.updates and time.time() - t0 < 5:
            time.sleep(0.05)
        pushed = [u.len_bound[req.request_id] for u in eng.updates if req.request_id in u.len_bound]
        assert pushed and all(b > 200 for b in pushed[-1:])  # refined above what was generated
        # the finished call (240 tokens, within every bound it was issued) tightened its stage's calibration
        assert state.tasks.advisor.stage_calibrator.apply("agent", 0, 0, 1000) < 1000


def test_live_call_refines_its_pattern_bound_at_50_token_boundaries(tmp_path) -> None:
    """A compound call's pattern bound is recomputed from its stage samples each time the call passes a 50-token
    boundary; once no history length exceeds what it has generated, the bound is max_tokens and that bound is not
    fed to the stage calibrator (it is not a stage bound)."""
    from jitflow_server.api.calls import LiveCall
    from jitflow_server.api.state import ServerSettings, ServerState
    from jitflow_server.api.tasks import TaskManager
    from jitflow_server.engine.fake import FakeEngine
    from jitflow_server.engine.protocol import GenerateRequest, TokenDelta
    from jitflow_server.scheduler import Kind
    from jitflow_server.scheduler.hints import SchedHints
    from jitflow_server.scheduler.types import SLOSpec
    from jitflow_server.tracker.metrics import RequestTiming

    state = ServerState(FakeEngine(), ServerSettings(length_predictor=False))
    state.tasks = TaskManager(tmp_path / "h.db")
    try:
        samples = StageLengthSamples(tuple(range(1, 160)), tuple(range(1, 160)), 0.9, 1)
        req = GenerateRequest("r1", [1, 2, 3], 1000, SchedHints(kind=Kind.COMPOUND, request_id="r1"))
        timing = RequestTiming("r1", SLOSpec("compound", deadline=60.0, waiting_time=5.0), time.time(), 3)
        call = LiveCall(state, req, timing, None, prompt_text="p", len_bound=samples.bound(0), bound_source="pattern",
                        app="app", stage_samples=samples, stage_pos=1)
        first = call.stage_bound
        seen = []
        for i in range(200):
            call.absorb(("out", TokenDelta([i], "x"), time.time()))
            seen.append(call.stage_bound)
        cal = state.tasks.advisor.stage_calibrator
        assert seen[48] == first  # 49 tokens: not refined yet
        assert seen[49] == cal.apply("app", 1, 50, samples.bound(50)) > first  # refined at 50, conditional on > 50
        assert seen[99] == cal.apply("app", 1, 100, samples.bound(100)) > seen[49]
        assert seen[149] == cal.apply("app", 1, 150, samples.bound(150)) >= 151  # 9 lengths above 150: the pool's
        assert seen[199] == 1000  # nothing in the history is longer than 200: max_tokens
        assert [k for k, _ in call.stage_issued] == [0, 50, 100, 150]
        assert state.refined_bounds() == {}  # not registered as live: nothing to push
        state.live["r1"] = call
        assert state.refined_bounds() == {"r1": 1000}
    finally:
        state.tasks.store.close()


def test_sorted_quantile_is_numpys_linear_quantile_of_the_suffix() -> None:
    import random

    import numpy as np

    from jitflow_server.analyzer.stage_length import sorted_quantile

    rng = random.Random(1)
    for _ in range(3000):
        xs = sorted(rng.randint(1, 1500) for _ in range(rng.randint(1, 60)))
        lo, q = rng.randint(0, len(xs) - 1), rng.choice([0.1, 0.5, 0.9, 0.95, rng.random()])
        assert sorted_quantile(xs, lo, q) == float(np.quantile(np.asarray(xs[lo:], float), q))
