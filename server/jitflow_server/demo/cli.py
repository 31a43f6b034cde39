"""``jitflow demo``: start the server, run the plan (and an optional comparison policy), report, stop."""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import typer

from jitflow_server.bench.server_process import ServerProcess, ServerStartError, free_port, jitflow_command
from jitflow_server.demo.plan import KINDS, REPO_ROOT, DemoConfig, DemoError, build_plan, scaled_tasks
from jitflow_server.demo.report import _run_dict, plot_report, print_summary
from jitflow_server.demo.runner import _import_examples, run_load


# ---------------------------------------------------------------------- server process
def wait_healthy(url: str, server: ServerProcess | None, timeout: float, console: Any) -> float:
    """Wait for ``url/health`` with a rich spinner; returns the wait in seconds.

    Raises:
        DemoError: the process exited or ``timeout`` s passed (with the server log's tail).
    """
    import httpx
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    t0 = time.monotonic()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=False) as prog:
        tid = prog.add_task(f"starting the jitflow server at {url} (vLLM engine) ...", total=None)
        if server is not None:
            try:
                server.wait_healthy(timeout)
            except ServerStartError as exc:
                raise DemoError(str(exc)) from None
        else:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() - t0 > timeout:
                    raise DemoError(f"the server at {url} did not become healthy within {timeout:.0f}s")
                time.sleep(1.0)
        prog.update(tid, description=f"server ready at {url}")
    return time.monotonic() - t0



def _set_policy(url: str, name: str) -> None:
    import httpx

    r = httpx.post(url + "/v1/jitflow/policy", json={"name": name}, timeout=30)
    if r.status_code >= 400:
        raise DemoError(f"could not switch the policy to {name!r}: HTTP {r.status_code} {r.text[:200]}")


def _current_policy(url: str) -> str | None:
    import httpx

    with contextlib.suppress(Exception):
        st = httpx.get(url + "/v1/jitflow/engine", timeout=10).json()
        pol = st.get("policy")
        if isinstance(pol, dict):
            pol = pol.get("name")
        return pol if isinstance(pol, str) else None
    return None


def _wait_idle(url: str, timeout: float = 60.0) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with contextlib.suppress(Exception):
            st = httpx.get(url + "/v1/jitflow/engine", timeout=10).json()
            if not st.get("unfinished") and not st.get("frontend_unfinished") and not st.get("server_in_flight"):
                return
        time.sleep(0.5)


def _healthy(url: str) -> bool:
    import httpx

    with contextlib.suppress(Exception):
        return httpx.get(url + "/health", timeout=5).status_code == 200
    return False


