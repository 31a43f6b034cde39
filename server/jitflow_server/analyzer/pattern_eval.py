"""Evaluation of pattern matching and sub-deadline shares (JITServe Fig. 7 and App. B).

Used by ``jitflow analyzer eval-patterns``. Protocol (documented in ``docs/analyzer.md``):

* History graphs go into a real :class:`~jitflow_server.store.history.HistoryStore` (SQLite
  file in a temporary directory), clustered with K-medoids; held-out *test* tasks are
  replayed stage by stage: before stage ``k`` runs (``k`` stages observed, stage ``k``'s
  calls issued with their input lengths and identities, outputs unknown) the partial
  graph is matched and the matched graph's ratios for stage ``k`` are compared with the
  test task's own ratios (both under the same :class:`CallTimeModel`).
* Relative error ``|est - true| / true`` of

  - ``accumulated``: φ(k) = t_{≤k}/t_total (ours, JITServe §4.1),
  - ``stage_over_total``: t_k/t_total,
  - ``stage_over_remaining``: t_k/t_{≥k} (App. B alternatives),

  plus the equal-share fallback ``min(1, (k+1)/E)`` (E = median stage count of history)
  for reference, and a *sub-deadline error* in units of D under proportional pacing
  (the task is at ``T0 + φ_true(k-1)·D`` when stage k starts; each formulation's deadline
  for stage k vs the ideal ``T0 + φ_true(k)·D``).
* Fig. 7(a): histories of 50 ... 5,000 graphs. Sizes up to the real history are random
  subsets; larger ones are the real history plus resampled copies: a uniformly drawn real
  graph whose every call gets its input and output lengths multiplied by independent
  log-normal factors ``exp(N(0, jitter²))`` (default jitter 0.15), rounded, outputs clipped
  to ``[1, max output in history]`` and inputs to ``>= 1``. Latency = wall time of
  ``Matcher.match`` (no bump) on a freshly built partial graph, per query, P50/P99.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jitflow_server.analyzer.clustering import cluster_history
from jitflow_server.analyzer.matcher import Matcher
from jitflow_server.analyzer.subdeadline import CallTimeModel, share_formulations
from jitflow_server.store.graph import CallNode, PatternGraph
from jitflow_server.store.history import HistoryStore

__all__ = ["jitter_graph", "build_history", "replay", "evaluate", "write_report", "FORMULATIONS"]

FORMULATIONS = ("accumulated", "stage_over_total", "stage_over_remaining")
DEFAULT_SIZES = (50, 100, 200, 500, 1000, 2000, 5000)


def jitter_graph(g: PatternGraph, rng: np.random.Generator, sigma: float, out_cap: int) -> PatternGraph:
    """Copy of ``g`` with each call's input/output tokens scaled by ``exp(N(0, sigma²))`` (rounded,
    outputs clipped to ``[1, out_cap]``, inputs ``>= 1``); recorded times scaled with the output."""
    nodes = []
    for n in g.nodes:
        fi, fo = np.exp(rng.normal(0.0, sigma, size=2))
        i_len = max(1, int(round(n.input_len * fi))) if n.input_len else 0
        o_len = None if n.output_len is None else min(out_cap, max(1, int(round(n.output_len * fo))))
        dur = None if n.duration is None else n.duration * fo
        nodes.append(CallNode(n.node_id, n.kind, n.name, i_len, o_len, None, None, dur, list(n.parents), n.stage))
    return PatternGraph(g.app, nodes, g.stage_names, outcome=g.outcome, task_id=f"{g.task_id}~")


def build_history(
    real: Sequence[PatternGraph], size: int, rng: np.random.Generator, sigma: float = 0.15
) -> list[PatternGraph]:
    """``size`` graphs: a random subset of ``real`` if ``size <= len(real)``, else all of ``real``
    plus ``size - len(real)`` jittered resamples (see :func:`jitter_graph`). Raises ValueError if
    ``real`` is empty."""
    if not real:
        raise ValueError("empty history")
    if size <= len(real):
        idx = rng.choice(len(real), size=size, replace=False)
        return [real[int(i)] for i in sorted(idx)]
    cap = max(int(n.output_len or 0) for g in real for n in g.nodes) or 1
    extra = [jitter_graph(real[int(rng.integers(len(real)))], rng, sigma, cap) for _ in range(size - len(real))]
    return list(real) + extra


def _queries(test: Sequence[PatternGraph]) -> list[tuple[int, int]]:
    return [(t, k) for t, g in enumerate(test) for k in range(g.n_stages)]


def replay(
    matcher: Matcher,
    test: Sequence[PatternGraph],
    time_model: CallTimeModel,
    *,
    expected_stages: int | None = None,
    strategy: str | None = None,
    top_k: int = 1,
) -> dict[str, Any]:
    """Replay every test task stage by stage against ``matcher``.

    Returns a dict with per-query arrays: ``k`` (stages observed), ``n_stages``, ``latency_s``,
    ``matched`` (bool), ``relerr[form]``, ``dl_err[form]`` (sub-deadline error / D), and
    ``relerr_equal`` (equal-share fallback; NaN if ``expected_stages`` is None). Unmatched
    queries use the fallback for all formulations (φ = equal share; the others: 1/E, 1/(E-k)).
    With ``top_k > 1`` the accumulated share is the neighbours' ensemble (:meth:`Match.shares`);
    the two alternatives always come from the best match.
    """
    truths = [share_formulations(g, time_model) for g in test]
    ks, ns, lat, matched = [], [], [], []
    rel: dict[str, list[float]] = {f: [] for f in FORMULATIONS}
    dle: dict[str, list[float]] = {f: [] for f in FORMULATIONS}
    rel_eq: list[float] = []
    cache: dict[int, dict[str, np.ndarray]] = {}
    for t, k in _queries(test):
        g = test[t]
        partial = g.prefix(k, open_next=True)
        t1 = time.perf_counter()
        m = matcher.match(partial, bump=False, strategy=strategy, top_k=top_k)
        t2 = time.perf_counter()
        tr = truths[t]
        e = expected_stages or g.n_stages
        if m is not None and k < m.graph.n_stages:
            key = id(m.graph)
            if key not in cache:
                cache[key] = share_formulations(m.graph, time_model)
            est = {f: float(cache[key][f][k]) for f in FORMULATIONS}
            if top_k > 1:
                phis = m.shares(time_model)
                est["accumulated"] = float(phis[k]) if k < len(phis) else 1.0
        else:
            est = {
                "accumulated": min(1.0, (k + 1) / e),
                "stage_over_total": 1.0 / e,
                "stage_over_remaining": 1.0 / max(1, e - k),
            }
        prev = float(tr["accumulated"][k - 1]) if k > 0 else 0.0
        ideal = float(tr["accumulated"][k])
        deadline_est = {
            "accumulated": est["accumulated"],
            "stage_over_total": prev + est["stage_over_total"],
            "stage_over_remaining": prev + est["stage_over_remaining"] * (1.0 - prev),
        }
        for f in FORMULATIONS:
            truth = float(tr[f][k])
            rel[f].append(abs(est[f] - truth) / truth if truth > 0 else 0.0)
            dle[f].append(abs(min(1.0, deadline_est[f]) - ideal))
        if expected_stages:
            phi_eq = min(1.0, (k + 1) / expected_stages)
            rel_eq.append(abs(phi_eq - ideal) / ideal)
        else:
            rel_eq.append(math.nan)
        ks.append(k)
        ns.append(g.n_stages)
        lat.append(t2 - t1)
        matched.append(m is not None)
    return {
        "k": np.array(ks), "n_stages": np.array(ns), "latency_s": np.array(lat), "matched": np.array(matched),
        "relerr": {f: np.array(v) for f, v in rel.items()}, "dl_err": {f: np.array(v) for f, v in dle.items()},
        "relerr_equal": np.array(rel_eq),
    }


def _summ(x: np.ndarray) -> dict[str, float]:
    x = x[~np.isnan(x)]
    if len(x) == 0:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "n": 0}
    return {"mean": float(x.mean()), "p50": float(np.percentile(x, 50)), "p90": float(np.percentile(x, 90)),
            "n": int(len(x))}


def _by_k(r: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for k in sorted(set(r["k"].tolist())):
        sel = r["k"] == k
        row: dict[str, Any] = {"stages_observed": int(k), "queries": int(sel.sum())}
        for f in FORMULATIONS:
            row[f] = _summ(r["relerr"][f][sel])
            row[f"{f}_deadline_err"] = _summ(r["dl_err"][f][sel])
        row["equal_share"] = _summ(r["relerr_equal"][sel])
        # queries where the task is not yet at its last stage (the paper's "next stage" view)
        out.append(row)
    return out


def _store_with(graphs: Sequence[PatternGraph], tmp: Path, name: str, cluster: bool) -> HistoryStore:
    st = HistoryStore(tmp / f"{name}.sqlite", capacity=max(10, len(graphs) + 10))
    st.insert_many(graphs)
    if cluster:
        cluster_history(st)
    return st


def _strip_names(gs: Sequence[PatternGraph]) -> list[PatternGraph]:
    return [PatternGraph(g.app, g.nodes, [""] * g.n_stages, outcome=g.outcome, task_id=g.task_id) for g in gs]


def evaluate(
    history: Sequence[PatternGraph],
    test: Sequence[PatternGraph],
    *,
    time_model: CallTimeModel,
    sizes: Sequence[int] = DEFAULT_SIZES,
    jitter: float = 0.15,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the whole evaluation (see the module docstring); returns the JSON-able result.

    Raises:
        ValueError: empty history or test set, or no common app.
    """
    if not history or not test:
        raise ValueError("history and test sets must be non-empty")
    apps = {g.app for g in history}
    test = [g for g in test if g.app in apps]
    if not test:
        raise ValueError(f"no test graph belongs to a history app ({sorted(apps)})")
    say = progress or (lambda s: None)
    rng = np.random.default_rng(seed)
    res: dict[str, Any] = {
        "time_model": {
            "prefill_s_per_token": time_model.prefill_s_per_token,
            "decode_s_per_token": time_model.decode_s_per_token,
            "call_overhead_s": time_model.call_overhead_s,
        },
        "n_history": len(history), "n_test": len(test), "seed": seed, "jitter_sigma": jitter,
        "bytes_per_graph": {
            "binary_mean": float(np.mean([len(g.to_bytes()) for g in history])),
            "binary_max": int(max(len(g.to_bytes()) for g in history)),
            "jsonl_mean": float(np.mean([len(g.to_json().encode()) + 1 for g in history])),
        },
    }
    with tempfile.TemporaryDirectory(prefix="jitflow-pattern-eval-") as td:
        tmp = Path(td)
        # ---- main replay on the real history (Fig. 7b, App. B)
        say("replay on the real history")
        store = _store_with(history, tmp, "real", cluster=True)
        expected = store.typical_stages(next(iter(apps)))
        r = replay(Matcher(store, bump=False, strategy="exhaustive"), test, time_model, expected_stages=expected)
        store.close()
        res["expected_stages_fallback"] = expected
        res["matched_fraction"] = float(r["matched"].mean())
        res["overall"] = {f: _summ(r["relerr"][f]) for f in FORMULATIONS}
        res["overall"]["equal_share"] = _summ(r["relerr_equal"])
        res["overall_deadline_err"] = {f: _summ(r["dl_err"][f]) for f in FORMULATIONS}
        nl = r["k"] < r["n_stages"] - 1  # stages before the last (the last is trivially 1 for φ and t_s/t_≥s)
        res["overall_excluding_last"] = {f: _summ(r["relerr"][f][nl]) for f in FORMULATIONS}
        res["overall_excluding_last"]["equal_share"] = _summ(r["relerr_equal"][nl])
        res["by_stages_observed"] = _by_k(r)
        say("replay with a top-10 ensemble")
        store = _store_with(history, tmp, "real10", cluster=False)
        re_ = replay(Matcher(store, bump=False, strategy="exhaustive"), test, time_model, expected_stages=expected,
                     top_k=10)
        store.close()
        res["ensemble_top10"] = {
            "overall": _summ(re_["relerr"]["accumulated"]),
            "overall_excluding_last": _summ(re_["relerr"]["accumulated"][re_["k"] < re_["n_stages"] - 1]),
            "deadline_err": _summ(re_["dl_err"]["accumulated"]),
            "by_stages_observed": [{"stages_observed": row["stages_observed"], "accumulated": row["accumulated"]}
                                   for row in _by_k(re_)],
        }
        res["latency_real_history_s"] = {
            "p50": float(np.percentile(r["latency_s"], 50)), "p99": float(np.percentile(r["latency_s"], 99))}
        # ---- variant without stage names (identity = model ids only)
        say("replay without stage names")
        store = _store_with(_strip_names(history), tmp, "anon", cluster=False)
        ra = replay(Matcher(store, bump=False, strategy="exhaustive"), _strip_names(test), time_model,
                    expected_stages=expected)
        store.close()
        res["anonymous_stages"] = {
            "overall": {f: _summ(ra["relerr"][f]) for f in FORMULATIONS},
            "overall_excluding_last": {f: _summ(ra["relerr"][f][ra["k"] < ra["n_stages"] - 1])
                                       for f in FORMULATIONS},
            "by_stages_observed": [
                {"stages_observed": row["stages_observed"], "accumulated": row["accumulated"]} for row in _by_k(ra)],
        }
        # ---- Fig. 7(a): history size sweep
        sweep = []
        for n in sizes:
            say(f"history size {n}")
            hist = build_history(history, int(n), rng, jitter)
            t_build = time.perf_counter()
            store = _store_with(hist, tmp, f"n{n}", cluster=True)
            build_s = time.perf_counter() - t_build
            row: dict[str, Any] = {"size": int(n), "build_and_cluster_s": build_s,
                                   "expected_stages": store.typical_stages(next(iter(apps)))}
            for strat in ("exhaustive", "cluster"):
                m = Matcher(store, bump=False, strategy=strat)
                m.match(test[0].prefix(1, open_next=True))  # warm the in-memory index
                rr = replay(m, test, time_model, expected_stages=row["expected_stages"])
                row[strat] = {
                    "latency_p50_ms": float(np.percentile(rr["latency_s"], 50) * 1e3),
                    "latency_p99_ms": float(np.percentile(rr["latency_s"], 99) * 1e3),
                    "relerr_accumulated_mean": float(rr["relerr"]["accumulated"].mean()),
                    "relerr_accumulated_excl_last_mean": float(
                        rr["relerr"]["accumulated"][rr["k"] < rr["n_stages"] - 1].mean()),
                    "matched_fraction": float(rr["matched"].mean()),
                }
                if strat == "exhaustive":
                    re10 = replay(m, test, time_model, expected_stages=row["expected_stages"], top_k=10)
                    row[strat]["relerr_accumulated_top10_mean"] = float(re10["relerr"]["accumulated"].mean())
            # cost of a reuse-weight bump (one SQLite UPDATE), measured separately
            ids = store.ids()[:200]
            tb = time.perf_counter()
            for gid in ids:
                store.bump(gid)
            row["bump_ms"] = (time.perf_counter() - tb) / max(1, len(ids)) * 1e3
            store.close()
            sweep.append(row)
        res["history_size_sweep"] = sweep
    return res


