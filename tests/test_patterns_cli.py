"""``jitflow patterns import/export/stats/cluster`` and ``jitflow analyzer eval-patterns``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from jitflow_server.cli import app
from jitflow_server.store.graph import PatternGraph
from jitflow_server.store.jsonl import read_jsonl

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
DEEPRESEARCH = DATA / "deepresearch" / "deepresearch_training.json"
runner = CliRunner()


def synthetic_jsonl(path: Path, n: int, seed: int = 0, app_name: str = "synth") -> list[PatternGraph]:
    rng = np.random.default_rng(seed)
    gs = []
    for i in range(n):
        s = int(rng.choice([3, 5]))
        names = ["q"] + ["r" if j % 2 == 0 else "f" for j in range(s - 2)] + ["a"]
        stages = [[(int(rng.integers(10, 4000)), int(rng.integers(1, 1024))) for _ in range(int(rng.integers(1, 3)))]
                  for _ in range(s)]
        gs.append(PatternGraph.from_stage_lengths(app_name, stages, stage_names=names, task_id=str(i), outcome="ok"))
    path.write_text("".join(g.to_json() + "\n" for g in gs))
    return gs


def test_import_export_stats_round_trip(tmp_path):
    src = tmp_path / "in.jsonl"
    gs = synthetic_jsonl(src, 12)
    db = tmp_path / "h.sqlite"
    r = runner.invoke(app, ["patterns", "import", str(src), "--app", "demo", "--db", str(db)])
    assert r.exit_code == 0, r.output
    assert "imported 12" in r.output
    r = runner.invoke(app, ["patterns", "export", "--app", "demo", "--db", str(db)])
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    back = [PatternGraph.from_json(ln) for ln in lines]
    assert [b.to_dict()["stages"] for b in back] == [g.to_dict()["stages"] for g in gs]
    assert {b.app for b in back} == {"demo"}  # --app renames
    out = tmp_path / "out" / "e.jsonl"
    r = runner.invoke(app, ["patterns", "export", "--app", "demo", "--db", str(db), "--out", str(out)])
    assert r.exit_code == 0 and len(list(read_jsonl(out))) == 12
    r = runner.invoke(app, ["patterns", "stats", "--db", str(db), "--json"])
    assert r.exit_code == 0, r.output
    st = json.loads(r.stdout)
    assert st["apps"]["demo"]["graphs"] == 12 and st["apps"]["demo"]["clusters"] >= 1
    r = runner.invoke(app, ["patterns", "stats", "--db", str(db)])
    assert r.exit_code == 0 and "demo" in r.output
    r = runner.invoke(app, ["patterns", "cluster", "--db", str(db), "--k", "3"])
    assert r.exit_code == 0 and "3 clusters" in r.output


def test_env_var_selects_the_default_db(tmp_path, monkeypatch):
    src = tmp_path / "in.jsonl"
    synthetic_jsonl(src, 3)
    monkeypatch.setenv("JITFLOW_HISTORY_DB", str(tmp_path / "env.sqlite"))
    r = runner.invoke(app, ["patterns", "import", str(src), "--app", "demo", "--no-cluster"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "env.sqlite").exists()


def test_bad_input_exits_with_code_2(tmp_path):
    db = tmp_path / "h.sqlite"
    r = runner.invoke(app, ["patterns", "import", str(tmp_path / "missing.jsonl"), "--app", "x", "--db", str(db)])
    assert r.exit_code == 2 and "no such file" in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"v": 1, "app": "x"}\n')
    r = runner.invoke(app, ["patterns", "import", str(bad), "--app", "x", "--db", str(db)])
    assert r.exit_code == 2 and "bad.jsonl:1" in r.output
    r = runner.invoke(app, ["patterns", "import", str(bad), "--app", "x", "--format", "csv", "--db", str(db)])
    assert r.exit_code == 2
    r = runner.invoke(app, ["patterns", "export", "--app", "nothing", "--db", str(db)])
    assert r.exit_code == 2 and "no graphs" in r.output
    r = runner.invoke(app, ["analyzer", "eval-patterns", "--history", str(bad), "--out", str(tmp_path / "o"),
                            "--time-model", "h100"])
    assert r.exit_code == 2


def test_eval_patterns_writes_json_and_plots(tmp_path):
    hist = tmp_path / "hist.jsonl"
    test = tmp_path / "test.jsonl"
    synthetic_jsonl(hist, 40, seed=1)
    synthetic_jsonl(test, 10, seed=2)
    out = tmp_path / "ev"
    r = runner.invoke(app, ["analyzer", "eval-patterns", "--history", str(hist), "--test", str(test),
                            "--out", str(out), "--sizes", "20,60"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "pattern_eval.json").read_text())
    assert [row["size"] for row in res["history_size_sweep"]] == [20, 60]
    for f in ("fig7a_history_size.png", "fig7b_online_matching.png", "appB_formulations.png", "pattern_eval.md"):
        assert (out / f).stat().st_size > 0
    by_k = {row["stages_observed"]: row for row in res["by_stages_observed"]}
    assert by_k[0]["queries"] == 10
    # at the last stage both φ and t_s/t_>=s are 1 for every task, so their error is exactly 0
    last = max(by_k)
    assert by_k[last]["accumulated"]["mean"] == 0.0
    assert res["bytes_per_graph"]["binary_mean"] < res["bytes_per_graph"]["jsonl_mean"]
    assert res["command"].startswith("jitflow analyzer eval-patterns")


@pytest.mark.data
def test_import_the_deepresearch_trace(tmp_path):
    if not DEEPRESEARCH.is_file():
        pytest.skip("../shared/data not available")
    db = tmp_path / "h.sqlite"
    r = runner.invoke(app, ["patterns", "import", str(DEEPRESEARCH), "--app", "deep-research",
                            "--format", "deepresearch", "--db", str(db)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["patterns", "stats", "--db", str(db), "--json"])
    st = json.loads(r.stdout)["apps"]["deep-research"]
    assert st["graphs"] == 394 and st["stages_hist"] == {"4": 156, "6": 238}
    assert st["blob_bytes_max"] < 200
