"""Tests of the asynchronous length-bound service."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest

from jitflow_server.analyzer.length import LengthPredictor
from jitflow_server.analyzer.length_service import LengthService
from jitflow_server.analyzer.tokens import TokenCounter

REGEX = TokenCounter(None)


@pytest.fixture(scope="module")
def predictor() -> LengthPredictor:
    rng = np.random.default_rng(0)
    prompts, lengths, outputs = [], [], []
    for i in range(300):
        topic = ("short", "long")[i % 2]
        n = max(1, int((40 if topic == "short" else 300) * np.exp(0.3 * rng.normal())))
        prompts.append(f"a {topic} question {i}")
        lengths.append(n)
        outputs.append(" ".join(["tok"] * n))
    return LengthPredictor(0.9, n_estimators=20, counter=REGEX, refine_grid=(50, 100)).fit(
        prompts, lengths, outputs=outputs)


def test_submit_returns_without_waiting_for_the_model(predictor: LengthPredictor) -> None:
    with LengthService(predictor) as svc:
        gate = threading.Event()
        orig = predictor.predict_matrix

        def slow(X, *a, **kw):  # the real forest, delayed: the caller must not wait for it
            gate.wait(5)
            return orig(X, *a, **kw)

        predictor.predict_matrix = slow  # type: ignore[method-assign]
        try:
            t0 = time.perf_counter()
            svc.submit("r1", "a long question 1", app="chat", max_tokens=2000)
            elapsed = time.perf_counter() - t0
            first = svc.latest("r1")
            assert elapsed < 0.05
            assert first == 2000  # provisional fallback (no history: max_tokens), available immediately
            gate.set()
            assert svc.flush(5)
        finally:
            del predictor.predict_matrix
        b = svc.latest("r1")
        assert b is not None and b != first and 100 < b < 2000


def test_refinement_and_observe(predictor: LengthPredictor, tmp_path) -> None:
    tel = tmp_path / "tel.jsonl"
    with LengthService(predictor, telemetry_path=tel) as svc:
        svc.submit("r", "a short question 3", app="chat", model="m")
        svc.flush(5)
        b0 = svc.latest("r")
        assert b0 is not None and b0 < 200
        # the request keeps generating beyond its bound: the bound is lifted at once, refined later
        svc.submit("r", "a short question 3", app="chat", model="m", generated_text=" ".join(["tok"] * 250),
                   generated_tokens=250)
        assert svc.latest("r") >= 251
        svc.flush(5)
        assert svc.latest("r") >= 251
        svc.observe("r", 260)
        assert svc.latest("r") is None
    rec = json.loads(tel.read_text().splitlines()[0])
    assert rec["kind"] == "jitflow.length.v1" and rec["output_len"] == 260 and "prompt" not in rec
    assert "250" in rec["prefix_features"]


def test_usable_from_asyncio(predictor: LengthPredictor) -> None:
    async def main() -> int | None:
        async with LengthService(predictor) as svc:
            for i in range(100):
                svc.submit(f"r{i}", f"a long question {i}", app="x")
            assert await svc.aflush(10)
            assert svc.stats["batches"] < 100  # requests were batched
            return svc.latest("r5")

    b = asyncio.run(main())
    assert b is not None and b > 150


def test_fallback_without_model_and_calibration_moves(predictor: LengthPredictor) -> None:
    with LengthService(None) as svc:
        for i in range(40):
            svc.submit(f"a{i}", "p", app="chat")
            svc.observe(f"a{i}", 100 + i)
        svc.submit("new", "p", app="chat", max_tokens=4096)
        assert 130 <= svc.latest("new") <= 140
        for i in range(400):  # answers cut off at their max_tokens are censored, not short
            svc.submit(f"c{i}", "p", app="chat", max_tokens=8)
            svc.observe(f"c{i}", 8)
        svc.submit("after", "p", app="chat", max_tokens=128)
        assert svc.latest("after") == 128
    with LengthService(predictor, calibrate=True, refit_min_new=0) as svc:
        for i in range(60):  # served model talks 3x longer than the training data
            svc.submit(f"s{i}", f"a short question {i}", model="new")
            svc.flush(5)
            svc.observe(f"s{i}", 150)
        assert svc.calibrator.theta(None, "new", 0) > 0.5


def test_background_refit_swaps_model(predictor: LengthPredictor) -> None:
    with LengthService(predictor, refit_min_new=30) as svc:
        old = svc.predictor.version
        for i in range(30):
            svc.submit(f"q{i}", f"a short question {i}", model="m")
            svc.flush(5)
            svc.observe(f"q{i}", 45)
        svc._refit_thread.join(60)
        assert svc.stats["refits"] == 1 and svc.predictor.version != old
        svc.submit("after", "a short question 1")
        assert svc.flush(5) and svc.latest("after") is not None


def test_bad_model_path_falls_back(tmp_path, caplog) -> None:
    p = tmp_path / "broken.pkl"
    p.write_text("garbage")
    with LengthService(p) as svc:
        assert svc.predictor is None
        svc.submit("r", "hello", max_tokens=77)
        assert svc.latest("r") == 77


def test_cold_start_without_a_model_still_writes_telemetry(tmp_path) -> None:
    """With no forest (fresh machine), finished requests are still logged: that log trains the first model."""
    tel = tmp_path / "tel.jsonl"
    with LengthService(None, telemetry_path=tel) as svc:
        svc.submit("a", "a short question 1", app="chat", model="m", max_tokens=60)
        assert svc.latest("a") == 60  # fallback: no history yet, max_tokens
        svc.observe("a", 17)
        assert svc.flush(5)
        recs = [json.loads(x) for x in tel.read_text().splitlines()]
        assert len(recs) == 1 and recs[0]["output_len"] == 17 and recs[0]["max_tokens"] == 60
        assert recs[0]["prompt_tokens"] > 0 and len(recs[0]["prompt_features"]) > 0
        svc.submit("b", "another question", app="chat", max_tokens=60)
        svc.observe("b", 5)  # close() right after: the record must not be lost
    assert len(tel.read_text().splitlines()) == 2


def test_request_finishing_before_the_worker_reaches_it_is_still_logged(predictor: LengthPredictor,
                                                                        tmp_path) -> None:
    tel = tmp_path / "tel.jsonl"
    with LengthService(predictor, telemetry_path=tel) as svc:
        gate = threading.Event()
        orig = predictor.predict_matrix

        def slow(X, *a, **kw):
            gate.wait(5)
            return orig(X, *a, **kw)

        predictor.predict_matrix = slow  # type: ignore[method-assign]
        try:
            svc.submit("busy", "a long question 2", app="chat")  # occupies the worker
            time.sleep(0.1)
            svc.submit("quick", "a short question 9", app="chat")
            svc.observe("quick", 3)  # finished before any prediction for it
            gate.set()
            assert svc.flush(5)
        finally:
            del predictor.predict_matrix
    recs = [json.loads(x) for x in tel.read_text().splitlines()]
    assert [r["output_len"] for r in recs] == [3]
