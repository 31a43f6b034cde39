"""``jitflow bench sim``: the simulated evaluation: policies × loads, oracle, ablation,
SLO-tightness and workload-mix sweeps; writes ``results.json``, ``results.md`` and plots."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer

DEFAULT_POLICIES = "gmax,fcfs,sarathi,sjf,las,edf,slos-serve,qlm,tempo,vllm-priority,oracle"
PRESET_DEFAULTS = {
    # loads from below to 2× the preset's capacity on the 1:1:1 mix (capacity_rps in the headline: 1.3 req/s)
    "a100-llama8b": {"rps": "1,1.3,2,2.6", "length_scale": 1.0, "max_context": None},
    "cpu-demo": {"rps": "0.5,1,2,3,4", "length_scale": 0.0625, "max_context": 8000},
    "cpu-demo-avx512": {"rps": "2,4,6,10,14", "length_scale": 0.0625, "max_context": 8000},
}
SWEEP_POLICIES = ("gmax", "sarathi", "edf", "sjf", "las", "tempo", "slos-serve")
ABLATION = ("oracle", "gmax", "gmax-noanalyzer", "sjf-analyzer", "sarathi")  # JITServe Fig. 17


ADMISSION_TEXT = {"shared": "the same waiting_time admission for every policy",
                  "jitserve": "waiting_time admission for the GMAX variants only, as in the JITServe paper",
                  "off": "no admission control"}


def parse_floats(text: str, name: str) -> list[float]:
    """Comma-separated positive floats; raises ``typer.BadParameter`` naming ``name``."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{name} must be comma-separated numbers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise typer.BadParameter(f"{name} needs positive numbers, got {text!r}")
    return vals


def resolve_data(data: Optional[Path]) -> Optional[Path]:
    """``--data`` or the default ``../shared/data`` (None when absent: built-in distributions)."""
    from jitflow_server.bench.workload import default_data_dir

    if data is not None:
        if not data.is_dir():
            raise typer.BadParameter(f"{data} is not a directory", param_hint="--data")
        return data
    return default_data_dir()


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
        # FCFS serving every job: jobs per second of makespan is the engine's capacity on this workload
        out["capacity_rps"] = fcfs_all["jobs"] / fcfs_all["makespan_s"]
        out["load_over_capacity"] = out["rps"] / out["capacity_rps"]
    return out


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


