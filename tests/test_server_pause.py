"""Pausing a server's whole process group (``ServerProcess.pause``/``resume``) and the demo's ``alone``:
a real ``jitflow serve`` stops answering while paused, answers again once resumed, and a paused server
still stops cleanly; ``alone`` pauses every other server for its block and continues them even when the
block raises."""

from __future__ import annotations

import os
import sys
import time

import httpx
import psutil
import pytest

from jitflow_server.bench.server_process import ServerProcess, free_port, jitflow_command
from jitflow_server.demo.servers import alone


def _group_states(srv: ServerProcess) -> set[str]:
    """The states of the server's process group (its orphan watcher runs in a session of its own, on
    purpose, and is not paused: engine/reaper.py)."""
    leader = psutil.Process(srv.proc.pid)
    group = [p for p in [leader, *leader.children(recursive=True)] if os.getpgid(p.pid) == srv.proc.pid]
    return {p.status() for p in group}


def _sleeper(tmp_path, name: str) -> ServerProcess:
    """A plain process tree (a parent and one child) in its own group, standing for an idle server."""
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    srv = ServerProcess([sys.executable, "-c", code, "--port", "0"], tmp_path / f"{name}.log")
    srv.start()
    t0 = time.monotonic()
    while not psutil.Process(srv.proc.pid).children() and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    return srv


@pytest.mark.engine
def test_a_paused_server_stops_answering_resumes_and_stops(tmp_path):
    srv = ServerProcess(jitflow_command("serve", "--model", "tiny", "--port", str(free_port()), "--history-db",
                                       str(tmp_path / "h.sqlite"), "--no-length-predictor"), tmp_path / "server.log")
    with srv:
        srv.pause()
        assert _group_states(srv) == {psutil.STATUS_STOPPED}
        with pytest.raises(httpx.TimeoutException):
            httpx.get(srv.base_url + "/health", timeout=1.0)
        srv.resume()
        assert psutil.STATUS_STOPPED not in _group_states(srv)
        assert httpx.get(srv.base_url + "/health", timeout=10.0).status_code == 200
        srv.pause()  # stop() continues the group before its SIGTERM
    with pytest.raises(ProcessLookupError):
        os.killpg(srv.proc.pid, 0)


def test_alone_pauses_the_others_and_resumes_them_after_an_error(tmp_path):
    servers = {name: _sleeper(tmp_path, name) for name in ("a", "b", "c")}
    try:
        assert all(len(psutil.Process(s.proc.pid).children()) == 1 for s in servers.values())
        with pytest.raises(RuntimeError, match="phase failed"), alone(servers, "a"):
            assert psutil.STATUS_STOPPED not in _group_states(servers["a"])
            for name in ("b", "c"):
                assert _group_states(servers[name]) == {psutil.STATUS_STOPPED}
            raise RuntimeError("phase failed")
        for srv in servers.values():
            assert psutil.STATUS_STOPPED not in _group_states(srv)
    finally:
        for srv in servers.values():
            srv.stop(timeout=5)
    for srv in servers.values():
        assert not srv.alive()
