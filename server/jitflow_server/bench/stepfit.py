"""Step-time model against the real engine's own step log.

The vLLM plug-in logs every engine step (``GET /v1/jitflow/engine/steps``; ``jitflow bench engine``
and ``bench fidelity`` save it as ``steps.json``). Each entry is :data:`STEP_FIELDS`:
``period_s`` is the wall time from the previous step to this one (model execution, vLLM's
scheduling and output processing, the policy's frame), ``None`` when the engine was idle in between.

Two uses:

- :func:`check_step_model`: how much engine time a :class:`~jitflow_server.bench.presets.StepModel`
  predicts for the batches the real engine actually ran (Σ predicted / Σ measured period). This
  separates the simulator's performance-model error from its scheduling dynamics in the fidelity
  report.
- :func:`fit_step_model`: least-squares fit of the model's coefficients to logged steps (the
  profiling-then-regression approach of LLM simulators such as Vidur; JITServe's step model has the
  same terms). ``jitflow bench fit-steps`` writes it as a preset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from jitflow_server.engine.step_model import PresetError, StepModel
from jitflow_server.tracker.steps import STEP_FIELDS


def load_steps(path: Path) -> dict[str, np.ndarray]:
    """Read a ``steps.json`` into ``{policy: array (n_steps, 7)}`` with the columns of
    :data:`STEP_FIELDS` (``period_s`` NaN after idle). Raises ``ValueError`` for a file that is not a
    step log."""
    try:
        d = json.loads(Path(path).read_text())
        pols = d["policies"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a step log (steps.json of `jitflow bench engine`): {e}") from None
    out = {}
    for p, rows in pols.items():
        a = np.array([[np.nan if v is None else float(v) for v in r] for r in rows], float).reshape(-1, len(STEP_FIELDS))
        out[p] = a
    return out


def _busy(a: np.ndarray) -> np.ndarray:
    """Rows with a measured period (the engine ran back to back) and a non-empty batch."""
    return a[np.isfinite(a[:, 1]) & ((a[:, 3] + a[:, 4]) > 0)]


def predict(model: StepModel, a: np.ndarray) -> np.ndarray:
    """Predicted step time (s) of every row of a step-log array: ``raw_time(n_decode, prefill,
    Σctx) · (1 + hetero·cv)`` (the simulator's formula, :meth:`StepModel.step_time`)."""
    return model.raw_time(a[:, 3], a[:, 4], a[:, 5]) * (1.0 + model.hetero * a[:, 6])


def check_step_model(model: StepModel, a: np.ndarray) -> dict:
    """Compare ``model`` with the measured periods of the busy steps of ``a``.

    Returns ``steps`` (count), ``measured_s`` / ``predicted_s`` (sums, s), ``time_ratio``
    (predicted / measured: > 1 means the simulator is slower than the engine on these batches),
    ``median_step_ratio`` and ``by_batch``: the same ratio for decode batch sizes 1-8, 9-16, 17-24,
    25-32, 33+ (``{label: [steps, ratio]}``). Empty dict when there is no busy step.
    """
    b = _busy(a)
    if b.size == 0:
        return {}
    pred = predict(model, b)
    meas = b[:, 1]
    res = {"steps": int(len(b)), "measured_s": float(meas.sum()), "predicted_s": float(pred.sum()),
           "time_ratio": float(pred.sum() / max(meas.sum(), 1e-12)),
           "median_step_ratio": float(np.median(pred / np.maximum(meas, 1e-9))),
           "mean_measured_ms": float(meas.mean() * 1e3), "by_batch": {}}
    for lo, hi in ((0, 8), (9, 16), (17, 24), (25, 32), (33, 10**9)):
        m = (b[:, 3] >= lo) & (b[:, 3] <= hi)
        if m.sum():
            label = f"{lo}-{hi}" if hi < 10**9 else f"{lo}+"
            res["by_batch"][label] = [int(m.sum()), float(pred[m].sum() / max(meas[m].sum(), 1e-12))]
    return res


def fit_step_model(arrays: list[np.ndarray], base: StepModel, name: str = "cpu-demo",
                   source: str = "") -> tuple[StepModel, dict]:
    """Fit ``base_s``, ``per_decode_s``, ``per_prefill_token_s``, ``per_ctx_token_s`` (non-negative
    least squares on the measured periods, s) and ``hetero`` (least squares of the relative residual
    on the batch's context cv) to the busy steps of ``arrays``; other fields come from ``base``.

    Returns ``(model, diagnostics)`` with ``steps``, ``r2`` and the :func:`check_step_model` of the
    fitted model on the same steps. Raises :class:`~jitflow_server.bench.presets.PresetError` with
    fewer than 50 busy steps.
    """
    from scipy.optimize import nnls

    b = np.concatenate([_busy(a) for a in arrays]) if arrays else np.empty((0, len(STEP_FIELDS)))
    if len(b) < 50:
        raise PresetError(f"need at least 50 busy engine steps to fit a step model, got {len(b)}")
    X = np.column_stack([np.ones(len(b)), b[:, 3], b[:, 4], b[:, 5]])
    y = b[:, 1]
    coef, _ = nnls(X, y)
    raw = X @ coef
    cvs = b[:, 6]
    rel = y / np.maximum(raw, 1e-9) - 1.0
    hetero = float(max(0.0, (cvs @ rel) / max(cvs @ cvs, 1e-12)))
    base_s = float(max(coef[0], 1e-4))
    model = base.with_overrides(name=name, base_s=base_s, per_decode_s=float(coef[1]),
                                per_prefill_token_s=float(max(coef[2], 1e-7)), per_ctx_token_s=float(coef[3]),
                                hetero=round(hetero, 4), source=source or base.source)
    pred = predict(model, b)
    r2 = 1.0 - float(((y - pred) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-18))
    return model, {"steps": int(len(b)), "r2": r2, "check": check_step_model(model, b)}


def _report(fitted: StepModel, base: StepModel, diag: dict, checks: dict, out: Path, command: str,
            fit_arrays: list[np.ndarray]) -> None:
    """``stepfit.md`` and ``stepfit.png`` (measured vs predicted step time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = fitted
    L = ["# Step-time model fitted to the real engine's step log", "", f"Command: `{command}`", "",
         f"Fit on {diag['steps']} busy steps: step = {f.base_s * 1e3:.2f} ms + {f.per_decode_s * 1e3:.3f} ms × n_decode "
         f"+ {f.per_ctx_token_s * 1e6:.3f} µs × Σ context (decodes) + {f.per_prefill_token_s * 1e3:.4f} ms × prefill "
         f"tokens, × (1 + {f.hetero} × cv); R² {diag['r2']:.3f}.", "",
         "| log | model | steps | Σ predicted / Σ measured | median step ratio | by decode batch size |",
         "|---|---|---:|---:|---:|---|"]
    for (log, which), c in checks.items():
        if not c:
            continue
        bb = ", ".join(f"{k}: {v[1]:.2f} ({v[0]})" for k, v in c["by_batch"].items())
        L.append(f"| {log} | {which} | {c['steps']} | {c['time_ratio']:.3f} | {c['median_step_ratio']:.3f} | {bb} |")
    L.append("")
    (out / "stepfit.md").write_text("\n".join(L))
    b = np.concatenate([_busy(a) for a in fit_arrays])
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    ax.scatter(b[:, 1] * 1e3, predict(base, b) * 1e3, s=3, alpha=0.3, label=f"{base.name} (before)")
    ax.scatter(b[:, 1] * 1e3, predict(fitted, b) * 1e3, s=3, alpha=0.3, label="fitted")
    hi = float(np.percentile(b[:, 1], 99.5) * 1e3)
    ax.plot([0, hi], [0, hi], "k--", lw=1)
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi * 1.2)
    ax.set_xlabel("measured step period (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.legend(fontsize=8, markerscale=4)
    fig.tight_layout()
    fig.savefig(out / "stepfit.png", dpi=110)
    plt.close(fig)


def register(bench_app: typer.Typer) -> None:
    """Attach ``fit-steps`` to ``jitflow bench``."""
    import sys

    @bench_app.command("fit-steps")
    def fit_steps(
        steps: list[Path] = typer.Option(..., "--steps", help="steps.json of a `bench engine`/`bench fidelity` run "
                                         "to fit on (repeatable)."),
        out: Path = typer.Option(..., "--out", help="Output directory (cpu-demo.json, stepfit.md, stepfit.png)."),
        base: str = typer.Option("cpu-demo", "--base", help="Preset whose other fields (KV, B, blocks) are kept."),
        check: list[Path] = typer.Option([], "--check", help="Held-out steps.json to test the fit on (repeatable)."),
        policies: Optional[str] = typer.Option(None, "--policies", help="Only these policies' steps (comma-separated)."),
    ) -> None:
        """Fit the step-time model to the real engine's logged steps; write a preset."""
        import time

        from rich.console import Console

        from jitflow_server.bench.presets import load_preset

        try:
            bm = load_preset(base)
        except PresetError as e:
            raise typer.BadParameter(str(e), param_hint="--base") from None
        want = {p.strip() for p in policies.split(",")} if policies else None

        def read(paths: list[Path], hint: str) -> dict[str, np.ndarray]:
            logs = {}
            for pth in paths:
                try:
                    for p, a in load_steps(pth).items():
                        if want is None or p in want:
                            logs[f"{pth.parent.name}/{p}"] = a
                except ValueError as e:
                    raise typer.BadParameter(str(e), param_hint=hint) from None
            return logs

        fit_logs = read(steps, "--steps")
        held = read(check, "--check")
        try:
            fitted, diag = fit_step_model(list(fit_logs.values()), bm, name=bm.name,
                                          source=f"jitflow bench fit-steps {time.strftime('%Y-%m-%d')} on "
                                          + ", ".join(str(s) for s in steps))
        except PresetError as e:
            raise typer.BadParameter(str(e), param_hint="--steps") from None
        checks = {}
        for kind, logs in (("fit", fit_logs), ("held-out", held)):
            for name, a in logs.items():
                checks[(f"{name} ({kind})", bm.name)] = check_step_model(bm, a)
                checks[(f"{name} ({kind})", "fitted")] = check_step_model(fitted, a)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cpu-demo.json").write_text(json.dumps(fitted.to_dict(), indent=1))
        command = "jitflow " + " ".join(sys.argv[1:]) if sys.argv and "jitflow" in sys.argv[0] else "jitflow bench fit-steps"
        (out / "stepfit.json").write_text(json.dumps({"command": command, "preset": fitted.to_dict(), "fit": diag,
                                                      "checks": [[k[0], k[1], v] for k, v in checks.items()]},
                                                     indent=1))
        _report(fitted, bm, diag, checks, out, command, list(fit_logs.values()))
        con = Console()
        con.print(f"fit on {diag['steps']} steps: base {fitted.base_s * 1e3:.2f} ms + {fitted.per_decode_s * 1e3:.3f} "
                  f"ms/request + {fitted.per_ctx_token_s * 1e6:.3f} µs/context token + "
                  f"{fitted.per_prefill_token_s * 1e3:.4f} ms/prefill token, hetero {fitted.hetero}; R² {diag['r2']:.3f}")
        for (log, which), c in checks.items():
            if c:
                con.print(f"  {log:<40} {which:<10} Σpred/Σmeas {c['time_ratio']:.3f}")
        con.print(f"wrote {out / 'cpu-demo.json'} (use with --preset {out / 'cpu-demo.json'}), stepfit.md, stepfit.png")
