"""CLI of the engine layer: ``jitflow model build-demo`` and ``jitflow model profile`` (the serving
commands, which also need the API, live in ``jitflow_server/serve.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from jitflow_server.engine.demo_model import VARIANTS


def register(model_app: typer.Typer) -> None:
    """Attach the model commands."""

    @model_app.command("build-demo")
    def build_demo(
        out: Optional[Path] = typer.Option(None, help="Target directory (default: ~/.cache/jitflow/models/VARIANT)."),
        variant: str = typer.Option("demo", help=f"One of {sorted(VARIANTS)}."),
        force: bool = typer.Option(False, help="Rebuild even if a complete build exists."),
    ) -> None:
        """Build the deterministic random-weight Llama + locally trained BPE tokenizer (no network)."""
        from jitflow_server.engine.demo_model import build_demo_model

        if variant not in VARIANTS:
            raise typer.BadParameter(f"unknown variant {variant!r}; choose one of {sorted(VARIANTS)}",
                                     param_hint="--variant")
        path = build_demo_model(variant, out, force=force)
        meta = json.loads((path / "jitflow-demo.json").read_text())
        typer.echo(f"{variant} model at {path} ({meta['parameters'] / 1e6:.1f} M parameters)")

    @model_app.command("profile")
    def profile_demo(
        variant: str = typer.Option("demo", help=f"One of {sorted(VARIANTS)}."),
        batches: str = typer.Option("1,8,32,64", help="Comma-separated batch sizes."),
        out: Optional[Path] = typer.Option(None, help="Write the measurements as JSON here."),
    ) -> None:
        """Measure decode-step and prefill times of a demo model with vLLM on this machine."""
        from jitflow_server.engine.demo_model import measure_step_times

        try:
            bs = tuple(int(x) for x in batches.split(",") if x.strip())
        except ValueError:
            raise typer.BadParameter("batch sizes must be integers", param_hint="--batches") from None
        if not bs or min(bs) < 1:
            raise typer.BadParameter("need at least one positive batch size", param_hint="--batches")
        res = measure_step_times(variant, bs)
        typer.echo(f"{variant}: {res['parameters'] / 1e6:.0f} M parameters, engine start {res['startup_s']} s")
        typer.echo("| batch | decode step (ms) |\n|---:|---:|")
        for b, ms in res["decode_step_ms"].items():
            typer.echo(f"| {b} | {ms} |")
        for n, ms in res["prefill_ms"].items():
            typer.echo(f"prefill of {n} tokens: {ms} ms")
        if out is not None:
            out.write_text(json.dumps(res, indent=2))
