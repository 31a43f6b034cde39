"""Tests of the length model's prompt memory, request features, spread-scaled calibration and evaluation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from jitflow_server.analyzer.length import LengthPredictor
from jitflow_server.analyzer.length_calibration import OnlineCalibrator, finalize_bound
from jitflow_server.analyzer.length_data import LengthExample, load_examples
from jitflow_server.analyzer.length_features import request_features
from jitflow_server.analyzer.length_memory import MEMORY_FEATURE_NAMES, PromptMemory
from jitflow_server.analyzer.tokens import TokenCounter

REGEX = TokenCounter(None)
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "alpaca_eval"
WORDS = ["apple", "river", "engine", "violin", "glacier", "pepper", "canyon", "harbor", "meadow", "lantern",
         "saddle", "tunnel", "orchid", "falcon", "quartz", "bamboo", "comet", "walnut", "beacon", "prairie"]


def prompts_with_lengths(n: int, seed: int) -> tuple[list[str], list[int]]:
    """Prompts made of random words; each prompt's length is a fixed function of its words (so only a
    memory of the same prompt knows it) times small noise."""
    rng = np.random.default_rng(seed)
    out_p, out_n = [], []
    for _ in range(n):
        ws = list(rng.choice(WORDS, size=4, replace=False))
        base = 20 + 40 * sum(WORDS.index(w) for w in ws) % 700
        out_p.append("Tell me about " + " and ".join(ws))
        out_n.append(max(1, int(base)))
    return out_p, out_n


def test_memory_finds_same_prompt_and_excludes_itself() -> None:
    prompts, lengths = prompts_with_lengths(200, 0)
    mem = PromptMemory(k=4).fit(prompts, lengths)
    f = mem.features(prompts[:20])
    assert f.shape == (20, len(MEMORY_FEATURE_NAMES))
    # an identical prompt is its own nearest neighbour: similarity 1 and its length among the neighbours
    assert np.allclose(f[:, 4], 1.0, atol=1e-5)
    assert np.allclose(f[:, 0], np.log1p(np.asarray(lengths[:20])))
    fx = mem.features(prompts[:20], exclude=list(range(20)))
    assert np.all(fx[:, 4] < 1.0 - 1e-6)
    # extend remembers new prompts without refitting the vocabulary; the original is unchanged
    more = mem.extend(["Tell me about apple and river and engine and violin"], [999])
    assert more.n_items == mem.n_items + 1 and more.vectorizer is mem.vectorizer
    g = more.features(["Tell me about apple and river and engine and violin"])
    assert g[0, 0] == pytest.approx(math.log1p(999))


def test_memory_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        PromptMemory(k=0)
    with pytest.raises(ValueError):
        PromptMemory(k=8).fit(["a", "b"], [1, 2])
    with pytest.raises(ValueError):
        PromptMemory(k=1).fit(["a b", "c d", "e f"], [1, 2])
    assert PromptMemory().features(["anything"]).sum() == 0.0  # unfitted: zeros


def test_memory_tightens_bounds_for_known_prompts() -> None:
    """A new model answering known prompts: the memory-based bound is tighter at equal coverage."""
    prompts, lengths = prompts_with_lengths(500, 1)
    rng = np.random.default_rng(2)
    train = [LengthExample(output_len=max(1, int(n * f * math.exp(0.1 * rng.normal()))), prompt=p, model=name)
             for name, f in (("a", 1.0), ("b", 1.2)) for p, n in zip(prompts, lengths, strict=True)]
    test_y = np.asarray([max(1, int(n * 0.8 * math.exp(0.1 * rng.normal()))) for n in lengths[:200]])
    ratios = {}
    for mem in (True, False):
        m = LengthPredictor(0.9, n_estimators=30, counter=REGEX, refine_grid=(), text_memory=mem).fit(
            None, None, examples=train)
        b = m.predict_matrix(m.features(prompts[:200])[0])
        s = np.quantile(test_y / b, 0.9)
        ratios[mem] = float(np.median(b * s / test_y))
    assert ratios[True] < 0.8 * ratios[False], ratios


def test_request_features_and_context_kind() -> None:
    f = request_features([{"max_tokens": 255, "response_format": "json_schema"}, {"response_format": "text"}, None])
    assert f[0, 0] == pytest.approx(math.log(256)) and f[0, 1] == 1.0
    assert f[1].tolist() == [0.0, 0.0] and f[2].tolist() == [0.0, 0.0]
    prompts, lengths = prompts_with_lengths(300, 3)
    ex = [LengthExample(output_len=n, prompt=p, kind=("interactive" if i % 2 else "deadline"), max_tokens=2048)
          for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    m = LengthPredictor(0.9, n_estimators=10, counter=REGEX, refine_grid=()).fit(None, None, examples=ex)
    assert "kind=interactive" in m.context_encoder.names


def test_calibrator_groups_by_kind_and_scales_by_spread() -> None:
    cal = OnlineCalibrator(0.9, step=0.1)
    for _ in range(50):  # interactive requests always overrun their bound: their θ rises
        cal.update("chat", "m", 0, 10, 100, kind="interactive")
    up = cal.theta("chat", "m", 0, kind="interactive")
    assert up > 1.0
    # another kind of the same app/model has its own group (it starts from the global θ, updated by all)
    assert cal.theta("chat", "m", 0, kind="deadline") == cal.theta("other", "x", 0, kind="batch")
    assert cal.factor("chat", "m", 0, kind="interactive", spread=0.5) == pytest.approx(math.exp(up * 0.5))
    assert cal.factor("chat", "m", 0, kind="interactive", spread=0.5) < cal.factor("chat", "m", 0,
                                                                                      kind="interactive", spread=1.0)


def test_predict_bounds_spread_and_quantiles_agree() -> None:
    prompts, lengths = prompts_with_lengths(300, 4)
    m = LengthPredictor(0.9, n_estimators=20, counter=REGEX, refine_grid=()).fit(prompts, lengths)
    X, _ = m.features(prompts[:50])
    bound, spread = m.predict_bounds(X, conformal=False)
    qv = m._compiled.predict_quantiles(X, [0.5, 0.9])
    assert np.allclose(bound, np.expm1(qv[:, 1]))
    assert np.all(spread >= 0.05) and np.allclose(m._compiled.predict(X, 0.9), qv[:, 1])
    # spread is log(q-bound / median)
    med = np.expm1(qv[:, 0])
    assert np.allclose(spread, np.maximum(np.log(np.maximum(bound, 1) / np.maximum(med, 1)), 0.05))


def test_refit_extends_memory_with_new_prompts(tmp_path) -> None:
    prompts, lengths = prompts_with_lengths(200, 5)
    m = LengthPredictor(0.9, n_estimators=10, counter=REGEX, refine_grid=()).fit(prompts, lengths)
    new_p = ["Describe the violin comet lantern harbor bamboo"] * 3
    m2 = m.refit([LengthExample(output_len=777, prompt=p) for p in new_p])
    assert m2.memory is not None and m2.memory.n_items == m.memory.n_items + 3
    assert m2.memory_features(new_p[:1])[0, 0] == pytest.approx(math.log1p(777))
    path = m2.save(tmp_path / "m.pkl")
    loaded = LengthPredictor.load(path, counter=REGEX)
    assert np.allclose(loaded.memory_features(new_p[:1]), m2.memory_features(new_p[:1]))


def _alpaca_file(path: Path, prompts: list[str], lengths: list[int], gen: str) -> Path:
    path.write_text(json.dumps([{"instruction": p, "output": " ".join(["w"] * n), "generator": gen,
                                 "dataset": "synthetic"} for p, n in zip(prompts, lengths, strict=True)]))
    return path


def test_eval_length_reports_both_splits_and_calibration(tmp_path, monkeypatch) -> None:
    from jitflow_server.analyzer import length_eval, tokens

    monkeypatch.setattr(tokens, "get_token_counter", lambda *a, **k: REGEX)
    prompts, lengths = prompts_with_lengths(160, 6)
    a = _alpaca_file(tmp_path / "a.json", prompts, lengths, "model-a")
    b = _alpaca_file(tmp_path / "b.json", prompts, [max(1, n // 2) for n in lengths], "model-b")
    res = length_eval.run_eval([a], [a, b], 0.9, tmp_path / "out", warmup=20)
    assert set(res["results"]) == {"new_prompts", "known_prompts"}
    assert res["held_out_generators"] == ["model-b"]
    entry = res["results"]["known_prompts"]["held_out_model"]["qrf"]
    for mode in ("uncalibrated", "calibrated"):
        s = entry[mode]["0"]
        assert s["n"] > 0 and 0.0 <= s["coverage"] <= 1.0 and s["over_reservation"] >= 0.0
    # model-b answers half as long: the uncalibrated bound over-reserves more than the calibrated one
    assert entry["calibrated"]["0"]["median_ratio"] < entry["uncalibrated"]["0"]["median_ratio"]
    # the reference has model-b's answers to the other prompts in training: it learns the halving
    seen = res["results"]["known_prompts"]["held_out_model"][length_eval.SEEN_MODEL]["uncalibrated"]["0"]
    assert seen["n"] == entry["uncalibrated"]["0"]["n"]
    assert seen["median_ratio"] < entry["uncalibrated"]["0"]["median_ratio"]
    assert length_eval.SEEN_MODEL not in res["results"]["new_prompts"]["held_out_model"]
    md = (tmp_path / "out" / "length_eval.md").read_text()
    assert "known prompts: held out model" in md and "over-reservation" in md
    assert (tmp_path / "out" / "length_eval.png").stat().st_size > 0


@pytest.mark.skipif(not (DATA / "Qwen2-72B-Instruct.json").is_file(), reason="../shared/data/alpaca_eval absent")
def test_memory_meets_known_prompt_targets_on_alpaca_eval() -> None:
    """Unseen model (Qwen2-72B) on prompts answered in training by Llama-3-8B and Mistral-7B, k = 0: at
    coverage 0.9 the memory model's P90 bound/true is below the text-only model's."""
    tr = load_examples([DATA / "Meta-Llama-3-8B-Instruct.json", DATA / "Mistral-7B-Instruct-v0.2.json"])
    te = load_examples([DATA / "Qwen2-72B-Instruct.json"])
    y = np.asarray([e.output_len for e in te], dtype=np.float64)
    p90 = {}
    for mem in (True, False):
        m = LengthPredictor(0.9, refine_grid=(), text_memory=mem, spread_scaled=mem).fit(None, None, examples=tr)
        b = np.asarray([finalize_bound(v, 0, None) for v in m.predict_matrix(m.features([e.prompt for e in te])[0])])
        s = np.quantile(y / b, 0.9, method="higher")
        p90[mem] = float(np.percentile(b * s / np.maximum(y, 1), 90))
    assert p90[True] < 0.9 * p90[False], p90


def test_prompts_without_a_near_twin_get_the_text_forest_bound_exactly() -> None:
    """The memory forest only serves prompts with a remembered near-duplicate; every other prompt is
    bounded exactly as by a predictor without memory."""
    prompts, lengths = prompts_with_lengths(300, 7)
    train = [LengthExample(output_len=n, prompt=p, model=name) for name in ("a", "b")
             for p, n in zip(prompts, lengths, strict=True)]
    with_mem = LengthPredictor(0.9, n_estimators=15, counter=REGEX, refine_grid=()).fit(None, None, examples=train)
    without = LengthPredictor(0.9, n_estimators=15, counter=REGEX, refine_grid=(), text_memory=False).fit(
        None, None, examples=train)
    assert with_mem._compiled_memory is not None  # every training prompt has a twin: a memory forest exists
    new = ["Explain glacier pepper canyon in detail", "Write a poem on walnut, beacon and prairie"]
    X, _ = with_mem.features(new)
    assert not with_mem._near(X).any()
    assert np.array_equal(with_mem.predict(new), without.predict(new))
    Xk, _ = with_mem.features(prompts[:5])
    assert with_mem._near(Xk).all()  # known prompts go to the memory forest
