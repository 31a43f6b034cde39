"""CLI of the request analyzer: ``jitflow patterns ...`` and ``jitflow analyzer ...``."""

from __future__ import annotations

import typer

from jitflow_server.analyzer import length_cli, patterns_cli


def register(patterns_app: typer.Typer, analyzer_app: typer.Typer) -> None:
    """Attach the pattern-graph and length-predictor commands."""
    patterns_cli.register(patterns_app, analyzer_app)
    length_cli.register(analyzer_app)
