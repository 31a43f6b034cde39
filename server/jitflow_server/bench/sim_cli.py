"""``jitflow bench sim``: the simulated evaluation: policies × loads, oracle, ablation,
SLO-tightness and workload-mix sweeps; writes ``results.json``, ``results.md`` and plots."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from jitflow_server.bench.sim_report import (
    ADMISSION_TEXT,
    aggregate_headlines,
    apply_capacity,
    fmt,
    headline,
    write_sim_report,
)
from jitflow_server.engine.jobs import GIVE_UP_AFTER_S
from jitflow_server.scheduler.admission import COMPOUND_WAITING, DEFAULT_WAITING_TIME_S

#: Requests (jobs) per load of an evaluation workload; ``bench tune`` tunes on workloads of the same length.
DEFAULT_REQUESTS = 3000
DEFAULT_POLICIES = "gmax,fcfs,sarathi,sjf,las,edf,slos-serve,qlm,tempo,vllm-priority,oracle"
PRESET_DEFAULTS = {
    # loads from below to 2× the preset's capacity on the 1:1:1 mix (capacity_rps in the headline)
    "a100-llama8b": {"rps": "1,1.3,2,2.6", "length_scale": 1.0, "max_context": None},
    "cpu-demo": {"rps": "0.5,1,2,3,4", "length_scale": 0.0625, "max_context": 8000},
    "cpu-demo-avx512": {"rps": "2,4,6,10,14", "length_scale": 0.0625, "max_context": 8000},
}
SWEEP_POLICIES = ("gmax", "sarathi", "edf", "sjf", "las", "tempo", "slos-serve")
ABLATION = ("oracle", "gmax", "gmax-noanalyzer", "sjf-analyzer", "sarathi")  # JITServe Fig. 17


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


def resolve_length_bound(mode: str, data_dir: Optional[Path], length_scale: float, trace: bool) -> tuple[str, str]:
    """``(mode, reason)``: ``auto`` becomes ``predictor`` (the server's QRF on held-out AlpacaEval prompts,
    ``bench/predictor_bounds.py``) when ``<data>/alpaca_eval`` exists, lengths are unscaled and no trace is
    replayed (a trace's calls keep their own lengths and have no prompts), else ``noisy``; other modes are
    returned as given."""
    if mode != "auto":
        return mode, "chosen with --length-bound"
    if trace:
        return "noisy", "auto: a replayed trace keeps its own lengths and has no prompt text"
    if data_dir is None or not (data_dir / "alpaca_eval").is_dir():
        return "noisy", "auto: no alpaca_eval directory in the data for the real predictor"
    if length_scale != 1.0:
        return "noisy", f"auto: lengths scaled by {length_scale} (the predictor's held-out responses are real lengths)"
    return "predictor", "auto: the server's length predictor on held-out AlpacaEval prompts"


def run_sim_bench(preset: str, policies: list[str], rps_list: list[float], n_requests: int, seed: int,
                  data_dir: Optional[Path], arrivals: str, mix: str, tightness: float, length_bound: str,
                  analyzer: str, batch_size: Optional[int], waiting_time: float, length_scale: Optional[float],
                  ablation: bool, tightness_list: list[float], mixes: list[str], sweep_requests: int,
                  sweep_rps: Optional[float], gmax_params: dict, progress=None,
                  admission: str = "shared", age_boost: bool = False, seeds: int = 1,
                  scaling: tuple[int, ...] = (), trace: Optional[Path] = None,
                  give_up: float = GIVE_UP_AFTER_S, compound_waiting: str = "waiting_time") -> dict:
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
    length_bound, bound_why = resolve_length_bound(length_bound, data_dir, ls, trace is not None)
    st = RunSettings(analyzer=analyzer, length_bound=length_bound, batch_size=batch_size,
                     waiting_time=waiting_time if waiting_time > 0 else None, length_scale=ls, seed=seed,
                     give_up_after=give_up if give_up > 0 else None, compound_waiting=compound_waiting,
                     gmax_params=gmax_params, admission=admission, age_boost=age_boost,
                     alpaca_dir=data_dir / "alpaca_eval" if data_dir is not None else None)
    mix_w = parse_mix(mix)
    analyzers: dict = {}
    t0 = time.time()

    from jitflow_server.bench.traces import load_trace, trace_workload

    tr = load_trace(trace) if trace is not None else None

    def wl(n: int, rps: float, mx=mix_w, tight=tightness, s=seed):
        if tr is not None:
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
                            "tightness": tightness, "length_bound": length_bound,
                            "length_bound_reason": bound_why, "analyzer": analyzer,
                            "batch_size": batch_size or model.batch_size, "waiting_time": waiting_time, "give_up_after": give_up,
                            "compound_waiting": compound_waiting,
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
    apply_capacity(res["headline"])
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
        requests: int = typer.Option(DEFAULT_REQUESTS, "--requests", min=1, help="Requests (jobs) per load."),
        seed: int = typer.Option(0, "--seed", help="Seed of workloads and length-bound noise."),
        data: Optional[Path] = typer.Option(None, "--data", help="Trace directory (default ../shared/data if present)."),
        arrivals: str = typer.Option("poisson", "--arrivals", help="poisson | azure (trace timestamps rescaled)."),
        mix: str = typer.Option("1:1:1", "--mix", help="latency:deadline:compound weights."),
        tightness: float = typer.Option(1.0, "--tightness", min=0.01, help="Global SLO scale factor."),
        length_bound: str = typer.Option("auto", "--length-bound", help="auto | predictor | noisy | oracle | average. "
                                         "predictor: the server's QRF length predictor on held-out AlpacaEval "
                                         "prompts attached to the single calls (their output lengths become the "
                                         "held-out responses'), pattern bounds for compound calls; auto: predictor "
                                         "when the data has alpaca_eval, lengths are unscaled and no --trace is "
                                         "given, else noisy (a q = 0.9 noise model of the true length)."),
        analyzer: str = typer.Option("pattern", "--analyzer", help="pattern | none (average-based fallback)."),
        batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help="B (default: the preset's)."),
        waiting_time: float = typer.Option(DEFAULT_WAITING_TIME_S, "--waiting-time", min=0.0, help="Admission waiting_time s (0 = off)."),
        give_up: float = typer.Option(GIVE_UP_AFTER_S, "--give-up", min=0.0,
                                      help="Seconds past its deadline that the client of a deadline request or "
                                      "compound task gives up and the call is aborted, for every policy (0 = never)."),
        compound_waiting: str = typer.Option(
            "waiting-time", "--compound-waiting",
            help="waiting-time: every call waits --waiting-time at most for its start; sub-deadline: a compound "
            "call may wait until its stage's sub-deadline when that is later (every policy; docs/scheduling.md)."),
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

        from jitflow_server.bench.engine_cli import gmax_params_option
        from jitflow_server.bench.estimates import ANALYZER_MODES, LENGTH_MODES
        from jitflow_server.bench.presets import load_preset
        from jitflow_server.bench.progress import step_progress
        from jitflow_server.bench.runner import check_variants
        from jitflow_server.bench.workload import WorkloadError, parse_mix
        from jitflow_server.engine.step_model import PresetError

        try:
            model = load_preset(preset)
        except PresetError as e:
            raise typer.BadParameter(str(e), param_hint="--preset") from None
        pols = [p.strip() for p in policies.split(",") if p.strip()]
        try:
            check_variants(pols)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--policies") from None
        if length_bound not in (*LENGTH_MODES, "auto"):
            raise typer.BadParameter(f"choose one of auto, {', '.join(LENGTH_MODES)}", param_hint="--length-bound")
        if analyzer not in ("pattern", "none"):
            raise typer.BadParameter(f"choose one of {ANALYZER_MODES[::2]}", param_hint="--analyzer")
        compound_waiting = compound_waiting.replace("-", "_")  # the flag's spelling -> the setting's
        if compound_waiting not in COMPOUND_WAITING:
            raise typer.BadParameter("choose sub-deadline or waiting-time", param_hint="--compound-waiting")
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
        gparams = gmax_params_option(param, pols)
        sizes = tuple(int(x) for x in parse_floats(scaling, "--scaling")) if scaling.strip() else ()
        if trace is not None and not trace.is_file():
            raise typer.BadParameter(f"{trace} is not a file", param_hint="--trace")
        ticks = count_runs(pols, rps_list, ablation, t_list, mix_list, seeds, sizes)
        try:
            with step_progress(ticks, "simulating") as prog:
                res = run_sim_bench(preset, pols, rps_list, requests, seed, data_dir, arrivals, mix, tightness,
                                    length_bound, analyzer, batch_size, waiting_time, length_scale, ablation, t_list,
                                    mix_list, sw_n, sweep_rps, gparams, prog, admission, age_boost, seeds,
                                    sizes, trace, give_up, compound_waiting)
        except (WorkloadError, ValueError, FileNotFoundError) as e:
            raise typer.BadParameter(str(e)) from None
        command = "jitflow " + " ".join(sys.argv[1:]) if sys.argv and "jitflow" in sys.argv[0] else (
            f"jitflow bench sim --preset {preset} --out {out}")
        write_sim_report(res, out, command)
        con = Console()
        top = str(max(rps_list))
        h = res["headline"][top]
        con.print(f"[bold]{model.name}[/bold] at {top} req/s, admission {admission}: GMAX / best other: token "
                  f"{fmt(h.get('gmax_over_best_other_token'))}× ({h.get('best_other_token')}), request "
                  f"{fmt(h.get('gmax_request_over_best_other'))}× ({h.get('best_other_request')}); "
                  f"GMAX/oracle {fmt(h.get('gmax_over_oracle'))}, "
                  f"capacity vs FCFS (same work) {fmt(h.get('gmax_capacity_over_fcfs'))}, "
                  f"throughput vs FCFS {fmt(h.get('gmax_throughput_over_fcfs'))} (steady state "
                  f"{fmt(h.get('gmax_window_throughput_over_fcfs'))}, prompt+output "
                  f"{fmt(h.get('gmax_window_token_throughput_over_fcfs'))}); wall {res['wall_s']:.0f} s")
        con.print(f"wrote {out / 'results.json'}, {out / 'results.md'} and plots")
