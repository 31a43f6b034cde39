"""Reports of ``jitflow bench sim``: the headline ratios (GMAX against the best other policy, the oracle,
FCFS) per load and seed, their mean over seeds with 95 % intervals, and ``results.json`` / ``results.md`` /
plots."""

from __future__ import annotations

import json
from pathlib import Path

ADMISSION_TEXT = {"shared": "the same waiting_time admission for every policy",
                  "jitserve": "waiting_time admission for the GMAX variants only, as in the JITServe paper",
                  "off": "no admission control"}
COMPOUND_TEXT = {"sub_deadline": "their stage's sub-deadline when later", "waiting_time": "the waiting_time"}


def headline(main: dict, rps_key: str, admission: str = "shared") -> dict:
    """GMAX against every other policy run at one load (the benchmark's targets).

    Keys: ``admission`` (how admission control was applied: ``shared`` = the same for every policy);
    ``best_other_token`` / ``best_other_request``: the other policy (not a GMAX variant, ablation or
    truth run) with the highest token / request goodput, and GMAX's ratios to them
    (``gmax_over_best_other_token``, ``gmax_request_over_best_other``); ``gmax_request_over_best_token_other``
    (GMAX's request goodput over that of the token winner); the oracle (``oracle_source`` names the
    run: GMAX with the truth, or the best other policy with the truth, whichever has the higher token
    goodput) and ``gmax_over_oracle``; throughput over FCFS; capacity over FCFS (``gmax-noadmit``)."""
    from jitflow_server.bench.runner import TRUTH, is_other_policy

    runs = main[rps_key]
    out: dict = {"rps": float(rps_key), "admission": admission}
    others = {p: r for p, r in runs.items() if is_other_policy(p)}
    g = runs.get("gmax")
    if g is not None and others:
        bt = max(others, key=lambda p: others[p]["token_goodput"])
        br = max(others, key=lambda p: others[p]["request_goodput"])
        out["best_other_token"], out["best_other_request"] = bt, br
        out["gmax_over_best_other_token"] = g["token_goodput"] / max(others[bt]["token_goodput"], 1e-9)
        out["gmax_request_over_best_other"] = g["request_goodput"] / max(others[br]["request_goodput"], 1e-9)
        out["gmax_request_over_best_token_other"] = g["request_goodput"] / max(others[bt]["request_goodput"], 1e-9)
    truths = {p: r for p, r in runs.items() if p == "oracle" or p.endswith(TRUTH)}
    if g is not None and truths:
        src = max(truths, key=lambda p: truths[p]["token_goodput"])
        out["oracle_source"] = src
        out["gmax_over_oracle"] = g["token_goodput"] / max(truths[src]["token_goodput"], 1e-9)
        out["gmax_request_over_oracle"] = g["request_goodput"] / max(
            max(r["request_goodput"] for r in truths.values()), 1e-9)
    if "gmax-age" in runs and others:
        best = max(others, key=lambda p: others[p]["token_goodput"])
        out["gmax_age_over_best_other_token"] = runs["gmax-age"]["token_goodput"] / max(others[best]["token_goodput"], 1e-9)
    if g is not None and "fcfs" in runs:
        out["gmax_throughput_over_fcfs"] = g["throughput"] / max(runs["fcfs"]["throughput"], 1e-9)
        gw, fw = g.get("throughput_window"), runs["fcfs"].get("throughput_window")
        if gw is not None and fw:
            out["gmax_window_throughput_over_fcfs"] = gw / fw
        gt, ft = g.get("token_throughput_window"), runs["fcfs"].get("token_throughput_window")
        if gt is not None and ft:
            out["gmax_window_token_throughput_over_fcfs"] = gt / ft
    fcfs_all = runs.get("fcfs-noadmit") or (runs["fcfs"] if "fcfs" in runs and runs["fcfs"].get("waiting_time") is None
                                            else None)
    if "gmax-noadmit" in runs and fcfs_all is not None:
        # same work as FCFS (no request rejected by either): the scheduler's cost in serving capacity
        out["gmax_capacity_over_fcfs"] = runs["gmax-noadmit"]["throughput"] / max(fcfs_all["throughput"], 1e-9)
    if fcfs_all is not None and fcfs_all.get("makespan_s"):
        # FCFS serving every job: jobs per second of makespan; the engine's capacity once the load exceeds it
        out["fcfs_completion_rps"] = fcfs_all["jobs"] / fcfs_all["makespan_s"]
    return out


