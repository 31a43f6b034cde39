"""Step-time model vs an engine step log: check, fit, and the ``jitflow bench fit-steps`` command."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import cli_text
from jitflow_server.bench.presets import CPU_DEMO
from jitflow_server.bench.stepfit import check_step_model, fit_step_model, load_steps, predict
from jitflow_server.cli import app
from jitflow_server.engine.step_model import PresetError

TRUE = CPU_DEMO.with_overrides(base_s=0.011, per_decode_s=0.0006, per_prefill_token_s=0.0005,
                               per_ctx_token_s=2e-6, hetero=0.05)


def _log(model, n: int, seed: int, noise: float = 0.02) -> list[list]:
    """Synthetic step log of ``model``: mixed decode/prefill batches, multiplicative noise, some idle gaps."""
    rng = np.random.default_rng(seed)
    rows = []
    t = 1000.0
    for i in range(n):
        nd = int(rng.integers(0, 33))
        pre = int(rng.choice([0, 0, 0, rng.integers(16, 2048)]))
        if nd + pre == 0:
            nd = 1
        ctx = int(nd * rng.integers(20, 1500))
        cv = float(rng.uniform(0, 1.2))
        a = np.array([[0, 0, 0, nd, pre, ctx, cv]], float)
        period = float(predict(model, a)[0] * (1 + noise * rng.standard_normal()))
        t += period
        rows.append([t, None if i % 50 == 0 else period, period * 0.95, nd, pre, ctx, cv])
    return rows


def test_check_reports_unity_for_the_true_model_and_the_bias_of_a_slow_one():
    a = np.array(_log(TRUE, 400, 0, noise=0.0), float)
    exact = check_step_model(TRUE, a)
    assert exact["steps"] == 400 - 8  # the rows after an idle gap have no period
    assert exact["time_ratio"] == pytest.approx(1.0, abs=1e-9)
    slow = check_step_model(TRUE.with_overrides(base_s=TRUE.base_s * 2), a)
    b = a[np.isfinite(a[:, 1])]
    extra = (TRUE.base_s * (1 + TRUE.hetero * b[:, 6])).sum()  # one more base_s per step
    assert slow["time_ratio"] == pytest.approx(1 + extra / b[:, 1].sum(), rel=1e-9)
    assert all(v[1] > 1.0 for v in slow["by_batch"].values())
    assert check_step_model(TRUE, np.empty((0, 7))) == {}


def test_fit_recovers_the_coefficients_from_noisy_steps():
    a = np.array(_log(TRUE, 3000, 1), float)
    fitted, diag = fit_step_model([a], CPU_DEMO)
    assert diag["r2"] > 0.95
    assert fitted.base_s == pytest.approx(TRUE.base_s, rel=0.1)
    assert fitted.per_decode_s == pytest.approx(TRUE.per_decode_s, rel=0.1)
    assert fitted.per_prefill_token_s == pytest.approx(TRUE.per_prefill_token_s, rel=0.1)
    assert fitted.per_ctx_token_s == pytest.approx(TRUE.per_ctx_token_s, rel=0.15)
    assert fitted.kv_capacity_tokens == CPU_DEMO.kv_capacity_tokens  # kept from the base preset
    held_out = np.array(_log(TRUE, 500, 2), float)
    assert check_step_model(fitted, held_out)["time_ratio"] == pytest.approx(1.0, abs=0.03)
    with pytest.raises(PresetError, match="50 busy"):
        fit_step_model([a[:20]], CPU_DEMO)


def test_fit_steps_command_writes_a_loadable_preset(tmp_path):
    fit_dir, check_dir = tmp_path / "runA", tmp_path / "runB"
    for d, seed in ((fit_dir, 3), (check_dir, 4)):
        d.mkdir()
        (d / "steps.json").write_text(json.dumps({"fields": [], "policies": {"fcfs": _log(TRUE, 600, seed),
                                                                             "gmax": _log(TRUE, 600, seed + 10)}}))
    out = tmp_path / "fit"
    r = CliRunner().invoke(app, ["bench", "fit-steps", "--steps", str(fit_dir / "steps.json"), "--check",
                                 str(check_dir / "steps.json"), "--policies", "fcfs", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "stepfit.json").read_text())
    logs = {c[0] for c in res["checks"]}
    assert logs == {"runA/fcfs (fit)", "runB/fcfs (held-out)"}  # --policies filters gmax out
    r2 = CliRunner().invoke(app, ["bench", "sim", "--preset", str(out / "cpu-demo.json"), "--policies", "fcfs",
                                  "--rps", "1", "--requests", "10", "--no-ablation", "--tightness-sweep", "",
                                  "--mix-sweep", "", "--data", str(tmp_path), "--out", str(tmp_path / "sim")])
    assert r2.exit_code == 0, r2.output
    assert (out / "stepfit.png").stat().st_size > 1000 and "held-out" in (out / "stepfit.md").read_text()
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    r3 = CliRunner().invoke(app, ["bench", "fit-steps", "--steps", str(bad), "--out", str(tmp_path / "x")])
    flat = cli_text(r3.output)
    assert r3.exit_code == 2 and "not a step log" in flat


def test_load_steps_reads_null_periods_as_nan(tmp_path):
    p = tmp_path / "steps.json"
    p.write_text(json.dumps({"fields": [], "policies": {"las": _log(TRUE, 60, 5)}}))
    a = load_steps(p)["las"]
    assert a.shape == (60, 7) and np.isnan(a[0, 1]) and np.isfinite(a[1, 1])