def run_demo(
    cfg: DemoConfig,
    *,
    data_dir: Path | None = None,
    compare: str | None = None,
    model: str = "demo",
    policy: str = "gmax",
    out: Path = Path("demo-report.json"),
    plot: Path | None = None,
    server_url: str | None = None,
    patterns: list[Path] | None = None,
    port: int = 0,
    startup_timeout: float = 300.0,
    history_db: Path | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """Run the demo end to end and return the report dict (also written to ``out`` and ``plot``).

    Args:
        cfg: load shape.
        data_dir: trace directory (AlpacaEval + Azure), or None for the built-in load.
        compare: a second policy (e.g. ``fcfs``) to replay the same load under.
        model: ``jitflow serve --model`` value.
        policy: the first run's policy.
        server_url: use this running server instead of starting one (its policy is switched
            to ``policy`` and restored afterwards).
        patterns: JSONL corpora for ``--patterns`` (default ``patterns/*.jsonl`` of the repo).
        port: server port (0 = a free one).
        history_db: the server's history DB (default: a fresh temporary file).

    Raises:
        DemoError: the server failed to start, died, or the policy could not be switched.
        ValueError: invalid ``cfg``.
    """
    import anyio
    from rich.console import Console

    import jitflow

    console = console or Console()
    cfg.validate()
    plan = build_plan(cfg, data_dir)
    plot = plot or out.with_suffix(".png")
    if patterns is None:
        patterns = sorted((REPO_ROOT / "patterns").glob("*.jsonl"))
    if _import_examples()[0] is None and (cfg.research_tasks or cfg.tot_tasks):
        console.print("[yellow]warning:[/yellow] the examples/ package is not importable (run from a source "
                      "checkout); running without compound tasks")
    server: ServerProcess | None = None
    tmp = tempfile.TemporaryDirectory(prefix="jitflow-demo-")
    t_start = time.monotonic()
    restore: str | None = None
    keep_log = False
    warnings.simplefilter("ignore", jitflow.TelemetryWarning)
    try:
        if server_url is None:
            port = port or free_port()
            url = f"http://127.0.0.1:{port}"
            args = ["--model", model, "--port", str(port), "--policy", policy,
                    "--history-db", str(history_db or Path(tmp.name) / "history.sqlite")]
            for p in patterns:
                args += ["--patterns", str(p)]
            server = ServerProcess(jitflow_command("serve", *args), Path(tmp.name) / "server.log",
                                   env={"JITFLOW_TELEMETRY": str(Path(tmp.name) / "telemetry.jsonl")})
            console.print(f"jitflow demo: model [bold]{model}[/bold], policy [bold]{policy}[/bold], "
                          f"{len(patterns)} pattern corpora, load {cfg.duration:.0f}s "
                          f"({plan.prompt_source} prompts, {plan.arrival_source} arrivals): {plan.counts()}")
            server.start()
        else:
            url = server_url.rstrip("/")
            restore = _current_policy(url)
        startup = wait_healthy(url, server, startup_timeout, console)
        if server_url is not None:
            _set_policy(url, policy)
        _warmup(url)
        runs = []
        for pol in [policy] + ([compare] if compare else []):
            if pol != policy:
                _wait_idle(url)
                _set_policy(url, pol)
                console.print(f"replaying the same load under [bold]{pol}[/bold]")
            run = anyio.run(run_load, url, plan, cfg, pol, console)
            if not _healthy(url):
                raise DemoError("the server stopped answering /health during the run"
                                + (f"; log tail:\n{server.log_tail()}" if server else ""))
            print_summary(run, console)
            runs.append(run)
        report: dict[str, Any] = {
            "model": model, "server": url, "startup_s": startup, "wall_s": None,
            "config": asdict(cfg), "data": str(data_dir) if data_dir else None,
            "plan": {"prompt_source": plan.prompt_source, "arrival_source": plan.arrival_source,
                     "counts": plan.counts()},
            "patterns": [str(p) for p in patterns] if server is not None else None,
            "runs": [_run_dict(r) for r in runs],
        }
        if compare:
            a, b = runs[0].summary, runs[1].summary
            ratio = {k: (a[k]["goodput_tokens"] / b[k]["goodput_tokens"]) if b[k]["goodput_tokens"] else None
                     for k in (*KINDS, "all")}
            report["compare"] = {"policies": [policy, compare], "goodput_ratio": ratio}
            r_all = ratio["all"]
            console.print(f"[bold]goodput ratio {policy}/{compare}: "
                          f"{'n/a' if r_all is None else f'{r_all:.2f}x'}[/bold] (per kind: "
                          + ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}x'}" for k, v in ratio.items()
                                      if k != "all") + ")")
        report["wall_s"] = time.monotonic() - t_start
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))
        plot_report(report, plot)
        console.print(f"wrote {out} and {plot} (total {report['wall_s']:.0f}s incl. {startup:.0f}s start-up)")
        errors = sum(r.status == "error" for run in runs for r in run.records) + sum(
            t.get("outcome") == "failed" for run in runs for t in run.tasks)
        if errors and server is not None:
            keep_log = True
            console.print(f"[yellow]{errors} requests/tasks failed with errors; server log kept at "
                          f"{out.with_suffix('.server.log')}[/yellow]")
        return report
    except BaseException:
        keep_log = server is not None
        raise
    finally:
        if server is not None:
            server.stop()
            if keep_log:
                with contextlib.suppress(OSError):
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.with_suffix(".server.log").write_text(server.log_path.read_text(errors="replace"))
        elif restore is not None:
            with contextlib.suppress(Exception):
                _wait_idle(url, 30)
                _set_policy(url, restore)
        tmp.cleanup()


def _warmup(url: str) -> None:
    """One plain and one JSON-schema request so start-up costs (grammar compiler) are not
    charged to the first requests of the load."""
    import httpx

    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    with contextlib.suppress(Exception):
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        httpx.post(url + "/v1/chat/completions", json={**body, "model": model}, timeout=120)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        httpx.post(url + "/v1/chat/completions", json={
            **body, "model": model, "max_tokens": 100,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}, timeout=120)


