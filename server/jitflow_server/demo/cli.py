"""``jitflow demo``: the command line of the main job (``demo/main.py`` runs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from jitflow_server.demo.plan import DemoConfig, DemoError


def register(app: typer.Typer) -> None:
    """Attach ``jitflow demo`` to the root CLI."""

    @app.command()
    def demo(
        data: Optional[Path] = typer.Option(None, "--data", help="Trace folder with alpaca_eval/*.json and "
                                            "azure_llm_2023/*conv.csv (e.g. ../shared/data): prompts, arrivals and "
                                            "the length model's training data."),
        baseline: str = typer.Option("vllm", help="vllm: stock vLLM scheduling (no plug-in) | a jitflow policy "
                                     "(e.g. fcfs) | none: jitflow only."),
        policy: str = typer.Option("gmax", help="jitflow's policy."),
        param: list[str] = typer.Option([], "--param", help="jitflow policy parameter NAME=VALUE (repeatable; "
                                        "docs/scheduling.md)."),
        phase_duration: float = typer.Option(40.0, help="Seconds of arrivals per phase."),
        normal_load: float = typer.Option(0.7, help="Normal phase load (× measured capacity)."),
        burst_load: float = typer.Option(1.5, help="Burst phase load (× measured capacity)."),
        capacity: Optional[float] = typer.Option(None, help="Skip the measurement: capacity in load-scale "
                                                 "units (1 = 0.4 chat/s, 0.2 deadline/s, 2.5 deep-research and "
                                                 "3 tree-of-thoughts tasks per minute)."),
        recalibrate: bool = typer.Option(False, help="Measure the capacity even if this machine is cached."),
        model: str = typer.Option("auto", help="'auto' (demo, or demo-small on a CPU too slow for it: "
                                  "docs/demo-model.md), 'demo', 'demo-small', 'tiny' or a model directory."),
        out: Path = typer.Option(Path("demo-report.json"), help="Report JSON (.md and .png go next to it)."),
        patterns: Optional[list[Path]] = typer.Option(None, "--patterns", help="Pattern corpora (default: "
                                                      "patterns/*.jsonl)."),
        no_patterns: bool = typer.Option(False, "--no-patterns", help="Start with an empty pattern history."),
        seed: int = typer.Option(0, help="Seed of the load plans."),
        research_deadline: float = typer.Option(60.0, help="Deep-research task deadline (s)."),
        tot_deadline: float = typer.Option(45.0, help="Tree-of-Thoughts task deadline (s)."),
        ttft: float = typer.Option(2.0, help="Chat TTFT SLO (s)."),
        tbt: float = typer.Option(0.1, help="Chat TBT SLO (s)."),
        deadline: float = typer.Option(20.0, help="Deadline-request SLO (s)."),
        grace: float = typer.Option(20.0, help="Max seconds chat requests may run after a phase's arrivals end."),
        startup_timeout: float = typer.Option(300.0, help="Max seconds to wait for each server's /health."),
        scale_slos: bool = typer.Option(True, help="Stretch the time SLOs above by this machine's measured step "
                                        "time against the 125 ms they are set for (1-4×: a faster engine keeps "
                                        "them as set), as the load is sized by its capacity."),
        together: bool = typer.Option(False, "--together/--in-turn", help="Run both schedulers at once, each "
                                      "engine on its own half of the cores, so both see the machine at the same "
                                      "moments but no core is left for the servers' own processes (costs the "
                                      "scheduler with more work speed; docs/quickstart.md), or one after the "
                                      "other on every core (the default)."),
        events: bool = typer.Option(False, "--events", help="Record the servers' request lifecycle events "
                                    "during the phases in <out>.events.jsonl (to trace a run afterwards)."),
    ) -> None:
        """The main job: measure this machine, then serve a mixed chat / deadline / agent-task load at 0.7× and
        1.5× its capacity under stock vLLM and under jitflow, on the same arrivals, and report both."""
        from rich.console import Console

        from jitflow_server.demo.main import DemoOptions, run_demo
        from jitflow_server.serve import served_policies

        valid = served_policies()
        if policy not in valid:
            raise typer.BadParameter(f"choose one of {valid}", param_hint="--policy")
        if baseline not in ("vllm", "none", *valid):
            raise typer.BadParameter(f"choose vllm, none or one of {valid}", param_hint="--baseline")
        if data is not None and not data.is_dir():
            raise typer.BadParameter(f"{data} is not a directory", param_hint="--data")
        for p in patterns or []:
            if not p.is_file():
                raise typer.BadParameter(f"no such file: {p}", param_hint="--patterns")
        slos = DemoConfig(ttft=ttft, tbt=tbt, deadline=deadline, research_deadline=research_deadline,
                          tot_deadline=tot_deadline, grace=grace)
        opts = DemoOptions(data_dir=data, model=model, policy=policy, baseline=baseline, phase_duration=phase_duration,
                           normal_load=normal_load, burst_load=burst_load, capacity_scale=capacity,
                           recalibrate=recalibrate, slos=slos, seed=seed, out=out,
                           patterns=[] if no_patterns else (list(patterns) if patterns else None),
                           startup_timeout=startup_timeout, params=list(param), scale_slos=scale_slos,
                           together=together, events=events)
        try:
            opts.validate()
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        # Never cut tables at 80 columns when the output is a file or a pipe.
        console = Console() if Console().is_terminal else Console(width=220)
        try:
            run_demo(opts, console)
        except DemoError as e:
            console.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
            raise typer.Exit(code=1) from None
        except KeyboardInterrupt:
            console.print("[red]interrupted[/red]; servers stopped")
            raise typer.Exit(code=130) from None
