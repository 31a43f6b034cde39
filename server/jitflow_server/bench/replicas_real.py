"""``jitflow bench replicas-real``: real vLLM replicas behind the router front end, against one replica.

N replicas of the demo model (``jitflow vllm-serve`` with the jitflow plug-in), each held to one CPU
core (``taskset`` and vLLM's ``VLLM_CPU_OMP_THREADS_BIND``), serve the mixed workload of ``jitflow bench
engine`` through two front ends (``jitflow serve --replica ...``): one over the first replica alone and
one over all of them, on the same arrivals (per seed; the order of the two alternates between seeds).
Reported per seed and as mean ± 95 % interval: token and request goodput of each, and their ratio
(the pool over one replica). Writes ``DIR/replicas-real.json`` and ``replicas-real.md``.

The front ends and the load generator are not pinned: on a machine with as many cores as replicas
they take CPU time from the replicas, which the numbers include.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from jitflow_server.scheduler.admission import DEFAULT_WAITING_TIME_S


def _replica(model: str, core: str, batch_size: int, log: Path):
    from jitflow_server.bench.server_process import ServerProcess, free_port, jitflow_command

    cmd = ["taskset", "-c", core, *jitflow_command("vllm-serve", "--model", model, "--port", str(free_port()),
                                                    "--policy", "gmax", "--batch-size", str(batch_size),
                                                    "--max-model-len", "8192")]
    return ServerProcess(cmd, log, {"VLLM_CPU_OMP_THREADS_BIND": core}, startup_timeout=600)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (0.0 once it is gone)."""
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def burst_tok_s(urls: list[str], n: int, tokens: int) -> list[float]:
    """Output tokens/s of each replica in ``urls`` while all of them serve, at once, ``n`` requests of exactly
    ``tokens`` output tokens each, sent straight to the replicas (no front end): the engines' own capacity,
    alone (one URL) or side by side (all of them). Raises ``httpx.HTTPError`` on a failed request."""
    import asyncio

    import httpx

    async def one_replica(client: httpx.AsyncClient, url: str) -> float:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()

        async def call(i: int) -> None:
            r = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": [10 + (i + k) % 500 for k in range(64)], "max_tokens": tokens,
                "ignore_eos": True, "temperature": 0})
            r.raise_for_status()

        await asyncio.gather(*(call(i) for i in range(n)))
        return n * tokens / (time.perf_counter() - t0)

    async def run() -> list[float]:
        async with httpx.AsyncClient(timeout=600) as client:
            return list(await asyncio.gather(*(one_replica(client, u) for u in urls)))

    return asyncio.run(run())


#: Jobs of the sample :func:`rps_for_load` averages a job's output tokens over.
LOAD_SAMPLE_JOBS = 2000


def rps_for_load(load: float, replica_tok_s: float, sample: list) -> float:
    """Requests/s that offer ``load`` × ``replica_tok_s`` output tokens/s with jobs like ``sample`` (a
    list of :class:`~jitflow_server.engine.jobs.Job`; a compound job's tokens are all its calls'). The
    capacity is the replica's decode rate (B requests × 256 tokens, :func:`burst_tok_s`), so prefill is not
    counted: a load of 1 is at or past what one replica finishes; with ``replica_tok_s`` from
    :func:`workload_tok_s` it is the replica's rate on the workload itself. Raises ``ValueError`` for an
    empty sample or a non-positive load or rate."""
    if not sample or load <= 0 or replica_tok_s <= 0:
        raise ValueError("load and replica_tok_s must be > 0 and the sample non-empty")
    per_job = sum(j.total_tokens[1] for j in sample) / len(sample)
    return load * replica_tok_s / max(per_job, 1.0)


#: The capacity run of ``--load-basis workload``: seconds of the closed loop, and the seconds after its
#: start before the counting window opens (the window ends when the loop stops starting jobs).
WORKLOAD_CAPACITY_S = 40.0
WORKLOAD_SETTLE_S = 10.0


