"""Tests of the QRF length upper bound (JITServe §4.1)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from jitflow_server.analyzer.length import (
    FORMAT_VERSION,
    CompiledForest,
    LengthModelError,
    LengthPredictor,
    load_predictor_or_none,
)
from jitflow_server.analyzer.length_calibration import (
    OnlineCalibrator,
    RunningQuantileFallback,
    finalize_bound,
)
from jitflow_server.analyzer.length_data import load_examples, telemetry_record
from jitflow_server.analyzer.tokens import TokenCounter

REGEX = TokenCounter(None)  # fast, deterministic tokenizer for tests
TOPICS = ["short", "medium", "long"]
MEANS = {"short": 30.0, "medium": 120.0, "long": 400.0}


def synth(n: int, seed: int) -> tuple[list[str], list[int], list[str]]:
    """Prompts whose topic word sets a log-normal length distribution with known quantiles."""
    rng = np.random.default_rng(seed)
    prompts, lengths, outputs = [], [], []
    for i in range(n):
        t = TOPICS[i % 3]
        n_len = max(1, int(round(MEANS[t] * math.exp(0.4 * rng.normal()))))
        prompts.append(f"Please answer this {t} question number {rng.integers(1000)}: about {t} things?")
        lengths.append(n_len)
        outputs.append(" ".join(["word"] * n_len))  # regex tokenizer: one token per word
    return prompts, lengths, outputs


@pytest.fixture(scope="module")
def fitted() -> LengthPredictor:
    prompts, lengths, outputs = synth(600, 0)
    return LengthPredictor(0.9, n_estimators=30, counter=REGEX, refine_grid=(50, 100, 200), keep_forest=True).fit(
        prompts, lengths, outputs=outputs)


def test_coverage_on_known_distribution_is_near_q(fitted: LengthPredictor) -> None:
    prompts, lengths, _ = synth(900, 1)
    b = fitted.predict(prompts)
    cov = float(np.mean(np.asarray(lengths) <= b))
    assert abs(cov - 0.9) < 0.05, cov
    # the bound follows the true conditional q-quantile (exp(0.4 * 1.2816) ≈ 1.67 × mean)
    for t in TOPICS:
        sel = [i for i, p in enumerate(prompts) if f" {t} " in p]
        true_q = MEANS[t] * math.exp(0.4 * 1.2816)
        assert 0.75 * true_q < np.median(b[sel]) < 1.3 * true_q


def test_bound_never_below_generated_tokens(fitted: LengthPredictor) -> None:
    prompts, _, _ = synth(30, 2)
    for k in (0, 10, 60, 150, 500, 5000):
        gen = [" ".join(["word"] * k)] * len(prompts)
        b = fitted.predict(prompts, generated=gen)
        assert np.all(b >= k + 1)
        capped = fitted.predict(prompts, generated=gen, max_tokens=[k + 5] * len(prompts))
        assert np.all(capped >= min(k + 1, k + 5)) and np.all(capped <= k + 5)


def test_refinement_tightens_long_running_requests(fitted: LengthPredictor) -> None:
    prompts = ["Please answer this long question number 7: about long things?"] * 2
    b0 = fitted.predict(prompts[:1])[0]
    b200 = fitted.predict(prompts[:1], generated=[" ".join(["word"] * 200)])[0]
    assert b200 >= 201
    # after 200 tokens the remaining-length bound is smaller than the fresh one
    assert b200 - 200 < b0


def test_compiled_forest_matches_quantile_forest(fitted: LengthPredictor) -> None:
    X, _ = fitted.features(synth(40, 3)[0])
    ours = CompiledForest(fitted.forest).predict(X, 0.9)
    ref = np.asarray(fitted.forest.predict(X, quantiles=0.9)).reshape(-1)
    assert np.allclose(ours, ref, rtol=1e-9, atol=1e-9)


def test_save_load_round_trip(tmp_path, fitted: LengthPredictor) -> None:
    prompts, _, _ = synth(50, 4)
    path = fitted.save(tmp_path / "m.pkl")
    loaded = LengthPredictor.load(path, counter=REGEX)
    assert loaded.version == fitted.version and loaded.version.startswith(f"qrf-v{FORMAT_VERSION}")
    assert np.array_equal(loaded.predict(prompts), fitted.predict(prompts))


def test_corrupt_or_missing_model_falls_back_with_warning(tmp_path, caplog) -> None:
    bad = tmp_path / "bad.pkl"
    bad.write_bytes(b"\x80\x04 not a pickle at all")
    with pytest.raises(LengthModelError, match="corrupt"):
        LengthPredictor.load(bad)
    with pytest.raises(LengthModelError, match="not found"):
        LengthPredictor.load(tmp_path / "missing.pkl")
    with caplog.at_level(logging.WARNING):
        assert load_predictor_or_none(bad) is None
    assert any("fallback" in r.message for r in caplog.records)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError):
        LengthPredictor(1.5)
    with pytest.raises(ValueError):
        LengthPredictor(counter=REGEX).fit(["a"], [1, 2])
    with pytest.raises(LengthModelError):
        LengthPredictor(counter=REGEX).predict(["a"])


def test_online_calibration_restores_coverage_under_shift() -> None:
    rng = np.random.default_rng(5)
    cal = OnlineCalibrator(0.9, step=0.05)
    raw = 100.0  # a bound that is the 0.9-quantile for lengths ~ LN(log 60, 0.4) ...
    hits = []
    for t in range(3000):
        y = 1.8 * 60 * math.exp(0.4 * rng.normal())  # ... but the served model talks 1.8x longer
        b = finalize_bound(raw * cal.factor("app", "new-model", 0), 0, None)
        if t >= 500:
            hits.append(y <= b)
        cal.update("app", "new-model", 0, b, int(y))
    assert abs(np.mean(hits) - 0.9) < 0.03
    # an unseen group starts from the globally learned offset
    assert cal.theta("other", "x", 0) == pytest.approx(cal.theta("*", "*", 0), abs=1e-9) or cal.theta(
        "other", "x", 0) > 0.3


def test_running_quantile_fallback() -> None:
    fb = RunningQuantileFallback(0.9, min_count=10)
    assert fb.bound("a", 0, max_tokens=256) == 256  # no history: max_tokens
    assert fb.bound("a", 0) == 1024  # nothing at all: documented default
    for v in range(1, 101):
        fb.observe("a", v)
    assert 85 <= fb.bound("a", 0) <= 95
    assert fb.bound("a", 0, max_tokens=50) == 50
    # longer than all history: conservative default / max_tokens, never below k + 1
    assert fb.bound("a", 120, max_tokens=300) == 300
    assert fb.bound("a", 2000) == 2001
    assert 90 <= fb.bound("a", 50) <= 100  # conditioned on length > k
    assert 90 <= fb.bound("b", 0) <= 95  # unknown app uses the overall history


def test_truncated_lengths_are_censored_not_taken_at_face_value() -> None:
    """Answers cut off at a small ``max_tokens`` say nothing about how long an uncapped answer is: a flood
    of them must not pull the bound of a request with a larger ``max_tokens`` down."""
    fb = RunningQuantileFallback(0.9, min_count=10)
    for _ in range(500):
        fb.observe("chat", 8, truncated=True)
    assert fb.bound("chat", 0, max_tokens=128) == 128
    assert fb.bound("chat", 0) == 1024  # no cap: the documented default, not 2**31
    for v in range(1, 201):  # real, complete answers dominate again
        fb.observe("chat", v)
    assert fb.bound("chat", 0, max_tokens=4096) == 4096  # 500 of 700 censored: still above the q-quantile
    for v in range(1, 2001):
        fb.observe("chat", v % 200 + 1)
    assert 170 <= fb.bound("chat", 0, max_tokens=4096) <= 200  # the censored ones left the window


def test_load_examples_alpaca_and_telemetry(tmp_path) -> None:
    alpaca = tmp_path / "a.json"
    alpaca.write_text('[{"instruction": "Say hi", "output": "Hi there !", "generator": "m1"}]')
    tel = tmp_path / "t.jsonl"
    rec = telemetry_record(output_len=7, prompt="Tell me a joke", app="chat", model="m2", tokenizer="regex-words-v1")
    tel.write_text(__import__("json").dumps(rec) + "\n")
    ex = load_examples([alpaca, tel], counter=REGEX)
    assert [e.output_len for e in ex] == [3, 7]
    assert ex[0].model == "m1" and ex[1].app == "chat"
    bad = tmp_path / "bad.json"
    bad.write_text('[{"prompt": 1}]')
    with pytest.raises(ValueError, match="instruction"):
        load_examples([bad], counter=REGEX)
    with pytest.raises(FileNotFoundError):
        load_examples([tmp_path / "nope.json"], counter=REGEX)


def test_fitting_on_threads_builds_the_same_model(fitted: LengthPredictor) -> None:
    """``fit_jobs`` only spreads the tree building over threads: the bounds are the same to the bit, and a
    kept forest predicts in the caller's thread afterwards."""
    prompts, lengths, outputs = synth(600, 0)
    threaded = LengthPredictor(0.9, n_estimators=30, counter=REGEX, refine_grid=(50, 100, 200), keep_forest=True,
                               fit_jobs=2).fit(prompts, lengths, outputs=outputs)
    test = synth(80, 5)[0]
    assert np.array_equal(threaded.predict(test), fitted.predict(test))
    for k in (60, 150):
        assert np.array_equal(threaded.predict(test, generated_tokens=[k] * len(test)),
                              fitted.predict(test, generated_tokens=[k] * len(test)))
    assert threaded.forest.n_jobs == 1


