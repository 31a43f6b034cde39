"""``jitflow demo --model auto``: which demo model runs on this machine (demo/model_choice.py)."""

from __future__ import annotations

import math

import pytest

from jitflow_server.demo.model_choice import (
    SMALL_MODEL_MS_PER_TOKEN,
    choose_model,
    pick_model,
    prompt_ms_per_token,
)
from jitflow_server.engine.demo_model import VARIANTS


@pytest.mark.parametrize(("dtype", "ms", "model"), [
    ("float32", SMALL_MODEL_MS_PER_TOKEN * 1.6, "demo-small"),  # an AVX2-only CPU
    ("float32", SMALL_MODEL_MS_PER_TOKEN * 0.7, "demo"),        # float32, but fast enough
    ("float32", SMALL_MODEL_MS_PER_TOKEN, "demo"),              # at the threshold: kept
    ("bfloat16", SMALL_MODEL_MS_PER_TOKEN * 3, "demo"),         # native bf16: never measured, kept
    ("float32", None, "demo"),
])
def test_auto_runs_the_small_model_only_on_a_slow_float32_cpu(dtype, ms, model):
    assert pick_model(dtype, ms) == model


def test_the_small_variant_is_a_consistent_llama_with_a_quarter_of_the_compute():
    small, demo = VARIANTS["demo-small"], VARIANTS["demo"]
    assert small.hidden_size % small.num_attention_heads == 0
    assert small.num_attention_heads % small.num_key_value_heads == 0
    assert small.hidden_size // small.num_attention_heads == demo.hidden_size // demo.num_attention_heads
    assert (small.vocab_size, small.max_position_embeddings) == (demo.vocab_size, demo.max_position_embeddings)

    def dense(s):  # multiply-adds per token of every layer's projections and MLP
        kv = s.hidden_size * s.num_key_value_heads // s.num_attention_heads
        return s.num_hidden_layers * s.hidden_size * (2 * s.hidden_size + 2 * kv + 3 * s.intermediate_size)
    assert dense(demo) / dense(small) == pytest.approx(4.0, rel=0.05)


def test_the_estimate_is_a_real_measurement_and_an_explicit_model_is_kept():
    ms = prompt_ms_per_token("tiny", "float32", tokens=64, reps=1)
    assert math.isfinite(ms) and ms > 0
    with pytest.raises(KeyError):
        prompt_ms_per_token("no-such-variant")
    kept = choose_model("tiny")
    assert (kept.model, kept.requested, kept.demo_prompt_ms_per_token) == ("tiny", "tiny", None)
    auto = choose_model("auto")
    assert auto.requested == "auto" and auto.model in ("demo", "demo-small")
    # measured exactly when the engine computes in float32, and the choice follows the rule
    assert (auto.demo_prompt_ms_per_token is not None) == (auto.dtype == "float32")
    assert auto.model == pick_model(auto.dtype, auto.demo_prompt_ms_per_token)
