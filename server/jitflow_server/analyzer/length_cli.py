"""CLI of the output-length predictor (``jitflow analyzer train-length|eval-length``).

``train-length`` fits a :class:`~jitflow_server.analyzer.length.LengthPredictor` on AlpacaEval JSON
and/or jitflow length-telemetry JSONL and saves it. ``eval-length`` reproduces the evaluation of
JITServe §4.1: coverage and tightness of the bound at 0/50/100/200/400 generated
tokens, prediction latency, two baselines (global empirical q-quantile; scikit-learn
``GradientBoostingRegressor(loss="quantile")``) on the same instruction-disjoint split, and a
cross-model stream without/with online calibration. Heavy imports happen inside the commands.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

EVAL_KS: tuple[int, ...] = (0, 50, 100, 200, 400)


def _summary(y: Any, b: Any, q: float) -> dict[str, float]:
    """Coverage, median/P90 of bound/true, and the median ratio after scaling to coverage exactly q."""
    import numpy as np

    y = np.asarray(y, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if len(y) == 0:
        return {"n": 0}
    r = b / np.maximum(y, 1.0)
    # smallest common factor s with coverage(s·b) >= q: the q-quantile of y/b
    s = float(np.quantile(np.maximum(y, 1.0) / b, q, method="higher"))
    return {
        "n": int(len(y)),
        "coverage": float(np.mean(y <= b)),
        "median_ratio": float(np.median(r)),
        "p90_ratio": float(np.percentile(r, 90)),
        "median_ratio_at_q": float(np.median(r * s)),
    }


def _latency(fn: Any, args_list: list[Any]) -> dict[str, float]:
    import numpy as np

    times = []
    fn(args_list[0])  # warm-up
    for a in args_list:
        t0 = time.perf_counter()
        fn(a)
        times.append((time.perf_counter() - t0) * 1000)
    return {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99)), "n": len(times)}


def run_eval(train_files: list[Path], test_files: list[Path], quantile: float, out: Path, *, folds: int = 2,
             warmup: int = 100, step: float = 0.05, n_estimators: int = 100, max_depth: int | None = 30,
             min_samples_leaf: int = 5, seed: int = 0, progress: Any = None) -> dict[str, Any]:
    """Run the length-bound evaluation and write ``out/length_eval.{json,md,png}``; returns the JSON dict.

    Split: instructions (prompts) are assigned to ``folds`` folds by a stable hash; each test
    response is predicted by models trained only on training responses of *other* folds
    (cross-fitting), so no prompt is seen in training. Test responses whose generator is among the
    training generators are "in-distribution", the others "held-out model". Raises ``ValueError``
    for unusable data.
    """
    import hashlib

    import numpy as np
    from sklearn.ensemble import GradientBoostingRegressor

    from jitflow_server.analyzer.length import LengthPredictor
    from jitflow_server.analyzer.length_calibration import OnlineCalibrator, finalize_bound
    from jitflow_server.analyzer.length_data import build_rows, load_examples
    from jitflow_server.analyzer.tokens import get_token_counter

    def tick(msg: str) -> None:
        if progress is not None:
            progress(msg)

    counter = get_token_counter()
    # load each distinct file once; examples shared between train and test
    files = list(dict.fromkeys([p.resolve() for p in train_files + test_files]))
    by_file: dict[Path, list[Any]] = {}
    for f in files:
        tick(f"loading {f.name}")
        by_file[f] = load_examples([f], counter)
    train_ex = [e for f in dict.fromkeys(p.resolve() for p in train_files) for e in by_file[f]]
    test_ex = [e for f in dict.fromkeys(p.resolve() for p in test_files) for e in by_file[f]]
    if not train_ex or not test_ex:
        raise ValueError("empty train or test set")
    all_ex = list({id(e): e for e in train_ex + test_ex}.values())
    pos = {id(e): i for i, e in enumerate(all_ex)}
    tick(f"featurising {len(all_ex)} responses")
    lp = LengthPredictor(quantile, n_estimators=n_estimators, max_depth=max_depth, min_samples_leaf=min_samples_leaf,
                         random_state=seed, counter=counter)
    P, G, y, C, idx = build_rows(all_ex, lp.refine_grid, counter)
    ks = G[:, 1].astype(np.int64)
    keys = [e.key for e in all_ex]
    row_key = [keys[i] for i in idx]

    overlap = bool({e.key for e in train_ex} & {e.key for e in test_ex})
    n_folds = folds if overlap else 1
    fold_of = {k: int(hashlib.sha1(f"{seed}:{k}".encode()).hexdigest()[:8], 16) % n_folds for k in set(keys)}
    train_set = {pos[id(e)] for e in train_ex}
    test_set = {pos[id(e)] for e in test_ex}
    train_gens = sorted({e.model for e in train_ex if e.model})
    test_rows = np.asarray([i for i in range(len(y)) if idx[i] in test_set and ks[i] in EVAL_KS])

    preds: dict[str, np.ndarray] = {m: np.full(len(y), np.nan) for m in ("qrf", "qrf_raw", "empirical", "gbr")}
    fit_s: dict[str, float] = {"qrf": 0.0, "gbr": 0.0}
    models: dict[str, Any] = {}
    for f in range(n_folds):
        tr = np.asarray([i for i in range(len(y)) if idx[i] in train_set and fold_of[row_key[i]] != f])
        te = np.asarray([i for i in test_rows if fold_of[row_key[i]] == f])
        if len(tr) == 0 or len(te) == 0:
            continue
        tick(f"fold {f + 1}/{n_folds}: QRF on {len(tr)} rows")
        t0 = time.perf_counter()
        m = LengthPredictor(quantile, n_estimators=n_estimators, max_depth=max_depth,
                            min_samples_leaf=min_samples_leaf, random_state=seed, counter=counter,
                            keep_forest=(f == n_folds - 1))
        m.fit_rows(P[tr], G[tr], y[tr], [C[i] for i in tr], [row_key[i] for i in tr])
        fit_s["qrf"] += time.perf_counter() - t0
        Xte = m._assemble(P[te], G[te], [C[i] for i in te])
        preds["qrf"][te] = m.predict_matrix(Xte)
        preds["qrf_raw"][te] = m.predict_matrix(Xte, conformal=False)
        # empirical baseline: q-quantile of the training lengths still running at k
        ytr0 = y[tr][ks[tr] == 0]
        for k in EVAL_KS:
            sel = te[ks[te] == k]
            pool = ytr0[ytr0 > k]
            preds["empirical"][sel] = float(np.quantile(pool if len(pool) else ytr0, quantile))
        tick(f"fold {f + 1}/{n_folds}: gradient boosting")
        t0 = time.perf_counter()
        Xtr = m._assemble(P[tr], G[tr], [C[i] for i in tr])
        gbr = GradientBoostingRegressor(loss="quantile", alpha=quantile, n_estimators=200, max_depth=3,
                                        learning_rate=0.05, subsample=0.8, random_state=seed)
        gbr.fit(Xtr, np.log1p(y[tr]))
        fit_s["gbr"] += time.perf_counter() - t0
        preds["gbr"][te] = np.expm1(gbr.predict(Xte))
        models = {"qrf": m, "gbr": gbr}

    final: dict[str, np.ndarray] = {}
    for name, p in preds.items():
        final[name] = np.asarray([finalize_bound(float(v), int(k), None) if np.isfinite(v) else np.nan
                                  for v, k in zip(p, ks, strict=True)])

    def group_of(i: int) -> str:
        return "in_distribution" if all_ex[idx[i]].model in train_gens else "held_out_model"

    groups = sorted({group_of(i) for i in test_rows})
    results: dict[str, Any] = {}
    for g in groups:
        rows_g = np.asarray([i for i in test_rows if group_of(i) == g])
        results[g] = {}
        for name in ("qrf", "qrf_raw", "empirical", "gbr"):
            results[g][name] = {}
            for k in EVAL_KS:
                sel = rows_g[ks[rows_g] == k]
                sel = sel[np.isfinite(final[name][sel])]
                results[g][name][str(k)] = _summary(y[sel], final[name][sel], quantile)

    # ---- calibration streams (one per test generator, fixed file order) ----
    stream: dict[str, Any] = {}
    test_gens = list(dict.fromkeys(e.model for e in test_ex))
    for gen in test_gens:
        ex_order = [pos[id(e)] for e in test_ex if e.model == gen]
        rows_by_ex: dict[int, list[int]] = {}
        for i in test_rows:
            if all_ex[idx[i]].model == gen:
                rows_by_ex.setdefault(int(idx[i]), []).append(int(i))
        out_g: dict[str, Any] = {"n": len(ex_order), "warmup": warmup, "in_training": gen in train_gens}
        for mode in ("without", "with"):
            cal = OnlineCalibrator(quantile, step=step)
            hits: dict[int, list[int]] = {k: [] for k in EVAL_KS}
            ratios: dict[int, list[float]] = {k: [] for k in EVAL_KS}
            running = []
            for t, e_i in enumerate(ex_order):
                issued = []
                for i in rows_by_ex.get(e_i, []):
                    k = int(ks[i])
                    fac = cal.factor(None, gen, k) if mode == "with" else 1.0
                    b = finalize_bound(float(preds["qrf"][i]) * fac, k, None)
                    issued.append((k, b, i))
                for k, b, i in issued:  # score before revealing the length
                    if t >= warmup:
                        hits[k].append(int(y[i] <= b))
                        ratios[k].append(b / max(y[i], 1.0))
                    if k == 0:
                        running.append(int(y[i] <= b))
                for k, b, i in issued:
                    cal.update(None, gen, k, b, int(y[i]))
            out_g[mode] = {str(k): {"n": len(hits[k]), "coverage": float(np.mean(hits[k])) if hits[k] else None,
                                    "median_ratio": float(np.median(ratios[k])) if ratios[k] else None}
                           for k in EVAL_KS}
            out_g[mode]["running_coverage_k0"] = [float(x) for x in np.cumsum(running) / np.arange(1, len(running) + 1)]
        stream[gen] = out_g

    # ---- latency ----
    tick("latency")
    m = models["qrf"]
    gbr = models["gbr"]
    test_list = [all_ex[i] for i in sorted(test_set)]
    rng = np.random.default_rng(seed)
    pick = [test_list[j] for j in rng.integers(0, len(test_list), 200)]
    ctx1 = [{"app": e.app, "model": e.model, "stage": e.stage} for e in pick]
    lat: dict[str, Any] = {}
    lat["qrf_single"] = _latency(lambda j: m.predict([pick[j].prompt], context=[ctx1[j]]), list(range(200)))
    batches = [list(range(s, s + 64)) for s in range(0, 136, 8)]
    lat["qrf_batch64"] = _latency(lambda b: m.predict([pick[j].prompt for j in b], context=[ctx1[j] for j in b]),
                                  batches)

    def gbr_pred(b: list[int]) -> Any:
        X, _ = m.features([pick[j].prompt for j in b], context=[ctx1[j] for j in b])
        return gbr.predict(X)

    lat["gbr_single"] = _latency(lambda j: gbr_pred([j]), list(range(200)))
    lat["gbr_batch64"] = _latency(gbr_pred, batches)
    Xone, _ = m.features([pick[0].prompt])
    lat["qrf_model_only_single"] = _latency(lambda j: m.predict_matrix(Xone), list(range(200)))
    lat["quantile_forest_predict_single"] = _latency(lambda j: m.forest.predict(Xone, quantiles=quantile),
                                                     list(range(50)))

    result = {
        "quantile": quantile,
        "tokenizer": counter.name,
        "train_files": [str(p) for p in train_files],
        "test_files": [str(p) for p in test_files],
        "train_generators": train_gens,
        "test_generators": test_gens,
        "folds": n_folds,
        "instruction_disjoint": True,
        "n_train_responses": len(train_ex),
        "n_test_responses": len(test_ex),
        "qrf_params": {**m.params, "cv_folds": m.cv_folds, "refine_grid": list(m.refine_grid)},
        "fit_seconds": fit_s,
        "results": results,
        "calibration_stream": stream,
        "calibration_step": step,
        "latency_ms": lat,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "length_eval.json").write_text(json.dumps(result, indent=1))
    _plot(result, out / "length_eval.png")
    (out / "length_eval.md").write_text(render_markdown(result))
    return result


_NAMES = {"qrf": "QRF (jitflow)", "qrf_raw": "QRF without fit-time conformal factor",
          "empirical": "global empirical q-quantile", "gbr": "GradientBoostingRegressor(quantile)"}


def render_markdown(res: dict[str, Any]) -> str:
    """Markdown report of an :func:`run_eval` result dict."""
    q = res["quantile"]
    lines = [f"# Length upper bound evaluation (q = {q})", "",
             f"Tokenizer: `{res['tokenizer']}`. Train generators: {', '.join(res['train_generators'])}; "
             f"test generators: {', '.join(res['test_generators'])}. {res['folds']}-fold instruction-disjoint "
             f"cross-fitting ({res['n_train_responses']} train / {res['n_test_responses']} test responses).", ""]
    for g, by_m in res["results"].items():
        lines += [f"## {g.replace('_', ' ')}", "",
                  "| method | k | n | coverage | median bound/true | P90 bound/true | median ratio at coverage q |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for name, by_k in by_m.items():
            for k, s in by_k.items():
                if s.get("n"):
                    lines.append(f"| {_NAMES[name]} | {k} | {s['n']} | {s['coverage']:.3f} | {s['median_ratio']:.2f} | "
                                 f"{s['p90_ratio']:.2f} | {s['median_ratio_at_q']:.2f} |")
        lines.append("")
    lines += ["## Online calibration stream", "",
              f"Each generator's test responses in file order; every bound is scored before its length is revealed; "
              f"coverage over the stream after a {next(iter(res['calibration_stream'].values()))['warmup']}-response "
              f"warm-up (ACI step {res['calibration_step']}).", "",
              "| generator | in training | k | coverage without | coverage with | median ratio without | median ratio with |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for gen, s in res["calibration_stream"].items():
        for k in map(str, EVAL_KS):
            a, b = s["without"][k], s["with"][k]
            if a["n"]:
                lines.append(f"| {gen} | {s['in_training']} | {k} | {a['coverage']:.3f} | {b['coverage']:.3f} | "
                             f"{a['median_ratio']:.2f} | {b['median_ratio']:.2f} |")
    lines += ["", "## Latency (ms, this machine)", "", "| what | P50 | P99 |", "|---|---:|---:|"]
    for k, v in res["latency_ms"].items():
        lines.append(f"| {k} | {v['p50_ms']:.2f} | {v['p99_ms']:.2f} |")
    lines += ["", f"Fit time (all folds, s): {json.dumps({k: round(v, 1) for k, v in res['fit_seconds'].items()})}. "
              f"QRF parameters: `{json.dumps(res['qrf_params'])}`.", ""]
    return "\n".join(lines)


def _plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    q = res["quantile"]
    styles = {"in_distribution": "-", "held_out_model": "--"}
    for g, by_m in res["results"].items():
        for name in ("qrf", "empirical", "gbr"):
            ks = [int(k) for k, s in by_m[name].items() if s.get("n")]
            cov = [by_m[name][str(k)]["coverage"] for k in ks]
            med = [by_m[name][str(k)]["median_ratio"] for k in ks]
            axes[0].plot(ks, cov, styles.get(g, "-"), marker="o", label=f"{name} ({g})")
            axes[1].plot(ks, med, styles.get(g, "-"), marker="o", label=f"{name} ({g})")
    axes[0].axhline(q, color="k", lw=0.8)
    axes[0].axhline(q - 0.03, color="k", lw=0.5, ls=":")
    axes[0].set(xlabel="generated tokens k", ylabel="coverage", title="coverage of the bound")
    axes[1].set(xlabel="generated tokens k", ylabel="median bound / true", title="tightness")
    axes[0].legend(fontsize=6)
    for gen, s in res["calibration_stream"].items():
        for mode, ls in (("without", "--"), ("with", "-")):
            rc = s[mode]["running_coverage_k0"]
            axes[2].plot(range(1, len(rc) + 1), rc, ls, label=f"{gen[:18]} {mode}")
    axes[2].axhline(q, color="k", lw=0.8)
    axes[2].set(xlabel="responses in stream", ylabel="running coverage (k=0)", title="online calibration",
                ylim=(0.5, 1.0))
    axes[2].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    ) -> None:
        """Train the QRF length upper-bound model (JITServe §4.1) and save it with a version stamp."""
        from rich.console import Console

        from jitflow_server.analyzer.length import LengthPredictor, default_model_path
        from jitflow_server.analyzer.length_data import load_examples

        console = Console(stderr=True)
        if not 0.0 < quantile < 1.0:
            raise typer.BadParameter("must be in (0, 1)", param_hint="--quantile")
        for p in data:
            if not p.is_file():
                raise typer.BadParameter(f"file not found: {p}", param_hint="--data")
        try:
            with console.status("loading and tokenizing data"):
                examples = load_examples(data)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--data") from exc
        if not examples:
            raise typer.BadParameter("no usable examples in the data files", param_hint="--data")
        t0 = time.perf_counter()
        with console.status(f"training on {len(examples)} responses"):
            pred = LengthPredictor(quantile, n_estimators=n_estimators, max_depth=max_depth,
                                   min_samples_leaf=min_samples_leaf).fit(None, None, examples=examples)
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
        step: float = typer.Option(0.05, help="Online calibration step (log units)."),
        seed: int = typer.Option(0, help="Random seed."),
    ) -> None:
        """Evaluate the length bound vs baselines; write DIR/length_eval.json, .md and .png."""
        from rich.console import Console

        console = Console(stderr=True)
        if not 0.0 < quantile < 1.0:
            raise typer.BadParameter("must be in (0, 1)", param_hint="--quantile")
        if folds < 2:
            raise typer.BadParameter("must be >= 2", param_hint="--folds")
        for p in list(train) + list(test):
            if not p.is_file():
                raise typer.BadParameter(f"file not found: {p}")
        t0 = time.perf_counter()
        with console.status("evaluating") as status:
            try:
                res = run_eval(list(train), list(test), quantile, out, folds=folds, warmup=warmup, step=step,
                               seed=seed, progress=lambda m: status.update(m))
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from exc
        console.print(f"done in {time.perf_counter() - t0:.0f} s")
        typer.echo(render_markdown(res))
