"""The demo's early second server (``demo/servers.py``): it starts only once its length model exists, and a
failed start reaches the caller as a clear error instead of dying in its thread."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from jitflow_server.demo.length_model import LengthModelJob
from jitflow_server.demo.plan import DemoError
from jitflow_server.demo.servers import EarlyServer


def test_early_server_waits_for_training_and_reports_a_failed_training(tmp_path):
    # a real subprocess stands for the training job: it runs until told to exit, and writes no model
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    job = LengthModelJob(tmp_path / "never.pkl", [], "shipped telemetry", trained=True, proc=proc)
    calls = []
    early = EarlyServer(lambda: calls.append(1), job, "gmax", timeout=5.0)
    try:
        assert not early.ready.wait(0.5) and not calls  # training still running: nothing started
        proc.stdin.close()
        proc.wait(10)
        assert early.ready.wait(10)
        with pytest.raises(DemoError, match="length model was not trained"):
            early.join()
        assert not calls
    finally:
        early.close()
        proc.kill()


def test_early_server_close_stops_the_waiting_thread(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    job = LengthModelJob(tmp_path / "m.pkl", [], "shipped telemetry", trained=True, proc=proc)
    early = EarlyServer(lambda: None, job, "gmax", timeout=5.0)
    try:
        early.close()  # returns although training never ends
        assert not any(t.name == "demo-gmax-server" for t in threading.enumerate())
    finally:
        proc.kill()
        proc.wait(10)
