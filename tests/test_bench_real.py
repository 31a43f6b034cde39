"""Real-engine harness pieces that run without starting vLLM: server process handling and fidelity maths."""

from __future__ import annotations

import os

import httpx
import pytest

from conftest import cli_text
from jitflow_server.bench.engine_cli import policy_params
from jitflow_server.bench.fidelity_cli import fidelity_diff
from jitflow_server.bench.metrics import summarize
from jitflow_server.bench.real import BenchServer, EngineBenchError, task_key
from jitflow_server.bench.server_process import ServerProcess, ServerStartError, free_port


def test_server_process_reports_a_failed_start_and_leaves_nothing_behind(tmp_path):
    log = tmp_path / "server.log"
    srv = BenchServer(model=str(tmp_path / "no-such-model"), policy="gmax", startup_timeout=120, log_path=log)
    with pytest.raises(EngineBenchError, match="exited"):
        srv.__enter__()
    assert srv.proc is not None and srv.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(srv.proc.pid, 0)  # the whole process group is gone
    assert "model" in log.read_text().lower()


def test_free_port_is_bindable():
    import socket

    p = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))


HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), H).serve_forever()
"""


def test_a_server_whose_port_was_taken_restarts_on_another(tmp_path):
    import socket
    import sys

    script = tmp_path / "health.py"
    script.write_text(HEALTH_SERVER)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        srv = ServerProcess([sys.executable, str(script), "--port", str(taken)], tmp_path / "s.log",
                            startup_timeout=60)
        with srv:
            assert srv.port != taken and srv.base_url.endswith(f":{srv.port}")
            assert httpx.get(srv.base_url + "/health", timeout=5).status_code == 200
        # without retries the taken port is an error with the server's own message
        stuck = ServerProcess([sys.executable, str(script), "--port", str(taken)], tmp_path / "t.log",
                              startup_timeout=60, port_retries=0)
        with pytest.raises(ServerStartError, match="(?i)address already in use"):
            stuck.__enter__()


def _rec(kind, met, good, out, ttft=0.1, e2el=1.0):
    return {"kind": kind, "slo_met": met, "goodput": good, "output_tokens": out, "ttft": ttft,
            "tbt_mean": 0.05 if kind == "latency" else None, "e2el": e2el, "rejected": False, "preemptions": 0}


def test_summarize_and_fidelity_diff():
    real = summarize([_rec("latency", True, 10, 10), _rec("deadline", False, 0, 20, e2el=30.0),
                      _rec("compound", True, 100, 40)], span_s=10.0, makespan_s=20.0)
    assert real["token_goodput"] == pytest.approx(11.0)
    assert real["request_goodput"] == pytest.approx(0.2)
    assert real["throughput"] == pytest.approx(70 / 20)
    assert real["per_kind"]["deadline"]["slo_attainment"] == 0.0
    sim = summarize([_rec("latency", True, 10, 10), _rec("deadline", True, 25, 20),
                     _rec("compound", True, 100, 40)], span_s=10.0, makespan_s=20.0)
    real["preemptions"], real["preemptions_by_reason"] = 3, {"policy": 2, "vllm": 1}
    sim["sim_preemptions"], sim["sim_preemptions_by_reason"] = 40, {"slots": 40}
    d = fidelity_diff({"gmax": real}, {"gmax": sim})["gmax"]
    assert (d["preemptions_real"], d["preemptions_sim"]) == (3, 40)
    assert d["preemptions_by_reason_sim"] == {"slots": 40}
    assert d["token_goodput_rel_diff"] == pytest.approx((13.5 - 11.0) / 11.0)
    assert d["per_kind"]["deadline"]["slo_attainment"] == (0.0, 1.0)
    assert d["per_kind"]["deadline"]["e2el_p50"] == (30.0, 1.0)


def test_baselines_get_frames_of_delta_steps():
    assert policy_params("las", 50) == {"delta_steps": 50}
    assert policy_params("gmax", 50) == {} and policy_params("fcfs", 50) == {}
    assert policy_params("gmax", 50, {"future_margin": 2}) == {"future_margin": 2}
    assert policy_params("las", 50, {"future_margin": 2}) == {"delta_steps": 50}
    assert policy_params("fcfs", 50, {"future_margin": 2}) == {}


def test_replays_use_their_own_task_ids():
    # the same job replayed under two policies must not share engine-side task state (LAS)
    assert task_key("run1", "j25") != task_key("run2", "j25")
    assert task_key("run1", "j25").endswith("j25")


def test_fidelity_real_from_replays_the_same_workload_analyzer_and_reports_a_band(tmp_path):
    """`bench fidelity --real-from` rebuilds the saved run's workload and gives the simulated analyzer the
    time model the real run's analyzer used; when the "real" side is itself this simulation, the
    difference is exactly zero, and the step-time band brackets the nominal result."""
    import json

    from typer.testing import CliRunner

    from jitflow_server.bench.presets import load_preset
    from jitflow_server.bench.runner import RunSettings, run_sim_one
    from jitflow_server.bench.workload import DataSources, make_workload
    from jitflow_server.cli import app
    from jitflow_server.engine.step_model import PresetError

    engine_model = load_preset("cpu-demo")
    analyzer_tm = engine_model.scaled(3.0).with_overrides(name="analyzer-tm")
    ds = DataSources.load(tmp_path)  # no traces here: built-in length distributions
    jobs = make_workload(60, 3.0, data=ds, seed=0, length_scale=0.0625, max_context=8000, tightness=2.0)
    # exact length bounds: the real side's ignore_eos requests give the server their exact lengths
    st = RunSettings(batch_size=32, waiting_time=5.0, admission="shared", baseline_delta=50,
                     length_scale=0.0625, seed=0, analyzer_model=analyzer_tm, length_bound="oracle")
    real = run_sim_one(jobs, engine_model, "gmax", st, ds, {}, refine_bounds=False)
    saved = {"config": {"model": "demo", "policies": ["gmax"], "duration": 20.0, "rps": 3.0, "requests": 60,
                        "batch_size": 32, "length_scale": 0.0625, "waiting_time": 5.0, "tightness": 2.0, "seed": 0,
                        "analyzer_preset": analyzer_tm.to_dict()},
             "policies": {"gmax": {"metrics": real}}}
    src = tmp_path / "engine" / "results.json"
    src.parent.mkdir()
    src.write_text(json.dumps(saved, default=float))
    # the engine's step log: every step took 0.8x what the preset predicts (a faster machine that day)
    import numpy as np

    from jitflow_server.bench.stepfit import STEP_FIELDS, predict

    rng = np.random.default_rng(0)
    rows = np.column_stack([np.arange(200.0), np.zeros(200), np.zeros(200), rng.integers(1, 33, 200),
                            rng.integers(0, 600, 200), rng.integers(100, 9000, 200), rng.uniform(0, 1, 200)])
    rows[:, 1] = rows[:, 2] = 0.8 * predict(engine_model, rows)
    (src.parent / "steps.json").write_text(json.dumps({"fields": list(STEP_FIELDS), "policies": {"gmax": rows.tolist()}}))
    out = tmp_path / "fid"
    r = CliRunner().invoke(app, ["bench", "fidelity", "--real-from", str(src), "--data", str(tmp_path),
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "fidelity.json").read_text())
    assert res["config"]["analyzer_preset"]["name"] == "analyzer-tm"
    assert res["diff"]["gmax"]["token_goodput_rel_diff"] == pytest.approx(0.0, abs=1e-12)
    b = res["band"]["gmax"]
    assert b["scales"] == [0.95, 1.05] and b["token_goodput_inside"] and b["request_goodput_inside"]
    assert b["token_goodput"][0] <= res["sim"]["gmax"]["token_goodput"] <= b["token_goodput"][1]
    assert "Sensitivity" in (out / "fidelity.md").read_text()
    assert res["step_model"]["gmax"]["time_ratio"] == pytest.approx(1.25)
    cal = res["calibrated"]["gmax"]
    direct = run_sim_one(jobs, engine_model.scaled(0.8), "gmax", st, ds, {}, refine_bounds=False)
    assert cal["scale"] == pytest.approx(0.8) and cal["token_goodput"] == pytest.approx(direct["token_goodput"])
    assert "Calibrated" in (out / "fidelity.md").read_text()
    # --analyzer-preset overrides the recorded model: the engine's own preset gives GMAX other estimates
    other = CliRunner().invoke(app, ["bench", "fidelity", "--real-from", str(src), "--data", str(tmp_path),
                                     "--analyzer-preset", "cpu-demo", "--band", "0", "--out", str(tmp_path / "o")])
    assert other.exit_code == 0, other.output
    res2 = json.loads((tmp_path / "o" / "fidelity.json").read_text())
    assert res2["config"]["analyzer_preset"]["name"] == "cpu-demo" and "band" not in res2
    assert res2["diff"]["gmax"]["token_goodput_rel_diff"] != pytest.approx(0.0, abs=1e-6)
    bad = CliRunner().invoke(app, ["bench", "fidelity", "--real-from", str(src), "--data", str(tmp_path),
                                   "--analyzer-preset", "no-such-preset", "--out", str(tmp_path / "x")])
    flat = cli_text(bad.output)
    assert bad.exit_code == 2 and "--analyzer-preset" in flat
    with pytest.raises(PresetError):
        engine_model.scaled(0.0)
    # a real run whose analyzer followed the engine's own speed cannot be replayed: refused, naming why
    saved["config"]["analyzer_speed"] = "engine"
    src.write_text(json.dumps(saved, default=float))
    r = CliRunner().invoke(app, ["bench", "fidelity", "--real-from", str(src), "--data", str(tmp_path),
                                 "--out", str(tmp_path / "fid2")])
    flat = cli_text(r.output)
    assert r.exit_code == 2 and "--real-from" in flat and "analyzer-speed engine" in flat


@pytest.mark.parametrize("args, option, message", [
    (["--policies", "gmax", "--analyzer-speed", "guess"], "--analyzer-speed", "preset, engine"),
    (["--policies", "fcfs", "--param", "future_margin=2"], "--param", "no GMAX policy"),
    (["--policies", "gmax", "--param", "future_margin=abc"], "--param", "future_margin must be a number"),
    (["--policies", "gmax", "--param", "preemption=maybe"], "--param", "preemption must be true or false"),
    (["--policies", "gmax", "--param", "no_such_knob=1"], "--param", "no_such_knob"),
])
def test_bench_engine_rejects_a_bad_param_before_starting_a_server(tmp_path, args, option, message):
    from typer.testing import CliRunner

    from jitflow_server.cli import app

    r = CliRunner().invoke(app, ["bench", "engine", "--out", str(tmp_path / "out"), "--data", str(tmp_path), *args])
    assert r.exit_code == 2, r.output
    text = cli_text(r.output)
    assert option in text and message in text
    assert not (tmp_path / "out" / "server.log").exists()


def test_bench_engine_results_say_which_time_model_the_analyzer_used():
    """``results.md`` names the analyzer's call-time model: the preset's, or the engine's measured speed
    with the figure each policy's run ended with."""
    from jitflow_server.bench.engine_cli import _analyzer_line

    tm = {"decode_s_per_token": 0.064, "prefill_s_per_token": 0.0011, "source": "measured"}
    res = {"config": {"analyzer_speed": "engine", "analyzer_preset": {"name": "cpu-demo-avx512"}},
           "policies": {"gmax": {"stats": {"analyzer": {"time_model": tm}}}, "fcfs": {"stats": {}}}}
    line = _analyzer_line(res)
    assert "engine's measured speed" in line and "gmax 64 ms per decoded token (measured)" in line
    assert "fcfs" not in line  # a run whose server reported no model is not invented
    res["config"]["analyzer_speed"] = "preset"
    assert "preset `cpu-demo-avx512`" in _analyzer_line(res)
