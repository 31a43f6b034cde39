"""CLI of the pattern-graph history (``jitflow patterns ...``, ``jitflow analyzer eval-patterns``).

Commands:

* ``jitflow patterns import FILE --app NAME [--format auto|deepresearch|jsonl] [--db PATH] [--cluster]``
* ``jitflow patterns export --app NAME [--db PATH] [--out FILE]`` (JSONL to stdout by default)
* ``jitflow patterns stats [--db PATH] [--json]``
* ``jitflow patterns cluster [--app NAME] [--k K] [--db PATH]``
* ``jitflow analyzer eval-patterns --history FILE [--test FILE] --out DIR [--seed N] ...``

The database defaults to ``$JITFLOW_HISTORY_DB`` or ``~/.cache/jitflow/history.sqlite``.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

FORMATS = ("auto", "deepresearch", "jsonl")


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code=2)


def _load(path: Path, fmt: str, app: Optional[str]) -> list:
    """Load graphs from ``path``; ``app`` overrides/sets the app name. Errors exit with code 2."""
    from jitflow_server.analyzer.patterns import load_deepresearch
    from jitflow_server.store.graph import PatternFormatError, PatternGraph
    from jitflow_server.store.jsonl import read_jsonl

    if fmt not in FORMATS:
        raise typer.BadParameter(f"--format must be one of {', '.join(FORMATS)}")
    if not path.is_file():
        _fail(f"no such file: {path}")
    if fmt == "auto":
        fmt = "jsonl" if path.suffix.lower() in (".jsonl", ".ndjson") else "deepresearch"
    try:
        if fmt == "deepresearch":
            graphs = load_deepresearch(path, app or "deep-research")
        else:
            graphs = list(read_jsonl(path))
            if app is not None:
                graphs = [PatternGraph(app, g.nodes, g.stage_names, outcome=g.outcome, task_id=g.task_id,
                                       meta=g.meta) for g in graphs]
    except (PatternFormatError, UnicodeDecodeError) as e:
        _fail(f"{path}: {e}")
    if not graphs:
        _fail(f"{path}: no pattern graphs found")
    return graphs


def _open_store(db: Optional[Path]):
    from jitflow_server.store.history import HistoryStore, HistoryStoreError

    try:
        return HistoryStore(db)
    except HistoryStoreError as e:
        _fail(str(e))


def register(patterns_app: typer.Typer, analyzer_app: typer.Typer) -> None:
    """Attach ``import``/``export``/``stats``/``cluster`` and ``eval-patterns``."""

    @patterns_app.command("import")
    def import_cmd(
        file: Path = typer.Argument(..., help="Trace file: deep-research JSON or jitflow JSONL."),
        app: str = typer.Option(..., "--app", help="Application name to store the graphs under."),
        fmt: str = typer.Option("auto", "--format", help="auto | deepresearch | jsonl (auto: by extension)."),
        db: Optional[Path] = typer.Option(None, "--db", help="History DB (default $JITFLOW_HISTORY_DB or "
                                          "~/.cache/jitflow/history.sqlite)."),
        cluster: bool = typer.Option(True, "--cluster/--no-cluster", help="Re-run K-medoids for the app."),
    ) -> None:
        """Import finished pattern graphs into the history store."""
        graphs = _load(file, fmt, app)
        store = _open_store(db)
        try:
            ids = store.insert_many(graphs)
            msg = f"imported {len(ids)} graphs for app {app!r} into {store.path} (app now has {store.count(app)})"
            if cluster:
                from jitflow_server.analyzer.clustering import cluster_history

                res = cluster_history(store, app)
                if app in res:
                    msg += f"; {res[app].k} K-medoids clusters"
        finally:
            store.close()
        typer.echo(msg)

    @patterns_app.command("export")
    def export_cmd(
        app: str = typer.Option(..., "--app", help="Application to export."),
        db: Optional[Path] = typer.Option(None, "--db", help="History DB path."),
        out: Optional[Path] = typer.Option(None, "--out", help="Output JSONL file (default: stdout)."),
    ) -> None:
        """Export an app's graphs as jitflow JSONL (one graph per line)."""
        from jitflow_server.store.jsonl import write_jsonl

        store = _open_store(db)
        try:
            rows = store.candidates(app)
        finally:
            store.close()
        if not rows:
            _fail(f"no graphs for app {app!r}")
        if out is None:
            write_jsonl((r.graph for r in rows), sys.stdout)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "w", encoding="utf-8") as fh:
                n = write_jsonl((r.graph for r in rows), fh)
            typer.echo(f"wrote {n} graphs to {out}", err=True)

    @patterns_app.command("stats")
    def stats_cmd(
        db: Optional[Path] = typer.Option(None, "--db", help="History DB path."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """Summarise the history store: graphs per app, stages, bytes per graph, weights, clusters."""
        store = _open_store(db)
        try:
            st = store.stats()
        finally:
            store.close()
        if as_json:
            typer.echo(json.dumps(st, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"pattern history {st['path']} ({st['total_graphs']} graphs, capacity {st['capacity']})")
        for c in ("app", "graphs", "stages", "blob B/graph", "JSONL B/graph", "mean weight", "hits",
                  "clusters", "unclustered"):
            t.add_column(c)
        for app, a in st["apps"].items():
            t.add_row(app, str(a["graphs"]), " ".join(f"{k}:{v}" for k, v in a["stages_hist"].items()),
                      f"{a['blob_bytes_mean']:.0f}", f"{a['json_bytes_mean']:.0f}", f"{a['weight_mean']:.3f}",
                      str(a["hits_total"]), str(a["clusters"]), str(a["unclustered"]))
        Console().print(t)

    @patterns_app.command("cluster")
    def cluster_cmd(
        app: Optional[str] = typer.Option(None, "--app", help="One app (default: all)."),
        k: Optional[int] = typer.Option(None, "--k", min=1, help="Clusters per app (default sqrt(n/2))."),
        db: Optional[Path] = typer.Option(None, "--db", help="History DB path."),
        seed: int = typer.Option(0, "--seed"),
    ) -> None:
        """Re-run offline K-medoids clustering (FasterPAM) of the stored graphs."""
        store = _open_store(db)
        try:
            from jitflow_server.analyzer.clustering import cluster_history

            res = cluster_history(store, app, k, seed=seed)
        finally:
            store.close()
        if not res:
            _fail("no graphs to cluster")
        for a, r in res.items():
            typer.echo(f"{a}: {r.n_graphs} graphs -> {r.k} clusters, loss {r.loss:.2f}, {r.seconds:.2f} s")

    @analyzer_app.command("eval-patterns")
    def eval_patterns_cmd(
        history: Path = typer.Option(..., "--history", help="History trace (deep-research JSON or JSONL)."),
        test: Optional[Path] = typer.Option(None, "--test", help="Held-out trace; omitted: split --history."),
        out: Path = typer.Option(..., "--out", help="Output directory."),
        fmt: str = typer.Option("auto", "--format", help="auto | deepresearch | jsonl."),
        seed: int = typer.Option(0, "--seed", help="Split / resampling seed."),
        test_frac: float = typer.Option(0.3, "--test-frac", min=0.05, max=0.9, help="Held-out fraction."),
        sizes: str = typer.Option("50,100,200,500,1000,2000,5000", "--sizes", help="History sizes (Fig. 7a)."),
        jitter: float = typer.Option(0.15, "--jitter", min=0.0, help="Log-normal σ for resampled graphs."),
        time_model: str = typer.Option("cpu-demo", "--time-model",
                                       help="cpu-demo | a100-8b | 'PREFILL_MS,DECODE_MS' per token."),
    ) -> None:
        """Reproduce JITServe Fig. 7 (a, b) and App. B on a trace; writes DIR/pattern_eval.json + plots."""
        import numpy as np
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        from jitflow_server.analyzer.pattern_eval import evaluate, write_report
        from jitflow_server.analyzer.subdeadline import CallTimeModel

        try:
            tm = CallTimeModel.from_name(time_model)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--time-model") from e
        try:
            size_list = [int(s) for s in sizes.split(",") if s.strip()]
        except ValueError as e:
            raise typer.BadParameter(f"bad --sizes {sizes!r}", param_hint="--sizes") from e
        if not size_list or min(size_list) < 1:
            raise typer.BadParameter("sizes must be positive integers", param_hint="--sizes")
        hist = _load(history, fmt, None)
        if test is not None:
            tst = _load(test, fmt, None)
        else:
            rng = np.random.default_rng(seed)
            perm = rng.permutation(len(hist))
            n_test = max(1, int(round(test_frac * len(hist))))
            if n_test >= len(hist):
                _fail("history too small to split")
            tst = [hist[i] for i in sorted(perm[:n_test])]
            hist = [hist[i] for i in sorted(perm[n_test:])]
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      transient=True) as prog:
            task = prog.add_task("eval-patterns", total=None)
            try:
                res = evaluate(hist, tst, time_model=tm, sizes=size_list, jitter=jitter, seed=seed,
                               progress=lambda s: prog.update(task, description=s))
            except ValueError as e:
                _fail(str(e))
        parts = ["jitflow", "analyzer", "eval-patterns", "--history", str(history)]
        if test is not None:
            parts += ["--test", str(test)]
        else:
            parts += ["--test-frac", str(test_frac)]
        parts += ["--out", str(out), "--seed", str(seed), "--sizes", sizes, "--jitter", str(jitter),
                  "--time-model", time_model]
        cmd = " ".join(shlex.quote(a) for a in parts)
        paths = write_report(res, out, cmd)
        o = res["overall"]
        typer.echo(
            f"relative error (mean): accumulated {o['accumulated']['mean']:.3f}, t_s/t_total "
            f"{o['stage_over_total']['mean']:.3f}, t_s/t>=s {o['stage_over_remaining']['mean']:.3f}; "
            f"P50 match latency at each size: "
            + ", ".join(f"{r['size']}:{r['exhaustive']['latency_p50_ms']:.3f}ms" for r in res["history_size_sweep"])
        )
        for p in paths:
            typer.echo(f"wrote {p}")