def test_train_length_command_records_the_app_and_rejects_bad_jobs(tmp_path) -> None:
    """``jitflow analyzer train-length``: ``--app`` reaches the AlpacaEval rows' context; ``--jobs 0`` is a
    usage error naming the option."""
    import json

    import typer
    from typer.testing import CliRunner

    from jitflow_server.analyzer import length_cli

    prompts, lengths, outputs = synth(120, 6)
    data = tmp_path / "alpaca.json"
    data.write_text(json.dumps([{"instruction": p, "output": o, "generator": "m1"}
                                for p, o in zip(prompts, outputs, strict=True)]))
    tel = tmp_path / "chat.jsonl"  # rows of another app: a field with one value is dropped as uninformative
    tel.write_text("".join(json.dumps(telemetry_record(output_len=n, prompt=p, app="chat")) + "\n"
                           for p, n in zip(*synth(60, 7)[:2], strict=True)))
    app = typer.Typer()
    length_cli.register(app)
    app.command("noop")(lambda: None)  # a second command keeps train-length a subcommand
    out = tmp_path / "m.pkl"
    runner = CliRunner()
    res = runner.invoke(app, ["train-length", "--data", str(data), "--data", str(tel), "--out", str(out),
                              "--app", "support", "--n-estimators", "5", "--jobs", "2"])
    assert res.exit_code == 0, res.output
    model = LengthPredictor.load(out)
    assert set(model.context_encoder.vocab["app"]) == {"support", "chat"}
    bad = runner.invoke(app, ["train-length", "--data", str(data), "--out", str(tmp_path / "x.pkl"), "--jobs", "0"])
    assert bad.exit_code == 2 and "--jobs" in bad.output and not (tmp_path / "x.pkl").exists()
