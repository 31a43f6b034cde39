"""CLI of the output-length predictor (``jitflow analyzer train-length|eval-length``)."""

from __future__ import annotations

import typer


def register(analyzer_app: typer.Typer) -> None:
    """Attach ``train-length`` and ``eval-length`` to ``jitflow analyzer``."""
