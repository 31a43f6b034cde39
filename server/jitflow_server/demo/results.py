"""What one demo run measured: per-request records, per-kind SLO attainment and goodput (JITServe §3)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from jitflow_server.demo.plan import KINDS


# ---------------------------------------------------------------------- results
@dataclass
class ReqRecord:
    """Outcome of one chat or deadline request.

    ``status``: ``ok`` | ``rejected`` (admission, HTTP 429) | ``error`` | ``unfinished`` (still
    running when the run ended, or given up by the client after its deadline). ``tbt`` is the
    request's mean time between output tokens. ``goodput`` in tokens (on-time output tokens for
    latency SLOs; input + output tokens when a deadline is met). Times in seconds.
    """

    kind: str
    t: float
    status: str
    slo_met: bool = False
    ttft: float | None = None
    e2el: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    goodput: int = 0
    error: str | None = None
    tbt: float | None = None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize_run(records: list[ReqRecord], tasks: list[dict[str, Any]], duration: float) -> dict[str, dict[str, Any]]:
    """Per-kind SLO attainment and goodput.

    Args:
        records: chat/deadline request outcomes.
        tasks: task reports (``TaskReport.to_dict()`` of the examples: ``outcome``, ``tokens``,
            ``elapsed`` ...); compound goodput = all the task's tokens if it met its deadline.
        duration: load duration (s) for goodput rates.

    Returns:
        ``{kind: {"n", "met", "attainment", "goodput_tokens", "goodput_tok_s", "goodput_req_s",
        "rejected", "errors", "unfinished", "p50_ttft", "p95_ttft", "p50_tbt", "p95_tbt", "p50_e2el",
        "p95_e2el", "met_output_tokens"}}`` for kinds ``chat``, ``deadline``, ``compound``, and for ``all``
        (attainment over all units) ``n``, ``met``, ``attainment``, the three goodputs, ``rejected``,
        ``failed_tasks`` and ``met_output_tokens``. Request goodput (``goodput_req_s``) counts units
        (requests, tasks) that met their SLO per second; ``met_output_tokens`` is the output tokens of
        the units that met it (a task's: every call's), the part of the engine's work that counted.
    """
    out: dict[str, dict[str, Any]] = {}
    for kind in ("chat", "deadline"):
        rs = [r for r in records if r.kind == kind]
        met = sum(r.slo_met for r in rs)
        gp = sum(r.goodput for r in rs)
        ttfts = [r.ttft for r in rs if r.ttft is not None]
        tbts = [r.tbt for r in rs if r.tbt is not None and r.status == "ok"]
        e2els = [r.e2el for r in rs if r.e2el is not None and r.status == "ok"]
        out[kind] = {
            "n": len(rs), "met": met, "attainment": met / len(rs) if rs else None,
            "goodput_tokens": gp, "goodput_tok_s": gp / duration, "goodput_req_s": met / duration,
            "rejected": sum(r.status == "rejected" for r in rs), "errors": sum(r.status == "error" for r in rs),
            "unfinished": sum(r.status == "unfinished" for r in rs),
            "p50_ttft": _pct(ttfts, 0.5), "p95_ttft": _pct(ttfts, 0.95),
            "p50_tbt": _pct(tbts, 0.5), "p95_tbt": _pct(tbts, 0.95),
            "p50_e2el": _pct(e2els, 0.5), "p95_e2el": _pct(e2els, 0.95),
            "met_output_tokens": sum(r.output_tokens for r in rs if r.slo_met),
        }
    met_t = [t for t in tasks if t.get("outcome") == "succeeded"]
    gp_t = sum(int(t.get("tokens") or 0) for t in met_t)
    el = [float(t["elapsed"]) for t in tasks if t.get("outcome") in ("succeeded", "deadline_missed")
          and t.get("elapsed") is not None and math.isfinite(float(t["elapsed"]))]
    out["compound"] = {
        "n": len(tasks), "met": len(met_t), "attainment": len(met_t) / len(tasks) if tasks else None,
        "goodput_tokens": gp_t, "goodput_tok_s": gp_t / duration, "goodput_req_s": len(met_t) / duration,
        "rejected": sum(t.get("outcome") == "rejected" for t in tasks),
        "errors": sum(t.get("outcome") == "failed" for t in tasks),
        "unfinished": sum(t.get("outcome") == "unfinished" for t in tasks),
        "deadline_missed": sum(t.get("outcome") == "deadline_missed" for t in tasks),
        "p50_ttft": None, "p95_ttft": None, "p50_tbt": None, "p95_tbt": None, "p50_e2el": _pct(el, 0.5), "p95_e2el": _pct(el, 0.95),
        "met_output_tokens": sum(int(s.get("output_tokens") or 0) for t in met_t for s in t.get("stages") or []),
    }
    n_all = sum(out[k]["n"] for k in KINDS)
    met_all = sum(out[k]["met"] for k in KINDS)
    gp_all = sum(out[k]["goodput_tokens"] for k in KINDS)
    out["all"] = {"n": n_all, "met": met_all, "attainment": met_all / n_all if n_all else None,
                  "goodput_tokens": gp_all, "goodput_tok_s": gp_all / duration, "goodput_req_s": met_all / duration,
                  "rejected": sum(out[k]["rejected"] for k in KINDS),
                  "failed_tasks": out["compound"]["errors"],
                  "met_output_tokens": sum(out[k]["met_output_tokens"] for k in KINDS)}
    return out



@dataclass
class RunResult:
    """One load run under one policy. ``generated_output_tokens``: every output token the server's engine
    generated during the run (its ``jitflow_output_tokens`` counter, rejected and abandoned calls
    included), None when it could not be read."""

    policy: str
    phase: str = ""
    records: list[ReqRecord] = field(default_factory=list)
    tasks: list[dict[str, Any]] = field(default_factory=list)
    wall: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)
    generated_output_tokens: int | None = None
