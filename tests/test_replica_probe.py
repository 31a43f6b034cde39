"""What the router front end reads from a replica: vLLM's metrics, the speed estimate, the backlog built
from live state. (The probe against real replicas: tests/test_router.py.)"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jitflow_server.engine.replica_probe import (
    GEN_TOKENS,
    PREFILL_TIME,
    RUNNING,
    SpeedEstimate,
    read_vllm_metrics,
)
from jitflow_server.scheduler.routing import Backlog, GoodputRouter, ReplicaSpeed, RouteRequest


def test_vllm_metrics_are_summed_over_label_sets():
    reg = CollectorRegistry()
    gen = Counter("vllm:generation_tokens", "generated", ["engine"], registry=reg)
    gen.labels("0").inc(100)
    gen.labels("1").inc(50)
    Gauge("vllm:num_requests_running", "running", ["engine"], registry=reg).labels("0").set(3)
    Histogram("vllm:request_prefill_time_seconds", "prefill", registry=reg).observe(0.25)
    Counter("http_requests", "other", registry=reg).inc()
    m = read_vllm_metrics(generate_latest(reg).decode())
    assert m[GEN_TOKENS] == 150.0
    assert m[RUNNING] == 3.0
    assert m[PREFILL_TIME] == pytest.approx(0.25)
    assert "http_requests_total" not in m


def test_the_speed_estimate_keeps_the_peak_and_forgets_it_with_its_half_life():
    s = SpeedEstimate(half_life_s=10.0)
    s.observe_output(100.0, 1.0)
    s.observe_output(400.0, 1.0)  # a fuller batch
    assert s.output_tok_s == 400.0
    s.observe_output(50.0, 10.0)  # ten seconds at a partial batch: the peak has halved, not vanished
    assert s.output_tok_s == pytest.approx(200.0)
    s.observe_output(float("nan"), 1.0)
    s.observe_output(-1.0, 1.0)
    assert s.output_tok_s == pytest.approx(200.0)
    s.observe_prefill(1000.0, 1.0)
    s.observe_prefill(0.0, 0.0)  # nothing prefilled: no reading
    assert s.prefill_tok_s == 1000.0


def test_a_measured_backlog_steers_the_goodput_router_away_from_the_busy_replica():
    speeds = [ReplicaSpeed(1000.0, 10_000.0), ReplicaSpeed(100.0, 1000.0)]
    idle = Backlog.measured(0.0, speeds, [0.0, 0.0], [0.0, 0.0], [[], []])
    req = RouteRequest(now=0.0, input_tokens=100, output_tokens=200, slo_s=5.0)
    assert GoodputRouter().route(req, idle) == 0  # faster
    # 20 s of work in flight on the fast one: the request would miss there, and meets its SLO on the slow one
    busy = Backlog.measured(0.0, speeds, [20.0, 0.0], [0.0, 0.0], [[(20.0, 30.0, 500.0)], []])
    assert GoodputRouter().route(req, busy) == 1
    with pytest.raises(ValueError):
        Backlog.measured(0.0, speeds, [0.0], [0.0, 0.0], [[], []])


def test_serve_refuses_a_bad_replica_list(tmp_path):
    from typer.testing import CliRunner

    from jitflow_server.cli import app

    r = CliRunner().invoke(app, ["serve", "--model", "tiny", "--replica", "ftp://10.0.0.1:8000"])
    assert r.exit_code == 2 and "is not an http(s) URL" in r.output
    empty = tmp_path / "replicas.txt"
    empty.write_text("# none yet\n\n")
    r = CliRunner().invoke(app, ["serve", "--model", "tiny", "--replicas-file", str(empty)])
    assert r.exit_code == 2 and "lists no replica URL" in r.output
    r = CliRunner().invoke(app, ["serve", "--model", "tiny", "--replica", "http://127.0.0.1:9", "--router", "random"])
    assert r.exit_code == 2 and "goodput" in r.output


def test_serve_binds_its_port_before_the_engine_starts_and_names_a_taken_port():
    import socket

    from typer.testing import CliRunner

    from jitflow_server.cli import app

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        # both server kinds refuse a taken port naming the flag, before any engine or prober starts
        for extra in (["--replica", "http://127.0.0.1:9"], []):
            r = CliRunner().invoke(app, ["serve", "--model", "tiny", "--port", port, *extra])
            assert r.exit_code == 2, r.output
            assert "cannot listen on 127.0.0.1:" + port in r.output and "--port" in r.output
