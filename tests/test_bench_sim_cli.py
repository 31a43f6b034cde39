"""``jitflow bench sim`` end to end on a tiny workload (results.json, results.md, plots)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from jitflow_server.cli import app


def test_bench_sim_writes_results_and_plots(tmp_path):
    out = tmp_path / "sim"
    r = CliRunner().invoke(app, [
        "bench", "sim", "--preset", "cpu-demo", "--policies", "gmax,fcfs,oracle", "--rps", "0.5,2",
        "--requests", "24", "--no-ablation", "--tightness-sweep", "1.0", "--mix-sweep", "1:0:0",
        "--sweep-requests", "12", "--data", str(tmp_path), "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert set(res["main"]) == {"0.5", "2.0"}
    for k, runs in res["main"].items():
        assert set(runs) == {"gmax", "fcfs", "oracle"}
        wl = res["workloads"][k]
        for m in runs.values():
            assert m["jobs"] == 24
            assert 0.0 <= m["slo_attainment"] <= 1.0
            assert m["goodput_tokens"] <= wl["input_tokens"] + wl["output_tokens"]
            assert m["output_tokens"] <= wl["output_tokens"]
            assert set(m["per_kind"]) <= {"latency", "deadline", "compound"}
            assert "frame_ms_p50" in m
    assert "gmax_over_oracle" in res["headline"]["2.0"]
    assert set(res["tightness"]["runs"]) == {"1.0"} and set(res["mix"]["runs"]) == {"1:0:0"}
    md = (out / "results.md").read_text()
    assert "Headline" in md and "| 2.0 | gmax |" in md
    for png in ("goodput_vs_rps.png", "oracle.png", "throughput.png", "latency_per_kind.png", "tightness.png",
                "mix.png"):
        assert (out / png).stat().st_size > 1000


def test_bench_sim_rejects_bad_input(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["bench", "sim", "--policies", "gmax,magic", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "magic" in r.output
    r = runner.invoke(app, ["bench", "sim", "--preset", "h100-unknown", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2
    r = runner.invoke(app, ["bench", "sim", "--rps", "1,-2", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2