def _label(ax: Any, xlabel: str, ylabel: str, title: str | None = None, log_x: bool = False) -> None:
    """Axis labels, an optional title, a log x axis, the legend and a light grid on one of the report's plots."""
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _save(fig: Any, path: Path) -> Path:
    """Lay out, write (120 dpi) and close ``fig``; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(res: dict[str, Any], out: Path, command: str) -> list[Path]:
    """Write ``pattern_eval.json``, ``pattern_eval.md`` and the plots into ``out``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    res = {**res, "command": command}
    paths = []
    p = out / "pattern_eval.json"
    p.write_text(json.dumps(res, indent=2, allow_nan=True))
    paths.append(p)

    sw = res["history_size_sweep"]
    sizes = [r["size"] for r in sw]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for strat, mk in (("exhaustive", "o"), ("cluster", "s")):
        a1.plot(sizes, [r[strat]["latency_p50_ms"] for r in sw], marker=mk, label=f"{strat} P50")
        a1.plot(sizes, [r[strat]["latency_p99_ms"] for r in sw], marker=mk, ls="--", label=f"{strat} P99")
        a2.plot(sizes, [r[strat]["relerr_accumulated_mean"] for r in sw], marker=mk, label=f"{strat}, best match")
    a2.plot(sizes, [r["exhaustive"]["relerr_accumulated_top10_mean"] for r in sw], marker="^", ls="--",
            label="exhaustive, top-10 ensemble")
    _label(a1, "history size (graphs)", "matching latency (ms)", log_x=True)
    _label(a2, "history size (graphs)", "mean relative error of φ(current stage)", log_x=True)
    fig.suptitle("Fig. 7(a): impact of history size")
    paths.append(_save(fig, out / "fig7a_history_size.png"))

    bk = res["by_stages_observed"]
    ks = [r["stages_observed"] for r in bk]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.plot(ks, [r["accumulated"]["mean"] for r in bk], marker="o", color="tab:orange", label="φ matched (mean)")
    ax.fill_between(ks, [r["accumulated"]["p50"] for r in bk], [r["accumulated"]["p90"] for r in bk],
                    color="tab:orange", alpha=0.2, label="P50–P90")
    ens = {r["stages_observed"]: r["accumulated"]["mean"] for r in res["ensemble_top10"]["by_stages_observed"]}
    ax.plot(ks, [ens.get(k, math.nan) for k in ks], marker="^", color="tab:red", ls="--",
            label="φ top-10 ensemble (mean)")
    ax.plot(ks, [r["equal_share"]["mean"] for r in bk], marker="x", color="gray", ls=":",
            label="equal shares (no history)")
    _label(ax, "stages observed (current stage index)", "relative error of current-stage φ",
           "Fig. 7(b): online matching")
    paths.append(_save(fig, out / "fig7b_online_matching.png"))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = {"accumulated": "t≤s/t_total (ours)", "stage_over_total": "t_s/t_total",
              "stage_over_remaining": "t_s/t≥s"}
    colors = {"accumulated": "tab:orange", "stage_over_total": "tab:blue", "stage_over_remaining": "tab:green"}
    for f in FORMULATIONS:
        a1.plot(ks, [r[f]["mean"] for r in bk], marker="o", color=colors[f], label=labels[f])
        a2.plot(ks, [r[f"{f}_deadline_err"]["mean"] for r in bk], marker="o", color=colors[f], label=labels[f])
    _label(a1, "stages observed", "mean relative error of the ratio", "App. B: estimation error")
    _label(a2, "stages observed", "mean |sub-deadline - ideal| / D", "sub-deadline error (proportional pacing)")
    paths.append(_save(fig, out / "appB_formulations.png"))

    lines = [
        "# Pattern matching and sub-deadline evaluation", "", f"Command: `{command}`", "",
        f"History {res['n_history']} graphs, test {res['n_test']} tasks; time model "
        f"prefill {res['time_model']['prefill_s_per_token'] * 1e3:.3g} ms/token, decode "
        f"{res['time_model']['decode_s_per_token'] * 1e3:.3g} ms/token. Bytes per graph: binary "
        f"{res['bytes_per_graph']['binary_mean']:.0f} (max {res['bytes_per_graph']['binary_max']}), JSONL "
        f"{res['bytes_per_graph']['jsonl_mean']:.0f}.", "",
        "## App. B: relative error (all held-out stages / excluding the last stage)", "",
        "| formulation | mean | P50 | P90 | mean excl. last | sub-deadline err / D |", "|---|---|---|---|---|---|",
    ]
    for f in FORMULATIONS:
        o, x, d = res["overall"][f], res["overall_excluding_last"][f], res["overall_deadline_err"][f]
        lines.append(f"| {labels[f]} | {o['mean']:.3f} | {o['p50']:.3f} | {o['p90']:.3f} | {x['mean']:.3f} | "
                     f"{d['mean']:.3f} |")
    eq = res["overall"]["equal_share"]
    lines.append(f"| equal shares φ (no history) | {eq['mean']:.3f} | {eq['p50']:.3f} | {eq['p90']:.3f} | "
                 f"{res['overall_excluding_last']['equal_share']['mean']:.3f} | |")
    e10 = res["ensemble_top10"]
    lines.append(f"| φ, top-10 ensemble (extension) | {e10['overall']['mean']:.3f} | {e10['overall']['p50']:.3f} | "
                 f"{e10['overall']['p90']:.3f} | {e10['overall_excluding_last']['mean']:.3f} | "
                 f"{e10['deadline_err']['mean']:.3f} |")
    lines += ["", "## Fig. 7(b): φ relative error by stages observed", "",
              "| stages observed | queries | φ mean | φ P50 | φ P90 | φ top-10 mean | equal shares |",
              "|---|---|---|---|---|---|---|"]
    for r in bk:
        lines.append(f"| {r['stages_observed']} | {r['queries']} | {r['accumulated']['mean']:.3f} | "
                     f"{r['accumulated']['p50']:.3f} | {r['accumulated']['p90']:.3f} | "
                     f"{ens.get(r['stages_observed'], math.nan):.3f} | {r['equal_share']['mean']:.3f} |")
    lines += ["", "## Fig. 7(a): history size", "",
              "| size | exhaustive P50 ms | P99 ms | cluster P50 ms | P99 ms | φ err (exh.) | φ err (cluster) |"
              " φ err (top-10) | bump ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sw:
        e, c = r["exhaustive"], r["cluster"]
        lines.append(f"| {r['size']} | {e['latency_p50_ms']:.3f} | {e['latency_p99_ms']:.3f} | "
                     f"{c['latency_p50_ms']:.3f} | {c['latency_p99_ms']:.3f} | {e['relerr_accumulated_mean']:.3f} | "
                     f"{c['relerr_accumulated_mean']:.3f} | {e['relerr_accumulated_top10_mean']:.3f} | "
                     f"{r['bump_ms']:.3f} |")
    an = res["anonymous_stages"]
    lines += ["", "## Without stage names (identity = model id only)", "",
              "| formulation | mean | mean excl. last |", "|---|---|---|"]
    for f in FORMULATIONS:
        lines.append(f"| {labels[f]} | {an['overall'][f]['mean']:.3f} | {an['overall_excluding_last'][f]['mean']:.3f} |")
    p = out / "pattern_eval.md"
    p.write_text("\n".join(lines) + "\n")
    paths.append(p)
    return paths
