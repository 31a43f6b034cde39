"""CLI of the output-length predictor (``jitflow analyzer train-length|eval-length``).

``train-length`` fits a :class:`~jitflow_server.analyzer.length.LengthPredictor` on AlpacaEval JSON
and/or jitflow length-telemetry JSONL and saves it. ``eval-length`` runs
:func:`jitflow_server.analyzer.length_eval.run_eval` (JITServe §4.1 evaluation: coverage and tightness
of the bound, calibrated and not, against the previous model and the empirical quantile; optionally
the deep-research stage bounds). Heavy imports happen inside the commands.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer


def register(analyzer_app: typer.Typer) -> None:
    """Attach ``train-length`` and ``eval-length`` to ``jitflow analyzer``."""

    @analyzer_app.command("train-length")
    def train_length(
        data: list[Path] = typer.Option(..., "--data", help="AlpacaEval JSON and/or jitflow telemetry JSONL (repeat)."),
        out: Path = typer.Option(None, "--out", "--model",
                                 help="Model file (default $JITFLOW_LENGTH_MODEL or ~/.cache/jitflow/models/length-qrf.pkl)."),
        quantile: float = typer.Option(0.9, "--quantile", help="Target quantile q in (0, 1)."),
        n_estimators: int = typer.Option(100, help="Trees."),
        max_depth: int = typer.Option(30, help="Maximum tree depth."),
        min_samples_leaf: int = typer.Option(5, help="Minimum training rows per leaf."),
        app: str = typer.Option(None, help="App name recorded for AlpacaEval rows."),
        jobs: int = typer.Option(-1, "--jobs", help="Threads that build the trees (-1: one per core). The model "
                                 "is the same for any value; on 2 cores -1 halves the forests' fit time."),
    ) -> None:
        """Train the QRF length upper-bound model (JITServe §4.1) and save it with a version stamp."""
        from rich.console import Console

        from jitflow_server.analyzer.length import LengthPredictor, default_model_path
        from jitflow_server.analyzer.length_data import load_examples

        console = Console(stderr=True)
        if not 0.0 < quantile < 1.0:
            raise typer.BadParameter("must be in (0, 1)", param_hint="--quantile")
        if jobs == 0 or jobs < -1:
            raise typer.BadParameter("must be -1 (one per core) or >= 1", param_hint="--jobs")
        for p in data:
            if not p.is_file():
                raise typer.BadParameter(f"file not found: {p}", param_hint="--data")
        try:
            with console.status("loading and tokenizing data"):
                examples = load_examples(data, app=app)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--data") from exc
        if not examples:
            raise typer.BadParameter("no usable examples in the data files", param_hint="--data")
        t0 = time.perf_counter()
        with console.status(f"training on {len(examples)} responses"):
            pred = LengthPredictor(quantile, n_estimators=n_estimators, max_depth=max_depth,
                                   min_samples_leaf=min_samples_leaf, fit_jobs=jobs).fit(None, None, examples=examples)
        pred.meta = {"data": [str(p) for p in data], "fit_seconds": round(time.perf_counter() - t0, 2)}
        path = pred.save(out or default_model_path())
        console.print(f"trained {pred.version} on {len(examples)} responses in {pred.meta['fit_seconds']} s "
                      f"(tokenizer {pred.tokenizer_name}); saved to {path}")
        typer.echo(str(path))

    @analyzer_app.command("eval-length")
    def eval_length(
        train: list[Path] = typer.Option(..., "--train", help="Training files (repeat)."),
        test: list[Path] = typer.Option(..., "--test", help="Test files (repeat)."),
        quantile: float = typer.Option(0.9, "--quantile", help="Target quantile q in (0, 1)."),
        out: Path = typer.Option(..., "--out", help="Output directory."),
        folds: int = typer.Option(2, help="Instruction-disjoint cross-fitting folds."),
        warmup: int = typer.Option(100, help="Stream responses before calibration coverage is counted."),
        step: float = typer.Option(0.05, help="Online calibration step (spread units)."),
        seed: int = typer.Option(0, help="Random seed."),
        stages: Path = typer.Option(None, "--stages",
                                    help="Deep-research trace JSON: also evaluate compound-stage bounds."),
    ) -> None:
        """Evaluate the length bound vs baselines; write DIR/length_eval.json, .md and .png."""
        from rich.console import Console

        console = Console(stderr=True)
        if not 0.0 < quantile < 1.0:
            raise typer.BadParameter("must be in (0, 1)", param_hint="--quantile")
        if folds < 2:
            raise typer.BadParameter("must be >= 2", param_hint="--folds")
        from jitflow_server.analyzer.length_eval import render_markdown, run_eval

        for p in list(train) + list(test) + ([stages] if stages else []):
            if not p.is_file():
                raise typer.BadParameter(f"file not found: {p}")
        t0 = time.perf_counter()
        with console.status("evaluating") as status:
            try:
                res = run_eval(list(train), list(test), quantile, out, folds=folds, warmup=warmup, step=step,
                               seed=seed, stages=stages, progress=lambda m: status.update(m))
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from exc
        console.print(f"done in {time.perf_counter() - t0:.0f} s")
        typer.echo(render_markdown(res))
