"""``jitflow bench tune``: choose GMAX's parameters on a *tuning* workload, apart from the evaluation.

A grid of GMAX parameter values (``--grid NAME=V1,V2,...``, repeatable) runs on workloads of the tuning
seeds (default 100, 101, 102: the evaluation of ``jitflow bench sim`` uses seeds 0, 1, 2 and replayed
traces) at the given loads, next to the other policies (same admission control for all). For each
setting it reports GMAX's token and request goodput over the best other policy of each seed and load,
averaged over the seeds, and the worst of those ratios over the loads. Writes ``tune.json`` and
``tune.md``; the setting with the highest worst-case token ratio among those whose worst-case request
ratio is at least ``--request-floor`` is marked as chosen.

The workloads are as long as the evaluation's (``--requests``, 3 000 by default). Shorter ones mislead:
on 600-request workloads (a one- to five-minute overload) pausing deadline and compound work for free
raised GMAX's token ratio from 0.90 to 0.94 (``a100-llama8b``, 2 req/s) and from 0.94 to 1.24
(``cpu-demo-avx512``, 10 req/s); on 3 000-request workloads of the same seeds it lowered them (0.89 /
0.93 against 0.89 / 0.96 token / request, and 0.98 / 0.99 against 1.04 / 1.01), as on every evaluation
workload (docs/scheduling-experiments.md, "Free pauses for deadline and compound work").
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from jitflow_server.bench.sim_cli import (
    DEFAULT_REQUESTS,
    PRESET_DEFAULTS,
    parse_floats,
    resolve_data,
    resolve_length_bound,
)

OTHERS = "fcfs,sjf,las,edf"


def parse_grid(items: list[str]) -> dict[str, list]:
    """``NAME=V1,V2`` items as ``{name: [values]}`` (values by :func:`~jitflow_server.serve.parse_value`).

    Raises ``typer.BadParameter`` naming the item when one has no ``=`` or no value."""
    from jitflow_server.serve import parse_value

    grid: dict[str, list] = {}
    for item in items:
        if "=" not in item:
            raise typer.BadParameter(f"{item!r} must look like NAME=V1,V2", param_hint="--grid")
        name, vals = item.split("=", 1)
        parsed = [parse_value(x.strip()) for x in vals.split(",") if x.strip()]
        if not parsed:
            raise typer.BadParameter(f"{item!r} has no value", param_hint="--grid")
        grid[name.strip()] = parsed
    return grid


def run_tuning(preset: str, grid: dict[str, list], rps_list: list[float], seeds: list[int], n_requests: int,
               others: list[str], data_dir: Optional[Path], request_floor: float, progress=None,
               length_bound: str = "auto") -> dict:
    """Run the grid (see the module docstring); returns the results dict written to ``tune.json``.

    Raises ``ValueError`` for an unknown policy or GMAX parameter."""
    from jitflow_server.bench.presets import load_preset
    from jitflow_server.bench.runner import RunSettings, run_sim_one
    from jitflow_server.bench.workload import DataSources, make_workload
    from jitflow_server.scheduler import make_policy

    model = load_preset(preset)
    dflt = PRESET_DEFAULTS.get(model.name, {"length_scale": 1.0, "max_context": None})
    data = DataSources.load(data_dir)
    bound, _ = resolve_length_bound(length_bound, data_dir, dflt["length_scale"], False)
    alpaca = data_dir / "alpaca_eval" if data_dir is not None else None

    def settings_of(seed: int, params: dict | None = None) -> RunSettings:
        return RunSettings(seed=seed, length_scale=dflt["length_scale"], length_bound=bound, alpaca_dir=alpaca,
                           gmax_params=dict(params or {}))

    settings = [dict(zip(grid, vals, strict=True)) for vals in itertools.product(*grid.values())] or [{}]
    for s in settings:
        make_policy("gmax", **dict(s))  # fail fast on an unknown parameter or value
    analyzers: dict = {}
    t0 = time.time()

    def tick(desc: str) -> None:
        if progress is not None:
            progress.update(progress.task_ids[0], advance=1, description=desc)

    best: dict[tuple[int, float], tuple[float, float]] = {}
    workloads = {}
    for seed, rps in itertools.product(seeds, rps_list):
        jobs = make_workload(n_requests, rps, data=data, seed=seed, length_scale=dflt["length_scale"],
                             max_context=dflt["max_context"])
        workloads[(seed, rps)] = jobs
        st = settings_of(seed)
        runs = []
        for pol in others:
            tick(f"seed {seed}, {rps} rps: {pol}")
            runs.append(run_sim_one(jobs, model, pol, st, data, analyzers))
        best[(seed, rps)] = (max(r["token_goodput"] for r in runs), max(r["request_goodput"] for r in runs))
    rows = []
    for s in settings:
        per_load = {}
        for rps in rps_list:
            tok, req = [], []
            for seed in seeds:
                tick(f"{s or 'defaults'}: seed {seed}, {rps} rps")
                st = settings_of(seed, s)
                r = run_sim_one(workloads[(seed, rps)], model, "gmax", st, data, analyzers)
                bt, br = best[(seed, rps)]
                tok.append(r["token_goodput"] / max(bt, 1e-9))
                req.append(r["request_goodput"] / max(br, 1e-9))
            per_load[str(rps)] = {"token_over_best_other": sum(tok) / len(tok),
                                  "request_over_best_other": sum(req) / len(req)}
        rows.append({"params": s, "loads": per_load,
                     "worst_token": min(v["token_over_best_other"] for v in per_load.values()),
                     "worst_request": min(v["request_over_best_other"] for v in per_load.values())})
    ok = [r for r in rows if r["worst_request"] >= request_floor] or rows
    chosen = max(ok, key=lambda r: r["worst_token"])
    return {"config": {"preset": model.name, "grid": grid, "rps": rps_list, "seeds": seeds, "requests": n_requests,
                       "others": others, "admission": "shared", "request_floor": request_floor, "data": data.origin,
                       "length_bound": bound},
            "rows": rows, "chosen": chosen["params"], "wall_s": time.time() - t0}


def write_report(res: dict, out: Path, command: str) -> None:
    """Write ``tune.json`` and ``tune.md`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(res, indent=1))
    cfg = res["config"]
    loads = [str(r) for r in cfg["rps"]]
    L = [f"# GMAX tuning ({cfg['preset']})", "", f"Command: `{command}`", "",
         f"Tuning seeds {cfg['seeds']}, {cfg['requests']} requests per workload, length bounds "
         f"`{cfg.get('length_bound')}`, same admission control for every policy; ratios are GMAX over the best of {', '.join(cfg['others'])} per seed and load, averaged over "
         f"the seeds. Chosen (highest worst-case token ratio with worst-case request ratio ≥ "
         f"{cfg['request_floor']}): `{res['chosen']}`. Wall time {res['wall_s']:.0f} s.", "",
         "| parameters | " + " | ".join(f"{k} rps token / request" for k in loads) + " | worst token | worst request |",
         "|---|" + "---:|" * (len(loads) + 2)]
    for r in res["rows"]:
        cells = [f"{r['loads'][k]['token_over_best_other']:.2f} / {r['loads'][k]['request_over_best_other']:.2f}"
                 for k in loads]
        mark = " **(chosen)**" if r["params"] == res["chosen"] else ""
        L.append(f"| `{r['params']}`{mark} | " + " | ".join(cells) + f" | {r['worst_token']:.2f} | "
                 f"{r['worst_request']:.2f} |")
    (out / "tune.md").write_text("\n".join(L) + "\n")


def register(bench_app: typer.Typer) -> None:
    """Attach ``tune`` to ``jitflow bench``."""

    @bench_app.command("tune")
    def tune(
        out: Path = typer.Option(..., "--out", help="Output directory (tune.json, tune.md)."),
        preset: str = typer.Option("a100-llama8b", "--preset", help="cpu-demo | a100-llama8b | preset JSON file."),
        grid: list[str] = typer.Option([], "--grid", help="GMAX parameter NAME=V1,V2,... (repeatable; the grid is "
                                       "their product)."),
        rps: str = typer.Option("2,2.6", "--rps", help="Comma-separated loads (requests/s)."),
        seeds: str = typer.Option("100,101,102", "--seeds", help="Tuning workload seeds (keep them apart from the "
                                  "evaluation seeds of `bench sim`, 0, 1, 2 by default)."),
        requests: int = typer.Option(DEFAULT_REQUESTS, "--requests", min=1,
                                     help="Requests per workload (default: the length of `bench sim`'s evaluation "
                                     "workloads; shorter ones are short overloads that favour other settings)."),
        others: str = typer.Option(OTHERS, "--others", help="Policies GMAX is compared with."),
        request_floor: float = typer.Option(0.9, "--request-floor", min=0.0,
                                            help="Lowest acceptable request-goodput ratio for the chosen setting."),
        data: Optional[Path] = typer.Option(None, "--data", help="Trace directory (default ../shared/data if present)."),
        length_bound: str = typer.Option("auto", "--length-bound", help="Length bounds, as for `bench sim` (auto: the "
                                         "server's predictor where the data allows, else noisy)."),
    ) -> None:
        """Choose GMAX's parameters on tuning seeds (not the evaluation's) against the other policies."""
        from rich.console import Console

        from jitflow_server.bench.progress import step_progress
        from jitflow_server.bench.runner import check_variants

        g = parse_grid(grid)
        others_l = [p.strip() for p in others.split(",") if p.strip()]
        try:
            check_variants(others_l)
            seed_l = [int(s) for s in seeds.split(",") if s.strip()]
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        rps_l = parse_floats(rps, "--rps")
        n_set = 1
        for v in g.values():
            n_set *= len(v)
        ticks = len(seed_l) * len(rps_l) * (len(others_l) + n_set)
        try:
            with step_progress(ticks, "tuning", width=40) as prog:
                res = run_tuning(preset, g, rps_l, seed_l, requests, others_l, resolve_data(data), request_floor, prog,
                                 length_bound)
        except (ValueError, FileNotFoundError) as e:
            raise typer.BadParameter(str(e)) from None
        write_report(res, out, "jitflow " + " ".join(sys.argv[1:]))
        Console().print(f"chosen {res['chosen']}; wrote {out / 'tune.json'} and {out / 'tune.md'}")
