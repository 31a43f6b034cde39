"""``jitflow bench replicas``: routing over simulated replicas of different speeds (JITServe Fig. 18).

Every (scheduling policy, router) pair serves the same workloads (``bench/replicas.py``); the headline
compares GMAX with the goodput router against the best other pair, on token and on request goodput,
per seed then averaged (mean ± 95 % interval over the seeds). The routing decision's cost is timed on
synthetic streams over 4, 16 and 64 replicas. Writes ``DIR/replicas.json``, ``replicas.md`` and
``replicas.png``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

MAIN = "gmax+goodput"


def run_replica_bench(preset: str, speeds: list[float], rps_list: list[float], n_requests: int, seeds: int,
                      routers: list[str], policies: list[str], data_dir: Path | None,
                      progress=None) -> dict:
    """Run every (policy, router) pair on ``seeds`` workloads per load; the JSON-able result."""
    import numpy as np

    from jitflow_server.bench.metrics import ci95
    from jitflow_server.bench.presets import load_preset
    from jitflow_server.bench.replicas import decision_time_us, run_replicas
    from jitflow_server.bench.runner import RunSettings
    from jitflow_server.bench.workload import DataSources, make_workload

    model = load_preset(preset)
    data = DataSources.load(data_dir)
    pairs = [f"{p}+{r}" for p in policies for r in routers]
    loads: dict[str, dict] = {}
    for rps in rps_list:
        per: dict[str, dict[str, list]] = {k: {"token": [], "request": [], "jobs_per_replica": []} for k in pairs}
        for seed in range(seeds):
            jobs = make_workload(n_requests, rps, data=data, seed=seed)
            st, analyzers = RunSettings(seed=seed), {}
            for pair in pairs:
                policy, router = pair.split("+", 1)
                run = run_replicas(jobs, model, speeds, router, policy, st, data, analyzers)
                per[pair]["token"].append(run.summary["token_goodput"])
                per[pair]["request"].append(run.summary["request_goodput"])
                per[pair]["jobs_per_replica"].append(run.jobs_per_replica)
                if progress is not None:
                    progress(f"{rps:g} req/s seed {seed} {pair}: {run.summary['token_goodput']:.0f} tok/s, "
                             f"{run.summary['request_goodput']:.3f} req/s")
        table = {k: {"token_goodput": float(np.mean(v["token"])), "token_ci": ci95(v["token"]),
                     "request_goodput": float(np.mean(v["request"])), "request_ci": ci95(v["request"]),
                     "per_seed": {"token": v["token"], "request": v["request"]},
                     "jobs_per_replica": v["jobs_per_replica"][0]} for k, v in per.items()}
        headline: dict = {}
        if MAIN in per:
            for what in ("token", "request"):
                others = [k for k in pairs if k != MAIN]
                if not others:
                    continue
                best = max(others, key=lambda k, w=what: table[k][f"{w}_goodput"])
                ratios = [a / b if b > 0 else float("nan") for a, b in zip(per[MAIN][what], per[best][what])]
                headline[what] = {"best_other": best, "ratio": float(np.mean(ratios)), "ratio_ci": ci95(ratios)}
        loads[f"{rps:g}"] = {"results": table, "headline": headline}
    decision = {str(m): decision_time_us(m) for m in (4, 16, 64)}
    return {"config": {"preset": preset, "speeds": speeds, "rps": rps_list, "requests": n_requests, "seeds": seeds,
                       "routers": routers, "policies": policies, "data": str(data_dir) if data_dir else None,
                       "admission": "shared (waiting_time 5 s on every replica, every pair)"},
            "loads": loads, "decision_us": decision}


def _ci(x: float | None) -> str:
    return "" if x is None else f" ± {x:.2f}"


def write_replica_report(res: dict, out: Path, command: str) -> None:
    """``replicas.json``, ``replicas.md`` (tables and command) and ``replicas.png`` into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas.json").write_text(json.dumps(res, indent=2))
    cfg = res["config"]
    lines = ["# Routing over replicas (simulated)", "", f"Command: `{command}`", "",
             f"Preset {cfg['preset']}, replica speeds {cfg['speeds']} (1 = the preset), {cfg['requests']} requests "
             f"per load, mix 1:1:1, {cfg['seeds']} seeds (mean ± 95 % interval), admission {cfg['admission']}.", "",
             "| load req/s | GMAX + goodput router / best other, token | best other | request | best other |",
             "|---:|---:|---|---:|---|"]
    for rps, ld in res["loads"].items():
        h = ld["headline"]
        if h:
            lines.append(f"| {rps} | {h['token']['ratio']:.2f}{_ci(h['token']['ratio_ci'])} | {h['token']['best_other']} "
                         f"| {h['request']['ratio']:.2f}{_ci(h['request']['ratio_ci'])} | {h['request']['best_other']} |")
    lines += ["", "| load | policy + router | token goodput (tok/s) | request goodput (req/s) | jobs per replica (seed 0) |",
              "|---:|---|---:|---:|---|"]
    for rps, ld in res["loads"].items():
        for pair, r in ld["results"].items():
            lines.append(f"| {rps} | {pair} | {r['token_goodput']:.0f}{_ci(r['token_ci']).replace('.00', '')} | "
                         f"{r['request_goodput']:.3f}{_ci(r['request_ci'])} | {r['jobs_per_replica']} |")
    lines += ["", "Routing decision time (synthetic stream, mixed speeds):", "",
              "| replicas | P50 µs | P99 µs |", "|---:|---:|---:|"]
    lines += [f"| {m} | {d['p50_us']:.0f} | {d['p99_us']:.0f} |" for m, d in res["decision_us"].items()]
    (out / "replicas.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "token_goodput", "token goodput (tok/s)"),
                           (axes[1], "request_goodput", "request goodput (req/s)")):
        rps = list(res["loads"])
        for pair in next(iter(res["loads"].values()))["results"]:
            ax.plot([float(r) for r in rps], [res["loads"][r]["results"][pair][key] for r in rps], marker="o",
                    label=pair, linewidth=2.5 if pair == MAIN else 1.0)
        ax.set_xlabel("load (req/s)")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "replicas.png", dpi=120)
    plt.close(fig)