def run_sim_bench(preset: str, policies: list[str], rps_list: list[float], n_requests: int, seed: int,
                  data_dir: Optional[Path], arrivals: str, mix: str, tightness: float, length_bound: str,
                  analyzer: str, batch_size: Optional[int], waiting_time: float, length_scale: Optional[float],
                  ablation: bool, tightness_list: list[float], mixes: list[str], sweep_requests: int,
                  sweep_rps: Optional[float], gmax_params: dict, progress=None,
                  admission: str = "shared", age_boost: bool = False, seeds: int = 1,
                  scaling: tuple[int, ...] = (), trace: Optional[Path] = None) -> dict:
    """Run every simulation of ``jitflow bench sim`` and return the results dict (see module docstring).

    ``seeds`` > 1 repeats the policy × load grid on workloads of seeds ``seed … seed+seeds−1``
    (arrivals, lengths and length-bound noise change): ``main`` then holds the mean of each metric
    (:func:`~jitflow_server.bench.metrics.mean_runs`), ``headline`` the mean ratio with its 95 %
    interval (:func:`aggregate_headlines`) and ``per_seed`` the main metrics of every run. The
    ablation and the sweeps run on ``seed`` only. ``trace`` replays a Mooncake JSONL or Azure CSV trace
    (:func:`~jitflow_server.bench.traces.trace_workload`): its first ``n_requests`` rows, arrivals rescaled to
    each load, kinds drawn with ``mix`` and the seed (``arrivals`` is then unused). ``scaling`` lists workload sizes (requests) simulated at the
    top load under every policy, timing each run (``scaling`` in the results: wall s and µs per request)."""
    from dataclasses import replace

    from jitflow_server.bench.metrics import mean_runs
    from jitflow_server.bench.presets import load_preset
    from jitflow_server.bench.runner import TRUTH, RunSettings, is_other_policy, run_sim_one
    from jitflow_server.bench.workload import DataSources, make_workload, parse_mix, workload_summary

    model = load_preset(preset)
    dflt = PRESET_DEFAULTS.get(model.name, {"length_scale": 1.0, "max_context": None})
    ls = length_scale if length_scale is not None else dflt["length_scale"]
    data = DataSources.load(data_dir)
    st = RunSettings(analyzer=analyzer, length_bound=length_bound, batch_size=batch_size,
                     waiting_time=waiting_time if waiting_time > 0 else None, length_scale=ls, seed=seed,
                     gmax_params=gmax_params, admission=admission, age_boost=age_boost)
    mix_w = parse_mix(mix)
    analyzers: dict = {}
    t0 = time.time()

    tr = None
    if trace is not None:
        from jitflow_server.bench.traces import load_trace

        tr = load_trace(trace)

    def wl(n: int, rps: float, mx=mix_w, tight=tightness, s=seed):
        if tr is not None:
            from jitflow_server.bench.traces import trace_workload

            return trace_workload(tr, rps=rps, mix=mx, seed=s, tightness=tight, data=data, length_scale=ls,
                                  max_context=dflt["max_context"], limit=n)
        return make_workload(n, rps, mix=mx, arrivals=arrivals, data=data, seed=s, tightness=tight,
                             length_scale=ls, max_context=dflt["max_context"])

    def tick(desc: str) -> None:
        if progress is not None:
            progress.update(progress.task_ids[0], advance=1, description=desc)

    res: dict = {"config": {"preset": model.name, "preset_params": model.to_dict(), "policies": policies,
                            "rps": rps_list, "requests": n_requests, "seed": seed,
                            "arrivals": f"trace {tr.origin} ({tr.format}, {len(tr.arrival_s)} rows)" if tr is not None
                            else arrivals, "mix": mix,
                            "tightness": tightness, "length_bound": length_bound, "analyzer": analyzer,
                            "batch_size": batch_size or model.batch_size, "waiting_time": waiting_time,
                            "admission": admission, "age_boost": age_boost,
                            "length_scale": ls, "data": data.origin, "gmax_params": gmax_params},
                 "main": {}, "workloads": {}}
    res["config"]["seeds"] = seeds
    per_seed: dict = {}
    for s in range(seed, seed + seeds):
        st_s = replace(st, seed=s)
        grid: dict = {}
        for rps in rps_list:
            jobs = wl(n_requests, rps, s=s)
            if s == seed:
                res["workloads"][str(rps)] = workload_summary(jobs)
            grid[str(rps)] = {}
            for pol in policies:
                tick(f"rps {rps}: {pol}" + (f" (seed {s})" if seeds > 1 else ""))
                grid[str(rps)][pol] = run_sim_one(jobs, model, pol, st_s, data, analyzers)
            if "oracle" in policies:  # the oracle bounds every policy: the best other one given the truth too
                others = [p for p in policies if is_other_policy(p)]
                if others:
                    best = max(others, key=lambda p: grid[str(rps)][p]["token_goodput"])
                    tick(f"rps {rps}: {best}{TRUTH}")
                    grid[str(rps)]["best-other" + TRUTH] = run_sim_one(jobs, model, best + TRUTH, st_s, data,
                                                                         analyzers)
        per_seed[s] = grid
    top = str(max(rps_list))
    if seeds == 1:
        res["main"] = per_seed[seed]
        res["headline"] = {k: headline(res["main"], k, admission) for k in res["main"]}
    else:
        keys = [str(r) for r in rps_list]
        names = list(per_seed[seed][keys[0]])
        res["main"] = {k: {p: mean_runs([per_seed[s][k][p] for s in per_seed]) for p in names} for k in keys}
        res["headline"] = {k: aggregate_headlines([headline(per_seed[s], k, admission) for s in per_seed])
                           for k in keys}
        res["per_seed"] = {str(s): {k: {p: {m: r[m] for m in ("token_goodput", "request_goodput", "throughput",
                                                               "slo_attainment", "rejected")}
                                        for p, r in g[k].items()} for k in keys} for s, g in per_seed.items()}
    srps = sweep_rps or max(rps_list)
    if ablation:
        jobs = wl(n_requests, float(top))
        ab: dict = {}
        for v in ABLATION:
            tick(f"ablation: {v}")
            if v in per_seed[seed][top]:  # the same workload (seed ``seed``) as the other ablation runs
                ab[v] = per_seed[seed][top][v]
            else:
                ab[v] = run_sim_one(jobs, model, v, st, data, analyzers)
        res["ablation"] = {"rps": float(top), "runs": ab}
    sweep_pols = [p for p in SWEEP_POLICIES if p in policies] or policies[:3]
    if tightness_list:
        res["tightness"] = {"rps": srps, "requests": sweep_requests, "runs": {}}
        for f in tightness_list:
            jobs = wl(sweep_requests, srps, tight=f)
            res["tightness"]["runs"][str(f)] = {}
            for pol in sweep_pols:
                tick(f"tightness {f}: {pol}")
                res["tightness"]["runs"][str(f)][pol] = run_sim_one(jobs, model, pol, st, data, analyzers)
    if mixes:
        res["mix"] = {"rps": srps, "requests": sweep_requests, "runs": {}}
        for mx in mixes:
            jobs = wl(sweep_requests, srps, mx=parse_mix(mx))
            res["mix"]["runs"][mx] = {}
            for pol in sweep_pols:
                tick(f"mix {mx}: {pol}")
                res["mix"]["runs"][mx][pol] = run_sim_one(jobs, model, pol, st, data, analyzers)
    if scaling:
        res["scaling"] = {"rps": float(top), "runs": {}}
        for n in scaling:
            jobs = wl(n, float(top))
            res["scaling"]["runs"][str(n)] = {}
            for pol in policies:
                tick(f"scaling {n}: {pol}")
                w0 = time.perf_counter()
                r = run_sim_one(jobs, model, pol, st, data, analyzers)
                wall = time.perf_counter() - w0
                res["scaling"]["runs"][str(n)][pol] = {"wall_s": wall, "us_per_request": wall / n * 1e6,
                                                       "steps": r["steps"], "frame_ms_p50": r.get("frame_ms_p50"),
                                                       "frame_ms_p99": r.get("frame_ms_p99")}
    res["wall_s"] = time.time() - t0
    return res


