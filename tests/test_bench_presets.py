"""Step-time presets (bench/presets.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jitflow_server.bench.presets import PRESETS, load_preset
from jitflow_server.engine.step_model import PresetError, StepModel


def test_builtin_presets_load_and_are_sane():
    for name in ("cpu-demo", "cpu-demo-avx512", "a100-llama8b"):
        m = load_preset(name)
        assert m.name == name
        assert m.decode_token_time(32) > m.decode_token_time(1) > 0
    assert load_preset("a100-llama8b").decode_token_time(32) < load_preset("cpu-demo").decode_token_time(32)


def test_heterogeneous_batches_are_slower():
    m = PRESETS["a100-llama8b"]
    homo = m.step_time(4, 0, np.array([1000, 1000, 1000, 1000]))
    het = m.step_time(4, 0, np.array([100, 100, 100, 3700]))  # same total context
    assert het > homo
    assert homo == pytest.approx(m.raw_time(4, 0, 4000))


def test_preset_json_roundtrip_and_errors(tmp_path):
    m = PRESETS["cpu-demo"].with_overrides(name="mine", base_s=0.02)
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"preset": m.to_dict(), "fit": {"r2": 0.9}}))
    assert load_preset(p) == m
    with pytest.raises(PresetError):
        load_preset("nope")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "base_s": 0.01, "bogus": 1}))
    with pytest.raises(PresetError):
        load_preset(bad)
    with pytest.raises(PresetError):
        StepModel(name="x", base_s=0.0, per_decode_s=0, per_prefill_token_s=0, per_ctx_token_s=0, hetero=0,
                  kv_capacity_tokens=10)
