"""Real-engine harness pieces that run without starting vLLM: server process handling and fidelity maths."""

from __future__ import annotations

import os

import pytest

from jitflow_server.bench.engine_cli import fidelity_diff, policy_params
from jitflow_server.bench.metrics import summarize
from jitflow_server.bench.real import EngineBenchError, ServerProcess, free_port, task_key


def test_server_process_reports_a_failed_start_and_leaves_nothing_behind(tmp_path):
    log = tmp_path / "server.log"
    srv = ServerProcess(model=str(tmp_path / "no-such-model"), policy="gmax", startup_timeout=120, log_path=log)
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


def test_replays_use_their_own_task_ids():
    # the same job replayed under two policies must not share engine-side task state (LAS)
    assert task_key("run1", "j25") != task_key("run2", "j25")
    assert task_key("run1", "j25").endswith("j25")
