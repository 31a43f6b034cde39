"""``jitflow bench frame`` writes its reports and rejects bad arguments (tiny sizes; not a timing test)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from jitflow_server.cli import app


def test_bench_frame_writes_json_and_markdown(tmp_path):
    out = tmp_path / "frame"
    res = CliRunner().invoke(app, ["bench", "frame", "--requests", "50,120", "--repeats", "3",
                                   "--policies", "gmax,fcfs", "--batch-size", "8", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "frame.json").read_text())
    assert set(data["results"]) == {"50", "120"}
    for per in data["results"].values():
        assert set(per) == {"gmax", "fcfs"}
        for r in per.values():
            assert 0 < r["p50_ms"] <= r["p99_ms"]
    md = (out / "frame.md").read_text()
    assert "| 120 | gmax |" in md and "Token-time line: 0.01 + 0.00015·k" in md
    assert data["config"]["token_time_model"] == [0.01, 0.00015]
    assert (out / "frame.png").stat().st_size > 0
    plain = CliRunner().invoke(app, ["bench", "frame", "--requests", "50", "--repeats", "2", "--policies", "gmax",
                                     "--no-token-time-model", "--out", str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output
    assert json.loads((tmp_path / "plain" / "frame.json").read_text())["config"]["token_time_model"] is None


def test_bench_frame_rejects_bad_arguments(tmp_path):
    runner = CliRunner()
    bad_sizes = runner.invoke(app, ["bench", "frame", "--requests", "ten", "--out", str(tmp_path)])
    assert bad_sizes.exit_code == 2
    bad_policy = runner.invoke(app, ["bench", "frame", "--requests", "10", "--policies", "nope",
                                     "--out", str(tmp_path)])
    assert bad_policy.exit_code == 2
    assert not (tmp_path / "frame.json").exists()


def test_bench_frame_sets_gmax_parameters_and_refuses_bad_ones(tmp_path):
    runner = CliRunner()
    out = tmp_path / "sized"
    res = runner.invoke(app, ["bench", "frame", "--requests", "40", "--repeats", "2", "--policies", "gmax,fcfs",
                              "--batch-size", "8", "--param", "batch_sizing=goodput", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "frame.json").read_text())["config"]["gmax_params"] == {"batch_sizing": "goodput"}
    assert "GMAX parameters: `batch_sizing=goodput`." in (out / "frame.md").read_text()
    bad_value = runner.invoke(app, ["bench", "frame", "--requests", "10", "--policies", "gmax",
                                    "--param", "batch_sizing=half", "--out", str(tmp_path / "a")])
    assert bad_value.exit_code == 2 and "batch_sizing" in bad_value.output
    no_gmax = runner.invoke(app, ["bench", "frame", "--requests", "10", "--policies", "fcfs",
                                  "--param", "batch_sizing=goodput", "--out", str(tmp_path / "b")])
    assert no_gmax.exit_code == 2
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
