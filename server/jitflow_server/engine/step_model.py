"""The engine step-time model of the simulator (and of the analyzer's time model).

A :class:`StepModel` prices one continuous-batching engine step from its composition (decode
requests, prefill tokens, decode context tokens) and carries the engine's sizes (batch, KV cache,
block size). The benchmark presets (``bench/presets.py``) are instances of it, fitted to measured
engines (``jitflow bench fit-steps``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np


class PresetError(ValueError):
    """Unknown preset name, unreadable preset file, or invalid step-model parameters."""


@dataclass(frozen=True)
class StepModel:
    """Engine step-time model and capacities (seconds, tokens).

    Fields: ``base_s`` fixed cost per step; ``per_decode_s`` per decoding request;
    ``per_prefill_token_s`` per prefill token; ``per_ctx_token_s`` per context token of decoding
    requests (attention/KV reads); ``hetero`` multiplier of the length-heterogeneity penalty
    ``(1 + hetero·cv)``; ``kv_capacity_tokens`` KV-cache size; ``block_size`` KV block (tokens);
    ``max_batched_tokens`` token budget per step (chunked prefill); ``sarathi_chunk`` the smaller
    prefill chunk used for the ``sarathi`` baseline; ``batch_size`` default B;
    ``swap_rate`` KV swap bandwidth in tokens/s (``None``: preemption recomputes, vLLM v1);
    ``prefix_caching`` vLLM's automatic prefix caching (default on, as in vLLM v1): a request
    preempted by recompute gets back the blocks of its prefix not yet evicted, so its recompute only
    prefills the evicted part (the simulator models vLLM's FIFO free-block queue);
    ``source`` a free-text provenance note.
    """

    name: str
    base_s: float
    per_decode_s: float
    per_prefill_token_s: float
    per_ctx_token_s: float
    hetero: float
    kv_capacity_tokens: int
    block_size: int = 16
    max_batched_tokens: int = 2048
    sarathi_chunk: int = 512
    batch_size: int = 32
    swap_rate: float | None = None
    prefix_caching: bool = True
    source: str = ""

    def __post_init__(self) -> None:
        for k in ("base_s", "per_decode_s", "per_prefill_token_s", "per_ctx_token_s", "hetero"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise PresetError(f"StepModel.{k} must be a finite number >= 0, got {v!r}")
        if self.base_s <= 0:
            raise PresetError("StepModel.base_s must be > 0 s")
        for k in ("kv_capacity_tokens", "block_size", "max_batched_tokens", "sarathi_chunk", "batch_size"):
            if int(getattr(self, k)) < 1:
                raise PresetError(f"StepModel.{k} must be >= 1")
        if self.swap_rate is not None and self.swap_rate <= 0:
            raise PresetError("StepModel.swap_rate must be > 0 tokens/s or None")

    def raw_time(self, n_decode: int, prefill_tokens: int, ctx_sum: float) -> float:
        """Step time (s) without the heterogeneity penalty."""
        return (self.base_s + self.per_decode_s * n_decode + self.per_prefill_token_s * prefill_tokens
                + self.per_ctx_token_s * ctx_sum)

    def step_time(self, n_decode: int, prefill_tokens: int, ctx_lens: np.ndarray | list[int] | None = None) -> float:
        """Step time (s) of a batch with ``n_decode`` decoding requests and ``prefill_tokens`` prefill tokens.

        ``ctx_lens``: context length (tokens) of every request in the batch; the first
        ``n_decode`` entries are taken to be the decoding ones (their sum drives the attention term)
        and all entries drive the heterogeneity penalty.
        """
        if ctx_lens is None or len(ctx_lens) == 0:
            return self.raw_time(n_decode, prefill_tokens, 0.0)
        c = np.asarray(ctx_lens, dtype=np.float64)
        ctx_sum = float(c[:n_decode].sum())
        return self.raw_time(n_decode, prefill_tokens, ctx_sum) * (1.0 + self.hetero * cv(c))

    def decode_token_time(self, batch: int, mean_ctx: float = 1000.0) -> float:
        """Seconds per decode step of a homogeneous batch of ``batch`` requests with ``mean_ctx`` context."""
        return self.raw_time(batch, 0, batch * mean_ctx)

    def to_dict(self) -> dict:
        """Plain dict (JSON-able)."""
        return asdict(self)

    def with_overrides(self, **kw: object) -> StepModel:
        """Copy with some fields replaced (raises :class:`PresetError` on invalid values)."""
        return replace(self, **kw)  # type: ignore[arg-type]

    def scaled(self, factor: float) -> StepModel:
        """Copy whose every step takes ``factor`` times as long (all four time coefficients scaled;
        ``hetero`` is relative and kept). Raises :class:`PresetError` for ``factor <= 0``."""
        if not factor > 0:
            raise PresetError(f"step-time scale must be positive, got {factor}")
        return replace(self, base_s=self.base_s * factor, per_decode_s=self.per_decode_s * factor,
                       per_prefill_token_s=self.per_prefill_token_s * factor,
                       per_ctx_token_s=self.per_ctx_token_s * factor)


def cv(x: np.ndarray) -> float:
    """Coefficient of variation std/mean of ``x`` (0 for fewer than 2 values or a zero mean)."""
    n = x.size
    if n < 2:
        return 0.0
    # np.mean and np.std's arithmetic, bit for bit (a sum, a division, the squared deviations' sum),
    # without their 15 µs of dispatch: the simulator asks once per step
    mean = np.add.reduce(x) / n
    if not mean > 0:
        return 0.0
    dev = x - mean
    return math.sqrt(np.add.reduce(dev * dev) / n) / float(mean)


# ---- built-in presets -------------------------------------------------------------------------

#: Fitted by ``jitflow bench fit-steps`` to the 2,073 busy steps the real engine logged under four policies
#: (``jitflow bench engine --policies fcfs,gmax,sjf,las --duration 120 --rps 2 --seed 1``, 2026-11-24;
#: docs/benchmarks.md): demo model in float32 (``engine_dtype``: this CPU has no native bf16) on a 2-core
#: AMD EPYC with AVX2 only, B = 32, KV cache 131,072 tokens. A step log covers the batches a workload
#: really makes (mixed prefill and decode, short contexts), where ``jitflow bench profile``'s grid of
#: uniform batches overpredicted them by 18-22 %. Step times belong to a machine: refit elsewhere.
