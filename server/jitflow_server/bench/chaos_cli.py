"""CLI and report of ``jitflow bench chaos`` (the phases are in ``bench/chaos.py``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer

from jitflow_server.bench import chaos
from jitflow_server.bench.chaos import ChaosOptions
from jitflow_server.bench.chaos_fuzz import generate_cases, send_cases

#: What a run must show (``docs/security.md``).
TARGETS = {"n_5xx": 0, "bad_error_shape": 0, "leaked_requests": 0, "rss_growth_mb": 200.0,
           "admitted_missed_share": 0.10, "telemetry_lost": 0, "orphans": 0}


def run_chaos(opts: ChaosOptions, say: chaos.Say) -> dict[str, Any]:
    """Every phase of ``bench/chaos.py`` in order; returns the report (also written to ``out/chaos.json``)."""
    opts.out.mkdir(parents=True, exist_ok=True)
    db = opts.out / "history.db"
    for p in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        p.unlink(missing_ok=True)
    rep: dict[str, Any] = {"options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def save() -> None:  # after every phase, so a long run that fails part-way keeps what it measured
        (opts.out / "chaos.json").write_text(json.dumps(rep, indent=1, default=str))

    say(f"starting jitflow serve --model {opts.model} --batch-size {opts.batch_size}")
    srv = chaos.start_server(opts, "server", db)
    try:
        url = srv.base_url
        model = chaos.served_model(url)
        cap = rep["capacity"] = chaos.measure_capacity(url, model, opts, say)
        chaos.longest_prefill(url, model)
        chaos.settle(url)
        rss0_by = chaos.tree_rss_mb(srv.proc.pid)
        rss0 = rss0_by["total"]
        say(f"resident memory of the server's processes after warm-up: {rss0:.0f} MB")

        task_id = "chaos-fuzz-task"
        import httpx

        httpx.post(url + "/v1/tasks", json={"task_id": task_id, "app": "chaos-fuzz", "deadline": 3600}, timeout=30)
        say(f"fuzz: generating {opts.fuzz} requests from the OpenAPI schema")
        cases = generate_cases(url, opts.fuzz, opts.seed, progress=None)
        say(f"fuzz: sending {len(cases)} requests, {opts.fuzz_concurrency} at a time")
        fz = send_cases(url, cases, concurrency=opts.fuzz_concurrency, model=model, task_id=task_id,
                        cap=opts.fuzz_max_tokens, progress=lambda n: say(f"  fuzz: {n}/{len(cases)}"))
        rep["fuzz"] = fz.to_dict()
        save()
        say(f"fuzz: {fz.sent} sent in {fz.seconds:.0f} s, {fz.n_5xx} 5xx, {fz.bad_error_shape} errors not in "
            f"OpenAI's shape, {fz.transport_errors} without an answer")
        chaos.settle(url)

        rep["disconnects"] = chaos.run_disconnects(url, model, opts, say)
        save()

        mean = cap["mean_output_tokens"]
        rate = opts.burst_factor * cap["tokens_per_s"] / max(mean, 1.0)
        full_step = opts.batch_size / max(cap["tokens_per_s"], 1e-9)  # s per token of one request, full batch
        deadline = opts.burst_deadline or round(3.0 * mean * full_step, 1)
        arrivals = chaos.burst_arrivals(rate, opts.burst_s, opts.burst_tokens, opts.seed + 2)
        say(f"burst: {len(arrivals)} deadline requests in {opts.burst_s:.0f} s ({rate:.1f}/s = "
            f"{opts.burst_factor:g}× capacity), deadline {deadline:g} s")
        rep["burst"] = {"rate_per_s": rate, "deadline_s": deadline, "arrivals": len(arrivals),
                        "with_admission": chaos.run_burst(url, model, arrivals, deadline, say)}
        save()
        chaos.settle(url)

        committed = chaos.commit_tasks(url, opts.telemetry_tasks, say)
        chaos.settle(url)
        time.sleep(2.0)
        rss1_by = chaos.tree_rss_mb(srv.proc.pid)
        rss1 = rss1_by["total"]
        rep["memory"] = {"rss_start_mb": rss0, "rss_end_mb": rss1, "rss_growth_mb": rss1 - rss0,
                         "by_process_start": rss0_by, "by_process_end": rss1_by}
        say(f"resident memory: {rss0:.0f} → {rss1:.0f} MB ({rss1 - rss0:+.0f} MB)")
        rep["kill9"] = chaos.kill_and_check_orphans(srv, say)
    finally:
        srv.stop()

    say("restarting on the same history database")
    srv = chaos.start_server(opts, "restart", db)
    try:
        stored = chaos.stored_task_ids(db)
        lost = [t for t in committed if t not in stored]
        rep["telemetry"] = {"committed": len(committed), "stored_after_restart": len(committed) - len(lost),
                            "lost": len(lost), "integrity_ok": chaos.integrity_ok(db)}
        say(f"telemetry: {len(lost)} of {len(committed)} committed tasks lost; integrity "
            f"{'ok' if rep['telemetry']['integrity_ok'] else 'FAILED'}")
    finally:
        srv.stop()

    if opts.compare_admission:
        say("burst again on a server without deadline admission (same arrivals)")
        srv = chaos.start_server(opts, "no-admission", opts.out / "history-no-admission.db",
                                 ["--no-deadline-admission"])
        try:
            url = srv.base_url
            chaos.measure_capacity(url, chaos.served_model(url), opts, say)  # the same warm-up
            chaos.settle(url)
            rep["burst"]["without_admission"] = chaos.run_burst(url, chaos.served_model(url), arrivals, deadline, say)
        finally:
            srv.stop()
    rep["checks"] = checks(rep)
    return rep


def checks(rep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target of :data:`TARGETS` with the measured value and whether it is met."""
    vals = {
        "n_5xx": rep["fuzz"]["n_5xx"],
        "bad_error_shape": rep["fuzz"]["bad_error_shape"],
        "leaked_requests": rep["disconnects"]["leaked_total"],
        "rss_growth_mb": rep["memory"]["rss_growth_mb"],
        "admitted_missed_share": rep["burst"]["with_admission"]["admitted_missed_share"],
        "telemetry_lost": rep["telemetry"]["lost"] + (0 if rep["telemetry"]["integrity_ok"] else 1),
        "orphans": rep["kill9"]["orphans"],
    }
    return {k: {"value": v, "target": TARGETS[k], "met": v <= TARGETS[k]} for k, v in vals.items()}