# ---------------------------------------------------------------------- CLI
def register(app: typer.Typer) -> None:
    """Attach ``jitflow demo`` to the root CLI."""

    @app.command()
    def demo(
        data: Optional[Path] = typer.Option(None, "--data", help="Trace folder with alpaca_eval/*.json and "
                                            "azure_llm_2023/*conv.csv (e.g. ../shared/data)."),
        duration: float = typer.Option(120.0, help="Seconds of load (arrivals); the run then drains."),
        compare: Optional[str] = typer.Option(None, help="Replay the same load under this policy (e.g. fcfs) "
                                              "and print the goodput ratio."),
        model: str = typer.Option("demo", help="'demo', 'tiny' or a model directory."),
        out: Path = typer.Option(Path("demo-report.json"), help="Report JSON (the plot goes next to it as .png)."),
        plot: Optional[Path] = typer.Option(None, help="Plot path (default: OUT with .png)."),
        policy: str = typer.Option("gmax", help="Policy of the first run."),
        server: Optional[str] = typer.Option(None, help="Use a running server at this URL instead of "
                                             "starting one."),
        patterns: Optional[list[Path]] = typer.Option(None, "--patterns", help="Pattern corpora (default: "
                                                      "patterns/*.jsonl)."),
        no_patterns: bool = typer.Option(False, "--no-patterns", help="Start with an empty pattern history."),
        port: int = typer.Option(0, help="Server port (0: a free port)."),
        seed: int = typer.Option(0, help="Seed of the load plan."),
        chat_rate: float = typer.Option(0.4, help="Streaming chat arrivals per second."),
        deadline_rate: float = typer.Option(0.2, help="Deadline-request arrivals per second."),
        research_tasks: Optional[int] = typer.Option(None, help="Deep-research tasks (default: 5 per 120 s of "
                                                     "load, at least 1)."),
        tot_tasks: Optional[int] = typer.Option(None, help="Tree-of-Thoughts tasks (default: 6 per 120 s of "
                                                "load, at least 1)."),
        research_deadline: float = typer.Option(60.0, help="Deep-research task deadline (s)."),
        tot_deadline: float = typer.Option(45.0, help="Tree-of-Thoughts task deadline (s)."),
        ttft: float = typer.Option(2.0, help="Chat TTFT SLO (s)."),
        tbt: float = typer.Option(0.1, help="Chat TBT SLO (s)."),
        deadline: float = typer.Option(20.0, help="Deadline-request SLO (s)."),
        grace: float = typer.Option(30.0, help="Max seconds to wait for in-flight work after the load."),
        startup_timeout: float = typer.Option(300.0, help="Max seconds to wait for the server's /health."),
    ) -> None:
        """The main job: a mixed chat / deadline / agent-task load on one server, with a goodput report."""
        from rich.console import Console

        from jitflow_server.scheduler import POLICY_NAMES

        for name, pol in (("--policy", policy), ("--compare", compare)):
            if pol is not None and pol not in POLICY_NAMES:
                raise typer.BadParameter(f"choose one of {list(POLICY_NAMES)}", param_hint=name)
        if data is not None and not data.is_dir():
            raise typer.BadParameter(f"{data} is not a directory", param_hint="--data")
        if patterns:
            for p in patterns:
                if not p.is_file():
                    raise typer.BadParameter(f"no such file: {p}", param_hint="--patterns")
        if research_tasks is None:
            research_tasks = scaled_tasks(5, duration)
        if tot_tasks is None:
            tot_tasks = scaled_tasks(6, duration)
        cfg = DemoConfig(duration=duration, chat_rate=chat_rate, deadline_rate=deadline_rate,
                         research_tasks=research_tasks, tot_tasks=tot_tasks, research_deadline=research_deadline,
                         tot_deadline=tot_deadline, ttft=ttft, tbt=tbt, deadline=deadline, grace=grace, seed=seed)
        try:
            cfg.validate()
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        console = Console()
        try:
            run_demo(cfg, data_dir=data, compare=compare, model=model, policy=policy, out=out, plot=plot,
                     server_url=server, patterns=[] if no_patterns else (list(patterns) if patterns else None),
                     port=port,
                     startup_timeout=startup_timeout, console=console)
        except DemoError as e:
            console.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
            raise typer.Exit(code=1) from None
        except KeyboardInterrupt:
            console.print("[red]interrupted[/red]; server stopped")
            raise typer.Exit(code=130) from None