def counter_rate(samples: list[tuple[float, float]], t_from: float, t_to: float) -> float:
    """Mean rise per second of a counter sampled as ``(time s, value)`` pairs (in time order) over
    ``[t_from, t_to]``: from the last sample at or before ``t_from`` (else the first) to the first at or
    after ``t_to`` (else the last). Raises ``ValueError`` when fewer than two samples, or none apart in
    time, cover the window."""
    if len(samples) < 2 or t_to <= t_from:
        raise ValueError("need two counter samples and t_to > t_from")
    before = [s for s in samples if s[0] <= t_from]
    after = [s for s in samples if s[0] >= t_to]
    (t0, v0), (t1, v1) = (before[-1] if before else samples[0]), (after[0] if after else samples[-1])
    if t1 <= t0 or t1 < t_from or t0 > t_to:
        raise ValueError("the counter samples do not cover the window")
    return (v1 - v0) / (t1 - t0)


def workload_tok_s(front_url: str, model_name: str, replica_url: str, jobs: list, in_flight: int,
                   seconds: float = WORKLOAD_CAPACITY_S, settle_s: float = WORKLOAD_SETTLE_S,
                   period_s: float = 1.0) -> tuple[float, list]:
    """One replica's output tokens/s while it serves the workload itself through the front end at
    ``front_url``: ``jobs`` run in a closed loop, ``in_flight`` at a time in list order, for ``seconds``
    (no admission waiting time: nothing is refused, and no queue grows), and the rate is the rise of the
    replica's own ``vllm:generation_tokens_total`` (read from its ``/metrics`` every ``period_s`` s, each
    read stamped at the middle of its round trip) from ``settle_s`` to ``seconds`` after the start. Unlike
    :func:`burst_tok_s` this counts what the workload's calls cost: the prefill of their prompts, the
    prefix-cache hits of a task's stages, their output lengths. An open-loop overload is not used: at 4×
    the decode-basis load one replica thrashed (prompt tokens 425–700/s, output 52–76/s in vLLM's own log,
    2026-12-07). It reads below what the arrival mix sustains: a closed loop holds more of the long,
    prompt-heavy jobs in flight than arrive, since each stays longer, and one replica met 0.89-0.98 of
    its SLOs at 3x this rate (40 s of arrivals, SLOs x2; docs/benchmarks.md, "Real replicas behind the
    router front end"). Returns the rate and the samples ``[(seconds from the start, tokens)]``. Raises
    ``ValueError`` when the counter was not read across the window, ``httpx.HTTPError`` from the replay."""
    import threading

    import httpx

    from jitflow_server.bench.real import run_jobs_real
    from jitflow_server.engine.replica_probe import GEN_TOKENS, read_vllm_metrics

    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def read(client: httpx.Client) -> None:
        t0 = time.time()
        try:
            v = read_vllm_metrics(client.get(replica_url + "/metrics").text).get(GEN_TOKENS)
        except (httpx.HTTPError, ValueError):
            return
        if v is not None:
            samples.append(((t0 + time.time()) / 2, v))

    def sample() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                read(client)
                stop.wait(period_s)

    reader = threading.Thread(target=sample, name="workload-capacity-metrics", daemon=True)
    reader.start()
    try:
        res = run_jobs_real(front_url, model_name, jobs, None, 998, closed_loop=(in_flight, seconds))
    finally:
        stop.set()
        reader.join(timeout=60)
    with httpx.Client(timeout=30) as client:
        read(client)  # after the last call: the samples span every token of the run
    rel = [(t - res["t_start"], v) for t, v in samples]
    return counter_rate(rel, settle_s, seconds), rel


def _summary(per: dict[str, list[float]]) -> dict:
    import numpy as np

    from jitflow_server.bench.metrics import ci95

    return {k: {"mean": float(np.mean(v)), "ci95": ci95(v), "per_seed": v} for k, v in per.items()}


