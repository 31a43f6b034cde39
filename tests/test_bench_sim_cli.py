"""``jitflow bench sim`` end to end on a tiny workload (results.json, results.md, plots)."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from conftest import cli_text
from jitflow_server.cli import app


def test_bench_sim_writes_results_and_plots(tmp_path):
    out = tmp_path / "sim"
    r = CliRunner().invoke(app, [
        "bench", "sim", "--preset", "cpu-demo", "--policies", "gmax,fcfs,oracle", "--rps", "0.5,2",
        "--requests", "24", "--no-ablation", "--tightness-sweep", "1.0", "--mix-sweep", "1:0:0",
        "--sweep-requests", "12", "--data", str(tmp_path), "--out", str(out)])
    assert r.exit_code == 0, r.output
    # not a terminal: one progress line per simulation, numbered up to the total (rich would draw nothing)
    steps = re.findall(r"^\[(\d+)/(\d+)\] ", r.output, flags=re.M)
    assert steps and [int(k) for k, _ in steps] == list(range(1, len(steps) + 1))
    assert {int(n) for _, n in steps} == {len(steps)}
    res = json.loads((out / "results.json").read_text())
    assert set(res["main"]) == {"0.5", "2.0"}
    for k, runs in res["main"].items():
        # + the capacity runs and the best other policy given the truth (the oracle's other half)
        assert set(runs) == {"gmax", "fcfs", "oracle", "gmax-noadmit", "fcfs-noadmit", "best-other+truth"}
        wl = res["workloads"][k]
        for m in runs.values():
            assert m["jobs"] == 24
            assert 0.0 <= m["slo_attainment"] <= 1.0
            assert m["goodput_tokens"] <= wl["input_tokens"] + wl["output_tokens"]
            assert m["output_tokens"] <= wl["output_tokens"]
            assert set(m["per_kind"]) <= {"latency", "deadline", "compound"}
            assert "frame_ms_p50" in m
    h = res["headline"]["2.0"]
    assert h["admission"] == "shared" and h["best_other_token"] == "fcfs" and h["best_other_request"] == "fcfs"
    assert h["oracle_source"] in ("oracle", "best-other+truth")
    truth = max(runs[p]["token_goodput"] for p in ("oracle", "best-other+truth"))
    assert h["gmax_over_oracle"] == pytest.approx(runs["gmax"]["token_goodput"] / truth)
    assert runs["best-other+truth"]["variant"] == "fcfs+truth" and runs["best-other+truth"]["length_bound"] == "oracle"
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
    # GMAX parameters are checked before anything runs: a bad value, or no GMAX policy to apply them to
    r = runner.invoke(app, ["bench", "sim", "--policies", "fcfs,gmax", "--param", "future_margin=abc",
                            "--out", str(tmp_path / "x")])
    text = cli_text(r.output)
    assert r.exit_code == 2 and "--param" in text and "future_margin must be a number" in text
    r = runner.invoke(app, ["bench", "sim", "--policies", "fcfs,sjf", "--param", "future_margin=2",
                            "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "no GMAX policy" in cli_text(r.output)
    assert not (tmp_path / "x").exists()


def test_bench_sim_seeds_average_with_intervals_and_capacity_run(tmp_path):
    out = tmp_path / "sim"
    r = CliRunner().invoke(app, [
        "bench", "sim", "--preset", "a100-llama8b", "--policies", "gmax,fcfs,sjf", "--rps", "6", "--requests", "80",
        "--seeds", "3", "--no-ablation", "--tightness-sweep", "", "--mix-sweep", "", "--data", str(tmp_path),
        "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    runs = res["main"]["6.0"]
    assert set(runs) == {"gmax", "fcfs", "sjf", "gmax-noadmit", "fcfs-noadmit"}  # the capacity runs are added
    per_seed = res["per_seed"]
    assert set(per_seed) == {"0", "1", "2"}
    for p, m in runs.items():
        vals = [per_seed[s]["6.0"][p]["token_goodput"] for s in per_seed]
        assert m["seeds"] == 3 and m["token_goodput"] == pytest.approx(sum(vals) / 3)
        assert len(set(vals)) > 1  # different workloads per seed
        assert m["token_goodput_ci95"] > 0
    h = res["headline"]["6.0"]
    assert h["seeds"] == 3 and h["gmax_over_best_other_token_ci95"] is not None
    assert h["admission"] == "shared" and len(h["best_other_request_per_seed"]) == 3
    ratios = []  # each seed's ratio against that seed's best other policy, then averaged
    for s in per_seed:
        g = per_seed[s]["6.0"]
        ratios.append(g["gmax"]["request_goodput"] / max(g["fcfs"]["request_goodput"], g["sjf"]["request_goodput"]))
    assert h["gmax_request_over_best_other"] == pytest.approx(sum(ratios) / 3)
    caps = [per_seed[s]["6.0"]["gmax-noadmit"]["throughput"] / per_seed[s]["6.0"]["fcfs-noadmit"]["throughput"]
            for s in per_seed]
    assert h["gmax_capacity_over_fcfs"] == pytest.approx(sum(caps) / 3)
    assert runs["gmax-noadmit"]["rejected"] == 0 and runs["fcfs-noadmit"]["rejected"] == 0
    # the capacity runs serve every job; under the same overload FCFS's clients give up on late calls
    assert runs["gmax-noadmit"]["abandoned"] == runs["fcfs-noadmit"]["abandoned"] == 0 < runs["fcfs"]["abandoned"]
    assert res["config"]["give_up_after"] == 5.0
    assert runs["fcfs"]["waiting_time"] == runs["gmax"]["waiting_time"] == 5.0  # shared admission by default
    assert "±" in (out / "results.md").read_text()
    r2 = CliRunner().invoke(app, [
        "bench", "sim", "--preset", "cpu-demo", "--policies", "gmax,fcfs", "--rps", "2", "--requests", "20",
        "--no-capacity", "--no-ablation", "--tightness-sweep", "", "--mix-sweep", "", "--data", str(tmp_path),
        "--out", str(tmp_path / "nocap")])
    assert r2.exit_code == 0, r2.output
    res2 = json.loads((tmp_path / "nocap" / "results.json").read_text())
    assert set(res2["main"]["2.0"]) == {"gmax", "fcfs"} and "per_seed" not in res2


def test_mean_runs_and_ci95():
    from jitflow_server.bench.metrics import ci95, mean_runs

    a = {"token_goodput": 10.0, "request_goodput": 1.0, "throughput": 5.0, "name": "x", "p": None,
         "per_kind": {"latency": {"ttft_p50": 1.0, "n": 3}}}
    b = {"token_goodput": 20.0, "request_goodput": 3.0, "throughput": 5.0, "name": "y", "p": 4.0,
         "per_kind": {"latency": {"ttft_p50": 3.0, "n": 5}, "compound": {"n": 1}}}
    m = mean_runs([a, b])
    assert m["token_goodput"] == 15.0 and m["per_kind"] == {"latency": {"ttft_p50": 2.0, "n": 4.0}}
    assert m["name"] == "x" and m["p"] == 4.0 and m["seeds"] == 2
    assert m["throughput_ci95"] == 0.0
    assert m["token_goodput_ci95"] == pytest.approx(ci95([10.0, 20.0]))
    assert ci95([10.0, 20.0]) == pytest.approx(12.706 * 5.0, rel=1e-3)  # t(0.975, 1) · s / √n
    assert ci95([3.0]) is None
    with pytest.raises(ValueError):
        mean_runs([])


def test_bench_tune_reports_ratios_against_the_best_other_policy(tmp_path):
    out = tmp_path / "tune"
    r = CliRunner().invoke(app, [
        "bench", "tune", "--preset", "cpu-demo", "--grid", "request_weight=0,1", "--rps", "3", "--seeds", "100,101",
        "--requests", "30", "--others", "fcfs,sjf", "--data", str(tmp_path), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "[1/8] seed 100, 3.0 rps: fcfs (" in r.output  # progress off a terminal: a line per simulation
    assert "[8/8] {'request_weight': 1}: seed 101, 3.0 rps (" in r.output
    res = json.loads((out / "tune.json").read_text())
    assert [row["params"] for row in res["rows"]] == [{"request_weight": 0}, {"request_weight": 1}]
    assert res["config"]["seeds"] == [100, 101] and res["config"]["admission"] == "shared"
    for row in res["rows"]:
        cell = row["loads"]["3.0"]
        assert row["worst_token"] == cell["token_over_best_other"] > 0
        assert row["worst_request"] == cell["request_over_best_other"] >= 0
    assert res["chosen"] in [row["params"] for row in res["rows"]]
    assert "(chosen)" in (out / "tune.md").read_text()
    bad = CliRunner().invoke(app, ["bench", "tune", "--grid", "no_such_param=1", "--requests", "5", "--rps", "1",
                                   "--seeds", "100", "--others", "fcfs", "--data", str(tmp_path), "--out", str(out)])
    assert bad.exit_code == 2 and "no_such_param" in bad.output


def test_bench_sim_replays_a_trace(tmp_path):
    rows = [{"timestamp": 250 * i, "input_length": 200 + 10 * i, "output_length": 20 + i, "hash_ids": [1, 2 + i % 3]}
            for i in range(30)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "sim"
    args = ["bench", "sim", "--preset", "cpu-demo", "--policies", "gmax,fcfs", "--rps", "2", "--requests", "24",
            "--no-ablation", "--tightness-sweep", "", "--mix-sweep", "", "--no-capacity", "--data", str(tmp_path)]
    r = CliRunner().invoke(app, [*args, "--trace", str(trace), "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert "t.jsonl" in res["config"]["arrivals"] and "mooncake" in res["config"]["arrivals"].lower()
    wl = res["workloads"]["2.0"]
    assert wl["jobs"] == 24 and wl["latency"] + wl["deadline"] + wl["compound"] == 24
    assert abs(wl["offered_rps"] - 2.0) < 1e-6  # the first 24 rows, rescaled to 2 requests/s
    assert res["headline"]["2.0"]["best_other_token"] == "fcfs"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n{"timestamp": 1, "input_length": -3}\n')
    r = CliRunner().invoke(app, [*args, "--trace", str(bad), "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and ":2" in r.output


def test_auto_length_bound_uses_the_real_predictor_only_where_it_can(tmp_path):
    from jitflow_server.bench.sim_cli import resolve_length_bound

    assert resolve_length_bound("auto", tmp_path, 1.0, False)[0] == "noisy"  # no alpaca_eval
    (tmp_path / "alpaca_eval").mkdir()
    assert resolve_length_bound("auto", tmp_path, 1.0, False)[0] == "predictor"
    assert resolve_length_bound("auto", tmp_path, 0.0625, False)[0] == "noisy"  # scaled lengths
    mode, why = resolve_length_bound("auto", tmp_path, 1.0, True)
    assert mode == "noisy" and "trace" in why
    assert resolve_length_bound("oracle", None, 1.0, False)[0] == "oracle"
    r = CliRunner().invoke(app, ["bench", "sim", "--length-bound", "psychic", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "predictor" in r.output


def test_bench_sim_uses_the_predictor_from_the_data_directory(tmp_path):
    from jitflow_server.bench.workload import default_data_dir

    data = default_data_dir()
    if data is None or not (data / "alpaca_eval").is_dir():
        pytest.skip("needs ../shared/data/alpaca_eval")
    out = tmp_path / "sim"
    r = CliRunner().invoke(app, [
        "bench", "sim", "--preset", "a100-llama8b", "--policies", "gmax,fcfs", "--rps", "2", "--requests", "40",
        "--no-ablation", "--tightness-sweep", "", "--mix-sweep", "", "--no-capacity", "--data", str(data),
        "--out", str(out)])
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "results.json").read_text())["config"]
    assert cfg["length_bound"] == "predictor" and "AlpacaEval" in cfg["length_bound_reason"]


def test_capacity_comes_from_fcfs_serving_every_job_at_the_top_load():
    from jitflow_server.bench.sim_report import apply_capacity

    heads = {"1.0": {"rps": 1.0, "fcfs_completion_rps": 0.99}, "4.0": {"rps": 4.0, "fcfs_completion_rps": 2.0}}
    assert apply_capacity(heads) == 2.0
    assert heads["1.0"]["load_over_capacity"] == 0.5 and heads["4.0"]["load_over_capacity"] == 2.0
    assert apply_capacity({"1.0": {"rps": 1.0}}) is None