def count_runs(policies: list[str], rps_list: list[float], ablation: bool, tightness_list: list[float],
               mixes: list[str], seeds: int = 1, scaling: tuple[int, ...] = ()) -> int:
    """Number of progress ticks of :func:`run_sim_bench`."""
    from jitflow_server.bench.runner import is_other_policy

    n_sw = len([p for p in SWEEP_POLICIES if p in policies]) or min(3, len(policies))
    truth = 1 if "oracle" in policies and any(is_other_policy(p) for p in policies) else 0
    return ((len(policies) + truth) * len(rps_list) * seeds + (len(ABLATION) if ablation else 0)
            + len(policies) * len(scaling)
            + n_sw * (len(tightness_list) + len(mixes)))


def _fmt(x, nd: int = 2) -> str:
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
    return f"{v:.{nd}f} ± {ci:.{nd}f}" if ci is not None else _fmt(v, nd)


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
         f"{cfg['arrivals']}, SLO tightness {cfg['tightness']}, length bounds `{cfg['length_bound']}`, analyzer "
         f"`{cfg['analyzer']}`, B = {cfg['batch_size']}, waiting_time {cfg['waiting_time']} s "
         f"(admission `{cfg.get('admission')}`: {ADMISSION_TEXT.get(cfg.get('admission'), '?')}), length scale "
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
          "att. compound | throughput (tok/s) | steady-state thr. (tok/s) | steady-state prompt+output (tok/s) | "
          "rejected | preempt. | frame P50/P99 ms |",
          "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for k, runs in res["main"].items():
        for p, r in runs.items():
            pk = r["per_kind"]
            L.append(f"| {k} | {p} | {_fci(r, 'token_goodput', 0)} | {_fci(r, 'request_goodput', 3)} | "
                     f"{r['slo_attainment']:.2f} | "
                     f"{_fmt(pk.get('latency', {}).get('slo_attainment'))} | "
                     f"{_fmt(pk.get('deadline', {}).get('slo_attainment'))} | "
                     f"{_fmt(pk.get('compound', {}).get('slo_attainment'))} | {r['throughput']:.0f} | "
                     f"{_fmt(r.get('throughput_window'), 0)} | {_fmt(r.get('token_throughput_window'), 0)} | "
                     f"{r['rejected']:.0f} | {r['sim_preemptions']:.0f} | {_fmt(r.get('frame_ms_p50'))}/{_fmt(r.get('frame_ms_p99'))} |")
    L += ["", f"## Latency per kind at {top} requests/s (P50 / P95, seconds, served requests)", "",
          "| policy | TTFT lat. | TBT lat. | E2EL deadline | TTFT deadline | E2EL compound |", "|---|---|---|---|---|---|"]
    for p, r in res["main"][top].items():
        pk = r["per_kind"]

        def pp(kind: str, m: str, pk=pk) -> str:
            d = pk.get(kind, {})
            return f"{_fmt(d.get(m + '_p50'))} / {_fmt(d.get(m + '_p95'))}"

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