def apply_capacity(headlines: dict) -> float | None:
    """Set ``capacity_rps`` and ``load_over_capacity`` on every load's headline from the top load's
    ``fcfs_completion_rps`` (FCFS serving every job of the heaviest load completes jobs at the engine's
    capacity; below capacity the completion rate is only the load). Returns the capacity (jobs/s) or None."""
    if not headlines:
        return None
    top = max(headlines, key=float)
    cap = headlines[top].get("fcfs_completion_rps")
    if not cap:
        return None
    for h in headlines.values():
        h["capacity_rps"] = cap
        h["load_over_capacity"] = h["rps"] / cap
    return cap


def aggregate_headlines(heads: list[dict]) -> dict:
    """Mean of per-seed :func:`headline` dicts, with ``<key>_ci95`` (95 % t-interval half-width) for
    every ratio, the best other policies and the oracle's source as the most frequent ones (with
    ``<name>_per_seed``) and ``seeds`` = len(heads). Ratios are
    averaged per seed (each seed's ratio is measured side by side on one workload)."""
    from collections import Counter

    from jitflow_server.bench.metrics import ci95

    out: dict = {"rps": heads[0]["rps"], "seeds": len(heads), "admission": heads[0].get("admission")}
    names = ("best_other_token", "best_other_request", "oracle_source")
    for name in names:
        vals = [h[name] for h in heads if name in h]
        if vals:  # the most frequent one; the ratios are each seed's own
            out[name] = Counter(vals).most_common(1)[0][0]
            out[name + "_per_seed"] = vals
    keys = [k for k in heads[0] if k not in ("rps", "admission", *names) and all(k in h for h in heads)]
    for k in keys:
        vals = [float(h[k]) for h in heads]
        out[k] = sum(vals) / len(vals)
        out[f"{k}_ci95"] = ci95(vals)
    return out


def fmt(x, nd: int = 2) -> str:
    """A number for a table: ``nd`` decimals for floats, ``–`` for None."""
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _fci(d: dict, key: str, nd: int = 2) -> str:
    """``d[key]`` formatted, with ``± <key>_ci95`` when the run had several seeds."""
    v, ci = d.get(key), d.get(f"{key}_ci95")
    if v is None:
        return "–"
    return f"{v:.{nd}f} ± {ci:.{nd}f}" if ci is not None else fmt(v, nd)