def report_md(rep: dict[str, Any], command: str) -> str:
    """The report as markdown."""
    b = rep["burst"]
    lines = [f"# jitflow bench chaos\n\n`{command}`\n",
             f"Capacity {rep['capacity']['tokens_per_s']:.0f} output tokens/s, burst {b['arrivals']} deadline "
             f"requests at {b['rate_per_s']:.1f}/s with a {b['deadline_s']:g} s deadline.\n",
             "| check | measured | target | met |", "|---|---:|---:|---|"]
    for k, c in rep["checks"].items():
        v = c["value"]
        lines.append(f"| {k} | {v:.3f} | ≤ {c['target']} | {'yes' if c['met'] else '**no**'} |"
                     if isinstance(v, float) else f"| {k} | {v} | ≤ {c['target']} | {'yes' if c['met'] else '**no**'} |")
    lines += ["", "| burst | sent | admitted | met | missed | admitted-missed | 429 | goodput tokens |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("with_admission", "without_admission"):
        if name in b:
            r = b[name]
            lines.append(f"| {name.replace('_', ' ')} | {r['sent']} | {r['admitted']} | {r['met']} | {r['missed']} | "
                         f"{100 * r['admitted_missed_share']:.1f} % | {r['rejected_429']} | {r['goodput_tokens']} |")
    f = rep["fuzz"]
    lines += ["", f"Fuzz: {f['sent']} requests in {f['seconds']} s; {f['n_5xx']} 5xx; "
              f"{f['transport_errors']} without an answer. Disconnects: {rep['disconnects']['sent']}, leaked "
              f"{rep['disconnects']['leaked']}. Memory {rep['memory']['rss_start_mb']:.0f} → "
              f"{rep['memory']['rss_end_mb']:.0f} MB. kill -9: {rep['kill9']['orphans']} orphans of "
              f"{rep['kill9']['descendants']}. Telemetry: {rep['telemetry']['lost']} of "
              f"{rep['telemetry']['committed']} committed tasks lost.", ""]
    return "\n".join(lines)


def register(bench_app: typer.Typer) -> None:
    """Attach ``chaos`` to ``jitflow bench``."""

    @bench_app.command("chaos")
    def chaos_cmd(
        out: Path = typer.Option(Path("results/chaos"), "--out", help="Output folder (chaos.json, chaos.md, "
                                 "server logs)."),
        model: str = typer.Option("demo", "--model", help="'demo', 'demo-small', 'tiny' or a model directory."),
        policy: str = typer.Option("gmax", "--policy", help="The server's scheduling policy (jitflow serve --policy)."),
        batch_size: int = typer.Option(16, "--batch-size", min=1, help="B of the server."),
        fuzz: int = typer.Option(10_000, "--fuzz", min=0, help="Schema-driven fuzzed requests."),
        disconnects: int = typer.Option(1_000, "--disconnects", min=0, help="Streams hung up mid-way."),
        burst_factor: float = typer.Option(10.0, "--burst-factor", min=0.1, help="Burst load / measured capacity."),
        burst_s: float = typer.Option(20.0, "--burst-duration", min=1.0, help="Seconds of burst arrivals."),
        burst_deadline: Optional[float] = typer.Option(None, "--burst-deadline", min=0.1, help="Deadline of the "
                                                       "burst's requests (s; default 3× a mean request's time "
                                                       "in a full batch)."),
        telemetry_tasks: int = typer.Option(200, "--telemetry-tasks", min=0, help="Tasks committed before kill -9."),
        compare_admission: bool = typer.Option(True, help="Repeat the burst without deadline admission."),
        seed: int = typer.Option(0, "--seed"),
        param: list[str] = typer.Option([], "--param", help="Policy parameter NAME=VALUE of the server "
                                        "(jitflow serve --param; repeatable)."),
    ) -> None:
        """Attack a real server: fuzz, mid-stream disconnects, a 10× burst, kill -9 and restart; report the
        damage against the targets (JSON + markdown). Exit code 1 when a target is missed."""
        import sys

        opts = ChaosOptions(out=out, model=model, batch_size=batch_size, fuzz=fuzz, disconnects=disconnects,
                            burst_factor=burst_factor, burst_s=burst_s, burst_deadline=burst_deadline,
                            telemetry_tasks=telemetry_tasks, compare_admission=compare_admission, seed=seed,
                            extra_server_args=["--policy", policy, *(x for p in param for x in ("--param", p))])
        t0 = time.monotonic()

        def say(msg: str) -> None:
            typer.echo(f"[{time.monotonic() - t0:6.0f} s] {msg}", err=True)

        rep = run_chaos(opts, say)
        command = "jitflow bench chaos " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else "jitflow bench chaos"
        (out / "chaos.json").write_text(json.dumps(rep, indent=1, default=str))
        (out / "chaos.md").write_text(report_md(rep, command))
        typer.echo(report_md(rep, command))
        if not all(c["met"] for c in rep["checks"].values()):
            raise typer.Exit(1)
