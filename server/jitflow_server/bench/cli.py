"""CLI of the benchmarks (``jitflow bench ...``)."""

from __future__ import annotations

import typer

from jitflow_server.bench import frame_cli


def register(bench_app: typer.Typer) -> None:
    """Attach every benchmark command to ``jitflow bench``."""
    frame_cli.register(bench_app)
