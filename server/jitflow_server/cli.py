"""The ``jitflow`` command line (typer).

Sub-commands are registered by the component that owns them so that each
component's CLI lives beside its code; heavy imports (vLLM, torch, sklearn)
happen inside the commands, never at start-up.
"""

from __future__ import annotations

import typer

from jitflow_server import demo as demo_cli
from jitflow_server import serve as serve_cli
from jitflow_server.analyzer import cli as analyzer_cli
from jitflow_server.bench import cli as bench_cli
from jitflow_server.engine import cli as engine_cli

app = typer.Typer(
    name="jitflow",
    help="jitflow: SLO-aware serving for agent workflows (JITServe / GMAX on vLLM).",
    no_args_is_help=True,
    add_completion=False,
)

model_app = typer.Typer(help="Build and inspect the local demo model.", no_args_is_help=True)
patterns_app = typer.Typer(help="Pattern-graph history: import, export, stats.", no_args_is_help=True)
analyzer_app = typer.Typer(help="Request analyzer: length predictor and pattern matching.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks (results as JSON + markdown + plots).", no_args_is_help=True)

app.add_typer(model_app, name="model")
app.add_typer(patterns_app, name="patterns")
app.add_typer(analyzer_app, name="analyzer")
app.add_typer(bench_app, name="bench")

serve_cli.register(app)
engine_cli.register(model_app)
analyzer_cli.register(patterns_app, analyzer_app)
bench_cli.register(bench_app)
demo_cli.register(app)


def _demo_token_counter():
    """The demo model's locally trained BPE as the analyzer's token counter (what the demo engine serves),
    named by its fingerprint, as the API names the engine's copy of it."""
    from jitflow_server.analyzer.tokens import TokenCounter
    from jitflow_server.engine.demo_model import load_demo_tokenizer

    return TokenCounter(load_demo_tokenizer())


def main() -> None:
    """Entry point of the ``jitflow`` console script."""
    from jitflow_server.analyzer.tokens import set_token_counter_factory

    set_token_counter_factory(_demo_token_counter)
    app()


if __name__ == "__main__":
    main()
