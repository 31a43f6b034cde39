"""CLI of the benchmarks (``jitflow bench ...``)."""

from __future__ import annotations

import typer

from jitflow_server.bench import (
    chaos_cli,
    engine_cli,
    fidelity_cli,
    frame_cli,
    replicas_cli,
    replicas_real,
    sim_cli,
    stepfit,
    tune_cli,
)


def register(bench_app: typer.Typer) -> None:
    """Attach every benchmark command to ``jitflow bench``."""
    chaos_cli.register(bench_app)
    frame_cli.register(bench_app)
    replicas_cli.register(bench_app)
    replicas_real.register(bench_app)
    sim_cli.register(bench_app)
    engine_cli.register(bench_app)
    fidelity_cli.register(bench_app)
    stepfit.register(bench_app)
    tune_cli.register(bench_app)