def register(bench_app: typer.Typer) -> None:
    """Attach ``sim`` to ``jitflow bench``."""

    @bench_app.command("sim")
    def sim(
        out: Path = typer.Option(..., "--out", help="Output directory (results.json, results.md, *.png)."),
        preset: str = typer.Option("a100-llama8b", "--preset", help="cpu-demo | a100-llama8b | preset JSON file."),
        policies: str = typer.Option(DEFAULT_POLICIES, "--policies",
                                     help="Comma-separated: gmax, gmax-paper, fcfs, sarathi, edf, sjf, las, "
                                     "slos-serve, qlm, tempo, vllm-priority, oracle, gmax-noanalyzer, sjf-analyzer, "
                                     "gmax-age (δ aged from arrival), gmax-noadmit / fcfs-noadmit (no admission "
                                     "control); POLICY+truth runs POLICY with true lengths and task graphs."),
        rps: Optional[str] = typer.Option(None, "--rps", help="Comma-separated loads (requests/s); default per preset."),
        requests: int = typer.Option(3000, "--requests", min=1, help="Requests (jobs) per load."),
        seed: int = typer.Option(0, "--seed", help="Seed of workloads and length-bound noise."),
        data: Optional[Path] = typer.Option(None, "--data", help="Trace directory (default ../shared/data if present)."),
        arrivals: str = typer.Option("poisson", "--arrivals", help="poisson | azure (trace timestamps rescaled)."),
        mix: str = typer.Option("1:1:1", "--mix", help="latency:deadline:compound weights."),
        tightness: float = typer.Option(1.0, "--tightness", min=0.01, help="Global SLO scale factor."),
        length_bound: str = typer.Option("noisy", "--length-bound", help="noisy | oracle | average."),
        analyzer: str = typer.Option("pattern", "--analyzer", help="pattern | none (average-based fallback)."),
        batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help="B (default: the preset's)."),
        waiting_time: float = typer.Option(5.0, "--waiting-time", min=0.0, help="Admission waiting_time s (0 = off)."),
        age_boost: bool = typer.Option(False, "--age-boost/--no-age-boost",
                                       help="Apply the proposed δ fix (boost aged from arrival, as gmax-age) to "
                                       "every GMAX-family variant (gmax, oracle, gmax-noanalyzer, gmax-paper)."),
        admission: str = typer.Option("shared", "--admission",
                                      help="shared: the same waiting_time admission control for every policy "
                                      "(a fair comparison; SLOs-Serve and QLM add their own); jitserve: GMAX "
                                      "variants only, as in the JITServe paper; off: none."),
        length_scale: Optional[float] = typer.Option(None, "--length-scale", min=0.001,
                                                     help="Scale of trace lengths (default per preset)."),
        ablation: bool = typer.Option(True, "--ablation/--no-ablation", help="Fig. 17 ablation at the top load."),
        tightness_list: str = typer.Option("0.6,0.8,1.0,1.5,2.0", "--tightness-sweep",
                                           help="SLO factors of the tightness sweep ('' = skip)."),
        mixes: str = typer.Option("1:1:1,1:2:0,1:0:0,0:1:0,0:0:1,2:1:1", "--mix-sweep",
                                  help="Mixes of the workload-mix sweep, comma-separated ('' = skip)."),
        sweep_requests: Optional[int] = typer.Option(None, "--sweep-requests", min=1,
                                                     help="Requests per sweep run (default min(requests, 1500))."),
        sweep_rps: Optional[float] = typer.Option(None, "--sweep-rps", min=0.001, help="Load of the sweeps (default: top)."),
        param: list[str] = typer.Option([], "--param", help="GMAX parameter NAME=VALUE (repeatable)."),
        seeds: int = typer.Option(1, "--seeds", min=1, help="Repeat the policy × load grid on this many workload seeds "
                                  "(seed, seed+1, …); reports means with 95 % intervals (JITServe §6.1 averages 5)."),
        capacity: bool = typer.Option(True, "--capacity/--no-capacity",
                                      help="Also run gmax-noadmit and fcfs-noadmit (without admission control) "
                                      "to measure GMAX's serving capacity on the same work as FCFS (the throughput "
                                      "target)."),
        trace: Optional[Path] = typer.Option(None, "--trace", help="Replay this trace: Mooncake JSONL (timestamp ms, "
                                             "input_length, output_length, hash_ids) or Azure LLM CSV (TIMESTAMP, "
                                             "ContextTokens, GeneratedTokens); its first --requests rows, arrivals "
                                             "rescaled to each --rps, kinds drawn with --mix."),
        scaling: str = typer.Option("", "--scaling", help="Comma-separated workload sizes (requests) to time every "
                                    "policy on at the top load, e.g. 1000,10000,50000 ('' = skip)."),
        quick: bool = typer.Option(False, "--quick", help="Small run (< 2 min): 150 requests, 3 loads, short sweeps."),
    ) -> None:
        """Simulate GMAX and the baselines on the mixed workload; write results and plots."""
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        from jitflow_server.bench.estimates import ANALYZER_MODES, LENGTH_MODES
        from jitflow_server.bench.presets import load_preset
        from jitflow_server.bench.runner import check_variants
        from jitflow_server.bench.workload import WorkloadError, parse_mix
        from jitflow_server.engine.step_model import PresetError
        from jitflow_server.serve import parse_params

        try:
            model = load_preset(preset)
        except PresetError as e:
            raise typer.BadParameter(str(e), param_hint="--preset") from None
        pols = [p.strip() for p in policies.split(",") if p.strip()]
        try:
            check_variants(pols)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--policies") from None
        if length_bound not in LENGTH_MODES:
            raise typer.BadParameter(f"choose one of {LENGTH_MODES}", param_hint="--length-bound")
        if analyzer not in ("pattern", "none"):
            raise typer.BadParameter(f"choose one of {ANALYZER_MODES[::2]}", param_hint="--analyzer")
        if admission not in ADMISSION_TEXT:
            raise typer.BadParameter(f"choose one of {', '.join(ADMISSION_TEXT)}", param_hint="--admission")
        if arrivals not in ("poisson", "azure"):
            raise typer.BadParameter("choose poisson or azure", param_hint="--arrivals")
        dflt = PRESET_DEFAULTS.get(model.name, {"rps": "1,2,4"})
        rps_list = parse_floats(rps or dflt["rps"], "--rps")
        t_list = parse_floats(tightness_list, "--tightness-sweep") if tightness_list.strip() else []
        mix_list = [m.strip() for m in mixes.split(",") if m.strip()]
        try:
            parse_mix(mix)
            for m in mix_list:
                parse_mix(m)
        except WorkloadError as e:
            raise typer.BadParameter(str(e), param_hint="--mix/--mix-sweep") from None
        if quick:
            requests = min(requests, 150)
            if rps is None:
                rps_list = sorted(rps_list)[:: max(1, len(rps_list) // 3)][:3]
                if max(parse_floats(dflt["rps"], "--rps")) not in rps_list:
                    rps_list[-1] = max(parse_floats(dflt["rps"], "--rps"))
            t_list = [0.8, 1.0, 1.5] if tightness_list.strip() else []
            mix_list = ["1:1:1", "1:0:0", "0:0:1"] if mix_list else []
            sweep_requests = sweep_requests or 90
        if capacity and "gmax" in pols and "fcfs" in pols:
            pols += [v for v in ("gmax-noadmit", "fcfs-noadmit")
                     if v not in pols and (v == "gmax-noadmit" or admission != "off")]
        sw_n = sweep_requests or min(requests, 1500)
        data_dir = resolve_data(data)
        gparams = parse_params(param)
        sizes = tuple(int(x) for x in parse_floats(scaling, "--scaling")) if scaling.strip() else ()
        if trace is not None and not trace.is_file():
            raise typer.BadParameter(f"{trace} is not a file", param_hint="--trace")
        ticks = count_runs(pols, rps_list, ablation, t_list, mix_list, seeds, sizes)
        cols = (TextColumn("{task.description:<28}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn())
        try:
            with Progress(*cols, transient=True) as prog:
                prog.add_task("simulating", total=ticks)
                res = run_sim_bench(preset, pols, rps_list, requests, seed, data_dir, arrivals, mix, tightness,
                                    length_bound, analyzer, batch_size, waiting_time, length_scale, ablation, t_list,
                                    mix_list, sw_n, sweep_rps, gparams, prog, admission, age_boost, seeds,
                                    sizes, trace)
        except (WorkloadError, ValueError) as e:
            raise typer.BadParameter(str(e)) from None
        command = "jitflow " + " ".join(sys.argv[1:]) if sys.argv and "jitflow" in sys.argv[0] else (
            f"jitflow bench sim --preset {preset} --out {out}")
        write_sim_report(res, out, command)
        con = Console()
        top = str(max(rps_list))
        h = res["headline"][top]
        con.print(f"[bold]{model.name}[/bold] at {top} req/s, admission {admission}: GMAX / best other: token "
                  f"{_fmt(h.get('gmax_over_best_other_token'))}× ({h.get('best_other_token')}), request "
                  f"{_fmt(h.get('gmax_request_over_best_other'))}× ({h.get('best_other_request')}); "
                  f"GMAX/oracle {_fmt(h.get('gmax_over_oracle'))}, "
                  f"capacity vs FCFS (same work) {_fmt(h.get('gmax_capacity_over_fcfs'))}, "
                  f"throughput vs FCFS {_fmt(h.get('gmax_throughput_over_fcfs'))} (steady state "
                  f"{_fmt(h.get('gmax_window_throughput_over_fcfs'))}, prompt+output "
                  f"{_fmt(h.get('gmax_window_token_throughput_over_fcfs'))}); wall {res['wall_s']:.0f} s")
        con.print(f"wrote {out / 'results.json'}, {out / 'results.md'} and plots")
