"""Which demo model the demo runs on this machine (``jitflow demo --model auto``, the default).

The demo's SLOs were set for the ``demo`` model on a 2-core CPU with native bf16 (about 0.125 s between
tokens at a full batch, prompts at 0.5-0.7 ms per token). On a CPU without native bf16 the engine runs in
float32 and, on a 2-core AMD EPYC with AVX2 only, the ``demo`` model computed prompts at 1.6 ms per token
and full-batch steps took 0.47 s on the demo's mix: the SLOs then had to be stretched ×3.8, which made
the burst light (stock vLLM met nearly every SLO, so no schedule could do much better) and the run
10 minutes long (docs/benchmarks-history.md, "On a slower machine"). There the ``demo-small`` variant (hidden
512, a quarter of the compute per token) runs at 0.52 ms per prompt token and 28 ms per batch-32 decode
step, about what the ``demo`` model does on the faster machines, so the demo keeps its SLOs nearly as
set. The text is noise either way (random weights); what the demo measures is scheduling.

The choice is measured, not assumed from CPU flags alone: :func:`prompt_ms_per_token` times the
``demo`` model's dense layers on 256 prompt tokens in the engine's dtype with PyTorch (about 1 s; 5 s
with the imports), and ``auto`` picks ``demo-small`` when that exceeds :data:`SMALL_MODEL_MS_PER_TOKEN`.
The estimate read 1.45-3.09 ms on the AVX2 EPYC over five runs of a day whose speed varied, where vLLM's
own prefill of the model took 1.6 ms per token. CPUs with native bf16 keep
``demo`` without measuring: every machine of that kind measured so far computed prompts at 0.5-0.7 ms per
token, and PyTorch's bf16 path outside vLLM was not measured there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

#: Estimated milliseconds per prompt token of the ``demo`` model (:func:`prompt_ms_per_token`) above which
#: ``auto`` runs ``demo-small``: between the slowest machine that kept ``demo`` well (a 2-core Xeon with
#: avx512_bf16, 0.73 ms per token in vLLM) and the AVX2 EPYC (1.6 ms), where it did not.
SMALL_MODEL_MS_PER_TOKEN = 1.0


@dataclass(frozen=True)
class ModelChoice:
    """The model the demo runs and why.

    Attributes:
        model: the ``jitflow serve --model`` value used (a variant name or a directory).
        requested: what was asked for (``auto``, a variant name or a directory).
        dtype: the engine dtype on this machine (``engine_dtype``).
        demo_prompt_ms_per_token: the estimate of :func:`prompt_ms_per_token` for the ``demo`` model (ms),
            None when not measured (an explicit model, or a CPU with native bf16).
        threshold_ms: :data:`SMALL_MODEL_MS_PER_TOKEN`.
    """

    model: str
    requested: str
    dtype: str
    demo_prompt_ms_per_token: float | None
    threshold_ms: float = SMALL_MODEL_MS_PER_TOKEN


def prompt_ms_per_token(variant: str = "demo", dtype: str = "float32", tokens: int = 256, reps: int = 3) -> float:
    """Milliseconds per prompt token of ``variant``'s dense layers (attention projections and MLP, every
    layer) on ``tokens`` tokens in ``dtype``, timed with PyTorch on random weights, best of ``reps``.

    Leaves out attention over the context, the embedding and the engine's own overheads (1.45 against
    vLLM's 1.6 ms per token of prefill for ``demo`` on an AVX2 EPYC, measured minutes apart).
    Raises ``KeyError`` for an unknown variant.
    """
    import torch

    from jitflow_server.engine.demo_model import VARIANTS

    spec = VARIANTS[variant]
    dt = getattr(torch, dtype)
    h, f = spec.hidden_size, spec.intermediate_size
    kv = h * spec.num_key_value_heads // spec.num_attention_heads
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, h, generator=gen).to(dt)
    w_qkv = torch.randn(h, h + 2 * kv, generator=gen).to(dt)
    w_o = torch.randn(h, h, generator=gen).to(dt)
    w_up = torch.randn(h, 2 * f, generator=gen).to(dt)
    w_down = torch.randn(f, h, generator=gen).to(dt)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(spec.num_hidden_layers):
                a = (x @ w_qkv)[:, :h] @ w_o
                u = x @ w_up
                a = a + u[:, :f] @ w_down
            best = min(best, time.perf_counter() - t0)
    return best / tokens * 1e3


def pick_model(dtype: str, demo_ms_per_token: float | None) -> str:
    """``auto``'s rule: ``demo-small`` when the engine runs in float32 and the ``demo`` model's estimated
    prompt cost (ms per token) exceeds :data:`SMALL_MODEL_MS_PER_TOKEN`, else ``demo``."""
    if dtype == "float32" and demo_ms_per_token is not None and demo_ms_per_token > SMALL_MODEL_MS_PER_TOKEN:
        return "demo-small"
    return "demo"


def choose_model(requested: str) -> ModelChoice:
    """Resolve ``jitflow demo --model``: ``auto`` measures this machine (:func:`prompt_ms_per_token`, in
    float32 only) and applies :func:`pick_model`; any other value is kept as given."""
    from jitflow_server.engine.vllm_engine import engine_dtype

    dtype = engine_dtype("auto")
    if requested != "auto":
        return ModelChoice(requested, requested, dtype, None)
    est = prompt_ms_per_token("demo", dtype) if dtype == "float32" else None
    return ModelChoice(pick_model(dtype, est), requested, dtype, est)