def register(bench_app: typer.Typer) -> None:
    """Attach ``replicas`` to ``jitflow bench``."""

    @bench_app.command("replicas")
    def replicas(
        out: Path = typer.Option(..., "--out", help="Output directory (replicas.json, .md, .png)."),
        preset: str = typer.Option("a100-llama8b", "--preset", help="Step-time preset of a speed-1 replica."),
        speeds: str = typer.Option("1,1,0.5,0.5", "--speeds", help="Relative speed of each replica (1 = the preset)."),
        rps: str = typer.Option("4,6", "--rps", help="Comma-separated total loads (requests/s)."),
        requests: int = typer.Option(2000, "--requests", min=10, help="Requests per load and seed."),
        seeds: int = typer.Option(3, "--seeds", min=1, help="Workload seeds per load (0 … seeds-1)."),
        routers: str = typer.Option("goodput,least-loaded,round-robin,prefix-affinity", "--routers",
                                    help="Comma-separated routers (goodput, least-loaded, round-robin, prefix-affinity)."),
        policies: str = typer.Option("gmax,tempo,fcfs", "--policies", help="Scheduling policy of every replica."),
        data: Optional[Path] = typer.Option(None, "--data", help="The shared data folder (default: ../shared/data "
                                                                 "when present; built-in distributions otherwise)."),
    ) -> None:
        """Route one workload over replicas of different speeds and simulate each; GMAX with the goodput
        router against every other (policy, router) pair, token and request goodput."""
        from jitflow_server.bench.workload import default_data_dir
        from jitflow_server.scheduler import POLICY_NAMES
        from jitflow_server.scheduler.routing import ROUTER_NAMES

        try:
            sp = [float(x) for x in speeds.split(",") if x.strip()]
            loads = [float(x) for x in rps.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter("--speeds and --rps take comma-separated numbers") from None
        if not sp or any(not s > 0 for s in sp) or not loads or any(not r > 0 for r in loads):
            raise typer.BadParameter("--speeds and --rps need positive numbers")
        rs = [r.strip() for r in routers.split(",") if r.strip()]
        ps = [p.strip() for p in policies.split(",") if p.strip()]
        if not rs or any(r not in ROUTER_NAMES for r in rs):
            raise typer.BadParameter(f"--routers: choose from {', '.join(ROUTER_NAMES)}")
        if not ps or any(p not in POLICY_NAMES for p in ps):
            raise typer.BadParameter(f"--policies: choose from {', '.join(POLICY_NAMES)}")
        res = run_replica_bench(preset, sp, loads, requests, seeds, rs, ps, data or default_data_dir(),
                                progress=lambda m: typer.echo(m, err=True))
        command = "jitflow " + " ".join(sys.argv[1:]) if sys.argv and "jitflow" in sys.argv[0] else (
            f"jitflow bench replicas --out {out}")
        write_replica_report(res, out, command)
        typer.echo((out / "replicas.md").read_text())