def write_sim_report(res: dict, out: Path, command: str) -> list[Path]:
    """Write ``results.json``, ``results.md`` and the plots into ``out``; returns the plot paths."""
    from jitflow_server.bench import plots
    from jitflow_server.bench.runner import is_gmax_family

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    cfg = res["config"]
    figs = [plots.plot_goodput_vs_rps(res, out), plots.plot_oracle(res, out), plots.plot_throughput(res, out)]
    top = str(max(cfg["rps"]))
    figs.append(plots.plot_latency(res, out, top))
    L = [f"# Simulated benchmark ({cfg['preset']})", "", f"Command: `{command}`", "",
         f"{cfg['requests']} requests per load, mix {cfg['mix']} (latency:deadline:compound), arrivals "
         f"{cfg['arrivals']}, SLO tightness {cfg['tightness']}, length bounds `{cfg['length_bound']}` "
         f"({cfg.get('length_bound_reason', '')}), analyzer "
         f"`{cfg['analyzer']}`, B = {cfg['batch_size']}, waiting_time {cfg['waiting_time']} s "
         f"(admission `{cfg.get('admission')}`: {ADMISSION_TEXT.get(cfg.get('admission'), '?')}; compound calls "
         f"wait up to {COMPOUND_TEXT.get(cfg.get('compound_waiting', 'waiting_time'), '?')}), length scale "
         f"{cfg['length_scale']}, seed {cfg['seed']}, δ aged from arrival for all GMAX variants: "
         f"{cfg.get('age_boost', False)}. Data: {cfg['data']}. Wall time {res['wall_s']:.0f} s.", ""]
    n_seeds = cfg.get("seeds", 1)
    if n_seeds > 1:
        L += [f"Main grid repeated on {n_seeds} workload seeds ({cfg['seed']} … {cfg['seed'] + n_seeds - 1}): "
              "values are means, `±` the 95 % t-interval half-width of the mean; ratios are taken per seed "
              "(side by side on one workload) and then averaged. Ablation and sweeps: seed "
              f"{cfg['seed']} only.", ""]
    L += ["## Headline (targets)", "",
          f"Admission: `{cfg.get('admission')}` ({ADMISSION_TEXT.get(cfg.get('admission'), '?')}). "
          "GMAX is compared with the best *other* policy at each load, separately for token goodput (SLO-meeting "
          "tokens/s) and request goodput (SLO-meeting requests/s: a compound task counts once), so a win on one "
          "that loses the other shows. The oracle is the better of GMAX and the best other policy, each given the "
          "true output lengths and task graphs. `capacity / FCFS`: `gmax-noadmit` (GMAX without admission "
          "control) serves the same requests as FCFS, so the ratio of makespan throughputs is what GMAX's "
          "ordering and preemptions cost in serving capacity.", "",
          "| RPS (× capacity) | GMAX / best other (token) | best other (token) | GMAX / best other (request) | "
          "best other (request) | GMAX / oracle (token) | oracle run | GMAX throughput / FCFS | "
          "GMAX capacity / FCFS (same work) |",
          "|---:|---:|---|---:|---|---:|---|---:|---:|"]
    for k, h in res["headline"].items():
        xc = f" ({h['load_over_capacity']:.1f}×)" if h.get("load_over_capacity") else ""
        L.append(f"| {k}{xc} | {_fci(h, 'gmax_over_best_other_token')} | {h.get('best_other_token', '–')} | "
                 f"{_fci(h, 'gmax_request_over_best_other')} | {h.get('best_other_request', '–')} | "
                 f"{_fci(h, 'gmax_over_oracle')} | {h.get('oracle_source', '–')} | "
                 f"{_fci(h, 'gmax_throughput_over_fcfs')} | {_fci(h, 'gmax_capacity_over_fcfs')} |")
    L += ["", "## Goodput, throughput and SLO attainment per policy and load", "",
          "| RPS | policy | token goodput (tok/s) | request goodput (req/s) | SLO att. | att. latency | att. deadline | "
          "att. compound | throughput (tok/s) | output in SLO | steady-state thr. (tok/s) | "
          "steady-state prompt+output (tok/s) | rejected | preempt. | frame P50/P99 ms |",
          "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for k, runs in res["main"].items():
        for p, r in runs.items():
            pk = r["per_kind"]
            L.append(f"| {k} | {p} | {_fci(r, 'token_goodput', 0)} | {_fci(r, 'request_goodput', 3)} | "
                     f"{r['slo_attainment']:.2f} | "
                     f"{fmt(pk.get('latency', {}).get('slo_attainment'))} | "
                     f"{fmt(pk.get('deadline', {}).get('slo_attainment'))} | "
                     f"{fmt(pk.get('compound', {}).get('slo_attainment'))} | {r['throughput']:.0f} | "
                     f"{fmt(r.get('met_output_share'))} | {fmt(r.get('throughput_window'), 0)} | {fmt(r.get('token_throughput_window'), 0)} | "
                     f"{r['rejected']:.0f} | {r['sim_preemptions']:.0f} | {fmt(r.get('frame_ms_p50'))}/{fmt(r.get('frame_ms_p99'))} |")
    L += ["", f"## Latency per kind at {top} requests/s (P50 / P95, seconds, served requests)", "",
          "| policy | TTFT lat. | TBT lat. | E2EL deadline | TTFT deadline | E2EL compound |", "|---|---|---|---|---|---|"]
    for p, r in res["main"][top].items():
        pk = r["per_kind"]

        def pp(kind: str, m: str, pk=pk) -> str:
            d = pk.get(kind, {})
            return f"{fmt(d.get(m + '_p50'))} / {fmt(d.get(m + '_p95'))}"

        L.append(f"| {p} | {pp('latency', 'ttft')} | {pp('latency', 'tbt')} | {pp('deadline', 'e2el')} | "
                 f"{pp('deadline', 'ttft')} | {pp('compound', 'e2el')} |")
    if "ablation" in res:
        ab = res["ablation"]
        rows = {k: v["token_goodput"] for k, v in ab["runs"].items()}
        figs.append(plots.plot_bars(rows, out, "ablation.png", f"Ablation at {ab['rps']} requests/s (Fig. 17)",
                                    "token goodput (tokens/s)"))
        L += ["", f"## Ablation at {ab['rps']} requests/s (Fig. 17)", "",
              "`gmax-noanalyzer`: GMAX with average-based lengths and equal-share sub-deadlines; "
              "`sjf-analyzer`: SJF on the analyzer's estimates (\"w/o GMAX\").", "",
              "| variant | token goodput | request goodput | SLO att. |", "|---|---:|---:|---:|"]
        for k, v in ab["runs"].items():
            L.append(f"| {k} | {v['token_goodput']:.0f} | {v['request_goodput']:.3f} | {v['slo_attainment']:.2f} |")
    for key, fname, title, xl, cat in (("tightness", "tightness.png", "SLO tightness sweep (Figs. 19/21)",
                                        "SLO scale factor (1 = paper SLOs)", False),
                                       ("mix", "mix.png", "Workload mix sweep (Fig. 20)",
                                        "mix latency:deadline:compound", True)):
        if key not in res:
            continue
        sw = res[key]
        figs.append(plots.plot_sweep(sw["runs"], out, fname, f"{title}, {sw['rps']} req/s, {sw['requests']} requests",
                                     xl, categorical=cat))
        pols = list(next(iter(sw["runs"].values())))
        L += ["", f"## {title} at {sw['rps']} requests/s ({sw['requests']} requests): token goodput (tok/s)", "",
              "| " + key + " | " + " | ".join(pols) + " | GMAX variants / best baseline |",
              "|---|" + "---:|" * (len(pols) + 1)]
        for x, runs in sw["runs"].items():
            vals = [runs[p]["token_goodput"] for p in pols]
            others = [runs[p]["token_goodput"] for p in pols if not is_gmax_family(p)]
            ratios = [f"{q}: {runs[q]['token_goodput'] / max(max(others), 1e-9):.2f}" for q in pols
                      if is_gmax_family(q)] if others else []
            L.append(f"| {x} | " + " | ".join(f"{v:.0f}" for v in vals) + f" | {', '.join(ratios) or '–'} |")
    if "scaling" in res:
        sc = res["scaling"]
        pols = list(next(iter(sc["runs"].values())))
        L += ["", f"## Simulator cost at {sc['rps']} requests/s: wall seconds (µs per request)", "",
              "Cost per request that stays flat as the workload grows means the cost is linear in its size.", "",
              "| requests | " + " | ".join(pols) + " |", "|---:|" + "---:|" * len(pols)]
        for n, runs in sc["runs"].items():
            L.append(f"| {n} | " + " | ".join(f"{runs[p]['wall_s']:.1f} ({runs[p]['us_per_request']:.0f})"
                                              for p in pols) + " |")
    L += ["", "Plots: " + ", ".join(f"`{p.name}`" for p in figs if p is not None), ""]
    (out / "results.md").write_text("\n".join(L))
    return [p for p in figs if p is not None]
