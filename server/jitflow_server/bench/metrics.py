"""Aggregate per-job records into the benchmark metrics (shared by the simulator and the real engine).

A *job record* is a dict with ``kind`` (latency|deadline|compound), ``slo_met`` (bool), ``goodput``
(tokens, JITServe §3 as judged by :func:`jitflow_server.tracker.goodput.evaluate`), ``output_tokens``,
``ttft``/``tbt_mean``/``e2el`` (s or None), ``rejected`` (bool) and ``preemptions``.
"""

from __future__ import annotations

import numpy as np

from jitflow_server.bench.workload import KINDS


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def met_output_share(jobs: list[dict]) -> float | None:
    """Share of the output tokens of ``jobs`` (records with ``output_tokens`` and ``slo_met``) generated for
    jobs that met their SLO; None when nothing was generated."""
    out = sum(j["output_tokens"] for j in jobs)
    return sum(j["output_tokens"] for j in jobs if j["slo_met"]) / out if out > 0 else None


def summarize(jobs: list[dict], span_s: float, makespan_s: float, frame_ms: list[float] | None = None) -> dict:
    """Metrics of one run.

    Rates: ``token_goodput`` (goodput tokens/s) and ``request_goodput`` (jobs meeting their SLO per
    second) are divided by ``span_s`` (the workload's arrival window, identical for every policy on
    the same workload, so the rates compare like the totals); ``throughput`` (generated output
    tokens/s) by ``makespan_s`` (first arrival to last token of this run); ``throughput_window``
    (output tokens generated up to the last arrival / ``span_s``: the steady-state rate, without the
    drain after the last arrival, whose length depends on how much backlog a policy carries; only
    when every record has ``output_tokens_window``); ``token_throughput`` / ``token_throughput_window``
    (prompt tokens of the calls that were served plus output tokens, per second over the same spans:
    the engine's useful work, which a policy that favours prompt-heavy requests keeps while its
    output-token rate drops; only when records have ``served_input_tokens``). Per kind: count, SLO
    attainment (rejected and unfinished jobs count as missed), goodput tokens, rejections, P50/P95 of
    TTFT, TBT (per-job mean gap, latency kind) and E2EL over the jobs that produced them.
    ``met_output_share`` (overall and per kind): the share of the generated output tokens that went to
    jobs meeting their SLO (None when nothing was generated); the rest was spent on jobs that missed,
    were abandoned or failed a later call, capacity a scheduler could have given to others. Frame
    scheduling time P50/P99 in ms when ``frame_ms`` is given.
    """
    span = max(span_s, 1e-9)
    n = len(jobs)
    good = float(sum(j["goodput"] for j in jobs))
    met = sum(1 for j in jobs if j["slo_met"])
    out = float(sum(j["output_tokens"] for j in jobs))
    res: dict = {
        "jobs": n,
        "token_goodput": good / span,
        "goodput_tokens": good,
        "request_goodput": met / span,
        "slo_attainment": met / n if n else 0.0,
        "throughput": out / max(makespan_s, 1e-9),
        "output_tokens": out,
        "met_output_share": met_output_share(jobs),
        "throughput_window": (sum(j["output_tokens_window"] for j in jobs) / span
                              if jobs and all("output_tokens_window" in j for j in jobs) else None),
        "token_throughput": ((sum(j["served_input_tokens"] for j in jobs) + out) / max(makespan_s, 1e-9)
                             if jobs and all("served_input_tokens" in j for j in jobs) else None),
        "token_throughput_window": (
            sum(j["served_input_tokens_window"] + j["output_tokens_window"] for j in jobs) / span
            if jobs and all("served_input_tokens_window" in j and "output_tokens_window" in j for j in jobs)
            else None),
        "rejected": sum(1 for j in jobs if j.get("rejected")),
        "preemptions": int(sum(j.get("preemptions", 0) for j in jobs)),
        "span_s": span_s,
        "makespan_s": makespan_s,
        "per_kind": {},
    }
    for k in KINDS:
        js = [j for j in jobs if j["kind"] == k]
        if not js:
            continue
        ttft = [j["ttft"] for j in js if j.get("ttft") is not None]
        tbt = [j["tbt_mean"] for j in js if j.get("tbt_mean") is not None]
        e2el = [j["e2el"] for j in js if j.get("e2el") is not None]
        res["per_kind"][k] = {
            "n": len(js),
            "met_output_share": met_output_share(js),
            "slo_attainment": sum(1 for j in js if j["slo_met"]) / len(js),
            "goodput_tokens": float(sum(j["goodput"] for j in js)),
            "rejected": sum(1 for j in js if j.get("rejected")),
            "ttft_p50": _pct(ttft, 50), "ttft_p95": _pct(ttft, 95),
            "tbt_p50": _pct(tbt, 50), "tbt_p95": _pct(tbt, 95),
            "e2el_p50": _pct(e2el, 50), "e2el_p95": _pct(e2el, 95),
        }
    if frame_ms:
        res["frame_ms_p50"] = _pct(frame_ms, 50)
        res["frame_ms_p99"] = _pct(frame_ms, 99)
        res["frames"] = len(frame_ms)
    return res


def ci95(xs: list[float]) -> float | None:
    """Half-width (same unit as ``xs``) of the two-sided 95 % Student-t confidence interval of the
    mean of ``xs``; None for fewer than two values (one run has no interval)."""
    if len(xs) < 2:
        return None
    from scipy.stats import t

    return float(t.ppf(0.975, len(xs) - 1) * np.std(xs, ddof=1) / np.sqrt(len(xs)))


def _is_num(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def mean_runs(runs: list[dict]) -> dict:
    """Average repeated runs of one policy and load (one dict per seed, as :func:`summarize` returns).

    Every numeric leaf present in all runs becomes its mean (nested dicts such as ``per_kind`` are
    averaged key by key; percentiles are averaged across seeds, not pooled); a leaf that is None in
    some runs is averaged over the others; other values are taken from the first run. Adds
    ``<key>_ci95`` (:func:`ci95`) for ``token_goodput``, ``request_goodput`` and ``throughput`` and
    ``seeds`` (the number of runs). Raises ``ValueError`` for an empty list.
    """
    if not runs:
        raise ValueError("mean_runs needs at least one run")

    def merge(vals: list):
        first = vals[0]
        if all(isinstance(v, dict) for v in vals):
            keys = [k for k in first if all(k in v for v in vals)]
            return {k: merge([v[k] for v in vals]) for k in keys}
        nums = [v for v in vals if v is not None]
        if nums and all(_is_num(v) for v in nums):
            return float(np.mean(nums))
        return first

    out = merge(runs)
    for k in ("token_goodput", "request_goodput", "throughput"):
        if all(_is_num(r.get(k)) for r in runs):
            out[f"{k}_ci95"] = ci95([float(r[k]) for r in runs])
    out["seeds"] = len(runs)
    return out