def register(bench_app: typer.Typer) -> None:
    """Attach ``replicas-real`` to ``jitflow bench``."""

    @bench_app.command("replicas-real")
    def replicas_real(
        out: Path = typer.Option(..., "--out", help="Output directory."),
        cores: str = typer.Option("0,1", "--cores", help="One replica per listed CPU core."),
        model: str = typer.Option("demo", "--model", help="demo | tiny | model directory."),
        batch_size: int = typer.Option(16, "--batch-size", min=1, help="B of each replica."),
        rps: float = typer.Option(1.0, "--rps", min=0.01, help="Offered load (requests/s); see --load."),
        load: Optional[float] = typer.Option(None, "--load", min=0.01, help="Offered load as a multiple of one "
                                             "replica's measured output tok/s (overrides --rps)."),
        load_basis: str = typer.Option("decode", "--load-basis", help="The output tok/s --load multiplies: "
                                       "'decode' (one replica on B requests x 256 tokens) or 'workload' (one "
                                       "replica behind its front end serving this workload itself, 2·B jobs "
                                       f"in flight for {WORKLOAD_CAPACITY_S:g} s, before the seeds; it reads "
                                       "below what the arrival mix sustains, see docs/benchmarks.md)."),
        duration: float = typer.Option(60.0, "--duration", min=1.0, help="Arrival window (s)."),
        seeds: int = typer.Option(3, "--seeds", min=1),
        router: str = typer.Option("goodput", "--router", help="Router of the pool's front end."),
        engine_admission: bool = typer.Option(False, "--engine-admission", help="Both front ends let the "
                                              "replicas judge admission (`jitflow serve --engine-admission`)."),
        length_scale: float = typer.Option(0.0625, "--length-scale", min=0.001),
        tightness: float = typer.Option(2.0, "--tightness", min=0.01, help="SLO scale (as `bench engine`)."),
        waiting_time: float = typer.Option(DEFAULT_WAITING_TIME_S, "--waiting-time", min=0.0, help="Admission waiting_time s."),
        preset: str = typer.Option("cpu-demo", "--preset", help="Step model of the analyzer's time model."),
        data: Optional[Path] = typer.Option(None, "--data", help="Trace directory (default ../shared/data)."),
        warmup: float = typer.Option(10.0, "--warmup", min=0.0, help="Seconds of unrecorded load per front end."),
    ) -> None:
        """Real replicas, one CPU core each, behind the router front end: the pool against one replica."""
        import httpx
        from rich.console import Console

        from jitflow_server.bench.engine_cli import server_setup, workload_setup
        from jitflow_server.bench.metrics import summarize
        from jitflow_server.bench.real import BenchServer, EngineBenchError, run_jobs_real
        from jitflow_server.bench.server_process import ServerStartError
        from jitflow_server.bench.sim_cli import resolve_data
        from jitflow_server.bench.workload import make_workload

        if load_basis not in ("decode", "workload"):
            raise typer.BadParameter("choose 'decode' or 'workload'", param_hint="--load-basis")
        core_list = [c.strip() for c in cores.split(",") if c.strip()]
        if len(core_list) < 2:
            raise typer.BadParameter("list at least two cores", param_hint="--cores")
        con = Console()
        # SIGTERM (timeout, kill, CI) unwinds through the finally below: no replica or front end outlives the run
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        data_dir = resolve_data(data)
        pm, ds, _ = workload_setup(preset, data_dir, duration, rps, 0, length_scale, tightness, out)
        reps = [_replica(model, c, batch_size, out / f"replica-{c}.log") for c in core_list]
        runs: dict[str, list[dict]] = {"one": [], "pool": []}
        engines: dict[str, list[float]] = {}
        fronts: dict[str, BenchServer] = {}
        try:
            for r in reps:
                r.start()
            for r, c in zip(reps, core_list):
                waited = r.wait_healthy()
                con.print(f"replica on core {c}: {r.base_url} ({waited:.0f} s)")
            # the engines' capacity without any front end: each replica alone, then all side by side
            urls_all = [r.base_url for r in reps]
            burst_tok_s(urls_all, batch_size, 32)  # warm-up
            engines = {"alone_tok_s": [burst_tok_s([u], batch_size, 256)[0] for u in urls_all],
                       "together_tok_s": burst_tok_s(urls_all, batch_size, 256)}
            con.print(f"engine output tok/s, {batch_size} requests × 256 tokens: alone "
                      f"{[round(x) for x in engines['alone_tok_s']]}, side by side "
                      f"{[round(x) for x in engines['together_tok_s']]}")
            for name, members in (("one", reps[:1]), ("pool", reps)):
                sub = out / name
                sub.mkdir(parents=True, exist_ok=True)
                args, env = server_setup(sub, ds, pm, batch_size, length_scale)
                urls = [a for r in members for a in ("--replica", r.base_url)]
                routing = ["--router", router, *(["--engine-admission"] if engine_admission else [])]
                fronts[name] = BenchServer(model, "gmax", batch_size, None, [*args, *urls, *routing],
                                           log_path=sub / "front.log", env=env).__enter__()
            if load is not None:
                sample = make_workload(LOAD_SAMPLE_JOBS, 1.0, data=ds, seed=999, length_scale=length_scale,
                                       max_context=8000, tightness=tightness)
                basis_tok_s = engines["alone_tok_s"][0]
                if load_basis == "workload":
                    con.print(f"measuring one replica on the workload itself: {2 * batch_size} jobs in flight "
                              f"for {WORKLOAD_CAPACITY_S:g} s ...")
                    one = fronts["one"]
                    basis_tok_s, samples = workload_tok_s(one.base_url, one.model_name, reps[0].base_url, sample,
                                                          2 * batch_size)
                    one.wait_idle()
                    engines["workload_tok_s"], engines["workload_samples"] = basis_tok_s, samples
                rps = rps_for_load(load, basis_tok_s, sample)
                con.print(f"load {load:g}× one replica's {basis_tok_s:.0f} output tok/s ({load_basis}): "
                          f"{rps:.2f} req/s")
            if warmup > 0:
                warm = make_workload(max(1, int(round(warmup * rps))), rps, data=ds, seed=1000,
                                     length_scale=length_scale, max_context=8000, tightness=tightness)
                for srv in fronts.values():
                    run_jobs_real(srv.base_url, srv.model_name, warm, waiting_time or None, 1000)
                    srv.wait_idle()
            for seed in range(seeds):
                jobs = make_workload(max(1, int(round(duration * rps))), rps, data=ds, seed=seed,
                                     length_scale=length_scale, max_context=8000, tightness=tightness)
                span = (jobs[-1].arrival - jobs[0].arrival) if len(jobs) > 1 else 1.0
                order = ["one", "pool"] if seed % 2 == 0 else ["pool", "one"]
                for name in order:
                    srv = fronts[name]
                    st0 = srv.stats()
                    t0, front0, load0 = time.time(), _cpu_s(srv.proc.pid), time.process_time()
                    res = run_jobs_real(srv.base_url, srv.model_name, jobs, waiting_time or None, seed)
                    st = srv.wait_idle()
                    m = summarize(res["jobs"], span, res["makespan"])
                    # the CPU the unpinned front end and load generator took from the replicas' cores
                    m["front_end_cpu_s"] = _cpu_s(srv.proc.pid) - front0
                    m["load_generator_cpu_s"] = time.process_time() - load0
                    m["routed"] = [r["routed"] - r0["routed"] for r, r0 in zip(st["replicas"], st0["replicas"])]
                    m["rerouted"], m["wall_s"] = st["rerouted"] - st0["rerouted"], time.time() - t0
                    for k in ("handed_over", "refused_by_replica", "refused_at_front"):
                        m[k] = st.get(k, 0) - st0.get(k, 0)  # admission refusals: by whom (docs/deployment.md)
                    m["decision_us"] = st.get("decision_us")  # the router's decision time (the last 2 000)
                    m["decision_cpu_us"] = st.get("decision_cpu_us")  # the same decisions' CPU time
                    runs[name].append(m)
                    con.print(f"seed {seed} {name}: token goodput {m['token_goodput']:.1f} tok/s, request goodput "
                              f"{m['request_goodput']:.3f} req/s, attainment {m['slo_attainment']:.2f}, "
                              f"routed {m['routed']}, CPU s front end {m['front_end_cpu_s']:.0f}, load "
                              f"generator {m['load_generator_cpu_s']:.0f} of {m['wall_s']:.0f} s")
        except (EngineBenchError, ServerStartError, httpx.HTTPError, ValueError) as exc:
            con.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(1) from None
        finally:
            for srv in fronts.values():
                srv.stop()
            for r in reps:
                r.stop()
        ratio = {k: [p[k] / o[k] if o[k] else float("nan") for p, o in zip(runs["pool"], runs["one"])]
                 for k in ("token_goodput", "request_goodput", "throughput")}
        res = {"config": {"model": model, "cores": core_list, "batch_size": batch_size, "rps": rps, "load": load,
                          "load_basis": load_basis if load is not None else None,
                          "duration": duration, "seeds": seeds, "router": router, "engine_admission": engine_admission,
                          "length_scale": length_scale,
                          "tightness": tightness, "waiting_time": waiting_time, "data": ds.origin,
                          "command": " ".join(["jitflow", "bench", "replicas-real", *sys.argv[3:]])},
               "engines": engines, "one": runs["one"], "pool": runs["pool"], "pool_over_one": _summary(ratio)}
        out.mkdir(parents=True, exist_ok=True)
        (out / "replicas-real.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "replicas-real.md").write_text(_markdown(res))
        con.print(_markdown(res))


def _pair(d: dict[str, float | None] | None) -> str:
    """``"P50 / P99"`` of a decision-time summary (µs), ``"—"`` when absent (an older front end)."""
    if not d or d.get("p50") is None or d.get("p99") is None:
        return "—"
    return f"{d['p50']:.0f} / {d['p99']:.0f}"


def _markdown(res: dict) -> str:
    c = res["config"]
    lines = [f"# {len(c['cores'])} real replicas (one core each) behind the router vs one replica",
             "", f"`{c['command']}`", "",
             f"Model {c['model']}, B={c['batch_size']}, {c['rps']:.2f} req/s"
             + (f" ({c['load']:g}× one replica's output tok/s, {c.get('load_basis') or 'decode'} basis)"
                if c.get("load") else "")
             + f" for {c['duration']:g} s, router "
             f"{c['router']}, admission judged by the "
             f"{'replicas' if c.get('engine_admission') else 'front end (no token by the waiting time)'}, "
             f"seeds 0–{c['seeds'] - 1}.", "",
             f"Engines alone (output tok/s, B requests × 256 tokens, no front end): "
             f"{[round(x) for x in res['engines'].get('alone_tok_s', [])]}; side by side: "
             f"{[round(x) for x in res['engines'].get('together_tok_s', [])]}."
             + (f" One replica on the workload itself (2·B jobs in flight, behind its front end): "
                f"{res['engines']['workload_tok_s']:.0f} output tok/s." if "workload_tok_s" in res["engines"]
                else ""), "",
             "| seed | one: token goodput | pool: token goodput | one: request goodput | pool: request goodput "
             "| pool routed per replica | CPU s of front end + load generator (one; pool) "
             "| pool routing decision µs P50 / P99: wall; CPU |",
             "|---:|---:|---:|---:|---:|---|---|---|"]
    for s, (o, p) in enumerate(zip(res["one"], res["pool"])):
        cpu = "; ".join(f"{r.get('front_end_cpu_s', 0) + r.get('load_generator_cpu_s', 0):.0f} of {r['wall_s']:.0f}"
                        for r in (o, p))
        lines.append(f"| {s} | {o['token_goodput']:.1f} | {p['token_goodput']:.1f} | {o['request_goodput']:.3f} "
                     f"| {p['request_goodput']:.3f} | {p['routed']} | {cpu} "
                     f"| {_pair(p.get('decision_us'))}; {_pair(p.get('decision_cpu_us'))} |")
    lines += ["", "Decision times are over the front end's last 2 000 decisions, so a seed's row includes the "
              "seeds before it. The wall time counts the waits for a core the replicas keep busy; the CPU "
              "time, in the front end's thread, leaves them out."]
    lines += ["", "| pool / one | mean | 95 % interval |", "|---|---:|---:|"]
    for k, v in res["pool_over_one"].items():
        ci = f"± {v['ci95']:.2f}" if v["ci95"] is not None else "—"
        lines.append(f"| {k} | {v['mean']:.2f} | {ci} |")
    return "\n".join(lines) + "\n"
