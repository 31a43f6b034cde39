"""``jitflow bench frame``: time one GMAX frame over N synthetic queued requests.

Writes ``DIR/frame.json``, ``DIR/frame.md`` and ``DIR/frame.png``: P50/P99 milliseconds of one
``policy.schedule(views, ctx)`` call (wall clock and the calling thread's CPU time) for GMAX and
the baselines, in steady state: between frames ``churn·N`` requests leave and as many new ones
arrive, and the previous decision is applied (batch running, preempted requests lose their KV),
so the snapshot cache sees the id turnover a live engine produces. The first (cold) frame of a
fresh policy, which parses every request, is reported separately.

Frames get a token-time line (:data:`FRAME_TOKEN_TIME`), as the plug-in's do once the SLO tracker has
fitted the engine's steps, so GMAX's goodput batch sizing (``--param batch_sizing=goodput``, which scores
several batch sizes when more than B requests want to run) can be timed too; ``--no-token-time-model``
times frames without it. ``--param NAME=VALUE`` sets a GMAX parameter of every GMAX policy of the run
(``gmax``, ``gmax-paper``, ``oracle``).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import typer

DEFAULT_POLICIES = "gmax,gmax-paper,oracle,fcfs,sarathi,edf,sjf,las,slos-serve,qlm,tempo,vllm-priority"
#: The token-time line of the frames (seconds per token at k requests: 0.01 + 0.00015·k, i.e. 0.02 s at
#: B = 64, the context's ``token_time``): a GPU-like engine whose step grows mildly with the batch.
FRAME_TOKEN_TIME = (0.01, 0.00015)


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--requests must be comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise typer.BadParameter(f"--requests needs positive integers, got {text!r}")
    return sizes


def run_frame_bench(sizes: list[int], policies: list[str], repeats: int = 50, batch_size: int = 64,
                    churn: float = 0.01, seed: int = 0, progress: object | None = None,
                    token_time_model: bool = True, gmax_params: dict | None = None) -> dict:
    """Measure frame times; returns the JSON-able result dict (see module docstring).

    ``sizes``: numbers of queued requests N; ``repeats``: timed frames per (N, policy) after one
    untimed warm frame; ``churn``: fraction of N replaced between frames; ``token_time_model``: give
    the frames :data:`FRAME_TOKEN_TIME`; ``gmax_params``: GMAX parameters of every GMAX policy
    (:func:`~jitflow_server.bench.runner.is_gmax_family`). Units: milliseconds. Raises ``ValueError`` for an invalid parameter.
    """
    import time

    import numpy as np

    from jitflow_server.bench.runner import is_gmax_family
    from jitflow_server.scheduler import SchedContext, TokenTimeModel, make_policy
    from jitflow_server.scheduler.snapshot import SnapshotCache
    from jitflow_server.scheduler.synthetic import synthetic_views

    line = TokenTimeModel(*FRAME_TOKEN_TIME) if token_time_model else None
    results: dict[str, dict[str, dict[str, float]]] = {}
    for n in sizes:
        k = max(1, int(round(churn * n)))
        pool = synthetic_views(n + k * (repeats + 2), batch_size=batch_size, seed=seed)
        results[str(n)] = {}
        for name in policies:
            for v in pool:  # reset the state the previous policy's decisions left behind
                v.running, v.generated, v.kv_tokens = False, 0, 0
            for v in pool[:batch_size]:
                v.running, v.generated, v.kv_tokens = True, 10, v.input_len + 9
            by_id = {v.req_id: v for v in pool}
            pol = make_policy(name, **(gmax_params or {})) if is_gmax_family(name) else make_policy(name)
            side_cache = SnapshotCache(need_attained=False)  # same views, timed alone: the input-parsing share
            wall: list[float] = []
            cpu: list[float] = []
            snap_cpu: list[float] = []
            cold = 0.0
            for r in range(repeats + 1):
                views = pool[r * k : r * k + n]
                ctx = SchedContext(now=1000.0 + 0.5 * r, batch_size=batch_size, token_time=0.02,
                                   prefill_rate=4000.0, token_time_model=line)
                t0, c0 = time.perf_counter(), time.thread_time()
                d = pol.schedule(views, ctx)
                t1, c1 = time.perf_counter(), time.thread_time()
                c2 = time.thread_time()
                side_cache.build(views)
                c3 = time.thread_time()
                if r == 0:
                    cold = (t1 - t0) * 1e3
                else:
                    wall.append((t1 - t0) * 1e3)
                    cpu.append((c1 - c0) * 1e3)
                    snap_cpu.append((c3 - c2) * 1e3)
                for i in d.preempt:
                    by_id[i].running, by_id[i].kv_tokens = False, 0
                for i in d.batch:
                    v = by_id[i]
                    v.running = True
                    v.generated = min(v.generated + 25, max(v.len_bound - 1, 0))
                    v.kv_tokens = v.input_len + v.generated
                if progress is not None:
                    progress.advance(progress.task_ids[0])  # type: ignore[attr-defined]
            w, c = np.asarray(wall), np.asarray(cpu)
            results[str(n)][name] = {
                "p50_ms": float(np.percentile(w, 50)),
                "p99_ms": float(np.percentile(w, 99)),
                "mean_ms": float(w.mean()),
                "cpu_p50_ms": float(np.percentile(c, 50)),
                "cpu_p99_ms": float(np.percentile(c, 99)),
                "cold_ms": cold,
                "snapshot_cpu_p50_ms": float(np.percentile(snap_cpu, 50)),
            }
    return {
        "config": {"requests": sizes, "policies": policies, "repeats": repeats, "batch_size": batch_size,
                   "churn": churn, "seed": seed, "gmax_params": gmax_params or {},
                   "token_time_model": list(FRAME_TOKEN_TIME) if token_time_model else None},
        "machine": {"cpus": os.cpu_count(), "loadavg_1m_at_end": os.getloadavg()[0],
                    "python": platform.python_version()},
        "results": results,
    }


def write_frame_report(res: dict, out: Path, command: str) -> None:
    """Write ``frame.json``, ``frame.md`` (table + command) and ``frame.png`` into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "frame.json").write_text(json.dumps(res, indent=2))
    lines = [
        "# GMAX frame time",
        "",
        f"Command: `{command}`",
        "",
        f"One `schedule()` call over N queued requests, B = {res['config']['batch_size']}, "
        f"{res['config']['repeats']} steady-state frames (churn {res['config']['churn']:.0%} of N per frame). "
        f"Machine: {res['machine']['cpus']} CPUs, 1-min load average at the end "
        f"{res['machine']['loadavg_1m_at_end']:.2f} (other jobs share the cores, so wall time can exceed CPU time).",
        "",
        ("Token-time line: {:g} + {:g}·k s per token (GMAX's goodput batch sizing uses it)".format(
            *res["config"]["token_time_model"])
         if res["config"].get("token_time_model") else "No token-time line (GMAX's goodput batch sizing does not run)."),
        "GMAX parameters: " + (", ".join(f"`{k}={v}`" for k, v in res["config"].get("gmax_params", {}).items())
                               or "the defaults") + ".",
        "",
        "`snapshot` = CPU P50 of converting the views to columns alone (Python attribute reads), "
        "included in the frame time; the rest is the policy proper.",
        "",
        "| N | policy | P50 ms | P99 ms | CPU P50 ms | CPU P99 ms | snapshot CPU P50 ms | cold ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n, per in res["results"].items():
        for name, r in per.items():
            lines.append(f"| {n} | {name} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['cpu_p50_ms']:.2f} | "
                         f"{r['cpu_p99_ms']:.2f} | {r['snapshot_cpu_p50_ms']:.2f} | {r['cold_ms']:.2f} |")
    (out / "frame.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(8, 4))
    sizes = list(res["results"])
    names = list(next(iter(res["results"].values())))
    width = 0.8 / max(len(sizes), 1)
    for j, n in enumerate(sizes):
        xs = [i + j * width for i in range(len(names))]
        ax.bar(xs, [res["results"][n][p]["p50_ms"] for p in names], width, label=f"N={n} (P50)")
    ax.axhline(20.0, color="red", linestyle="--", linewidth=1, label="20 ms (JITServe Fig. 9)")
    ax.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(names))], names, rotation=30)
    ax.set_ylabel("frame time (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "frame.png", dpi=120)
    plt.close(fig)


def register(bench_app: typer.Typer) -> None:
    """Attach ``frame`` to ``jitflow bench``."""

    @bench_app.command("frame")
    def frame(
        requests: str = typer.Option("1000,10000", "--requests", help="Comma-separated numbers N of queued requests."),
        out: Path = typer.Option(..., "--out", help="Output directory (frame.json, frame.md, frame.png)."),
        policies: str = typer.Option(DEFAULT_POLICIES, "--policies", help="Comma-separated policy names."),
        repeats: int = typer.Option(50, "--repeats", min=2, help="Timed frames per (N, policy)."),
        batch_size: int = typer.Option(64, "--batch-size", min=1, help="Batch size B."),
        churn: float = typer.Option(0.01, "--churn", min=0.0, max=1.0, help="Fraction of N replaced per frame."),
        seed: int = typer.Option(0, "--seed", help="Seed of the synthetic requests."),
        token_time_model: bool = typer.Option(
            True, "--token-time-model/--no-token-time-model",
            help="Give frames the step-time line the plug-in gets from the SLO tracker (GMAX's goodput batch "
                 "sizing uses it)."),
        param: list[str] = typer.Option([], "--param", help="GMAX parameter NAME=VALUE for gmax, gmax-paper and "
                                        "oracle (repeatable; docs/scheduling.md, 'Parameters')."),
    ) -> None:
        """Time one scheduling frame (P50/P99 ms) over N synthetic queued requests, GMAX and baselines."""
        import sys

        from rich.console import Console
        from rich.progress import Progress

        from jitflow_server.bench.engine_cli import gmax_params_option
        from jitflow_server.scheduler import POLICY_NAMES

        sizes = _parse_sizes(requests)
        names = [p.strip() for p in policies.split(",") if p.strip()]
        bad = [p for p in names if p not in POLICY_NAMES]
        if not names or bad:
            raise typer.BadParameter(f"unknown policies {bad}; valid: {', '.join(POLICY_NAMES)}")
        gmax_params = gmax_params_option(param, names)
        with Progress(transient=True) as prog:
            prog.add_task("frames", total=len(sizes) * len(names) * (repeats + 1))
            res = run_frame_bench(sizes, names, repeats, batch_size, churn, seed, prog, token_time_model,
                                  gmax_params)
        command = "jitflow " + " ".join(sys.argv[1:]) if sys.argv and "jitflow" in sys.argv[0] else (
            f"jitflow bench frame --requests {requests} --out {out}")
        write_frame_report(res, out, command)
        console = Console()
        console.print((out / "frame.md").read_text())
