"""Pausing a server's whole process group (``ServerProcess.pause``/``resume``) and the demo's ``alone``:
a real ``jitflow serve`` stops answering while paused and answers again once resumed; one whose starter is
killed while it is paused still exits (the kernel sends SIGHUP and SIGCONT to a process group with a
stopped member once it is orphaned, POSIX; the server's ``exit_with_parent`` then stops it); a paused
server still stops on SIGTERM; ``alone`` pauses every other server for its block and continues them even
when the block raises."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from jitflow_server.bench.server_process import ServerProcess
from jitflow_server.demo.servers import alone


def _group_states(pid: int) -> set[str]:
    """The states of the process group led by ``pid`` (a server's orphan watcher runs in a session of its
    own, on purpose, and is not paused: engine/reaper.py)."""
    leader = psutil.Process(pid)
    group = [p for p in [leader, *leader.children(recursive=True)] if os.getpgid(p.pid) == pid]
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


_STARTER = """
import sys
from pathlib import Path
from jitflow_server.bench.server_process import ServerProcess, free_port, jitflow_command
tmp = Path(sys.argv[1])
srv = ServerProcess(jitflow_command("serve", "--model", "tiny", "--port", str(free_port()), "--history-db",
                                   str(tmp / "h.sqlite"), "--no-length-predictor"), tmp / "server.log")
srv.start()
srv.wait_healthy()
print(srv.proc.pid, srv.base_url, flush=True)
for line in sys.stdin:  # "pause" / "resume", answered with "ok"
    getattr(srv, line.strip())()
    print("ok", flush=True)
"""


def _wait_gone(pgid: int, timeout: float) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.engine
def test_a_paused_server_stops_answering_resumes_and_exits_when_its_starter_dies_paused(tmp_path):
    """A real ``jitflow serve`` started by another process: paused, its whole process group is stopped and
    /health does not answer; resumed, it answers; paused again and its starter killed with SIGKILL, its
    orphaned group is continued and the server stops itself (nothing is left stopped forever)."""
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, str(tmp_path)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    pid = 0
    try:
        line = starter.stdout.readline().split()
        assert len(line) == 2, f"the server did not start: {(tmp_path / 'server.log').read_text()[-2000:]}"
        pid, url = int(line[0]), line[1]

        def command(word: str) -> None:
            starter.stdin.write(word + "\n")
            starter.stdin.flush()
            assert starter.stdout.readline().strip() == "ok"

        command("pause")
        assert _group_states(pid) == {psutil.STATUS_STOPPED}
        with pytest.raises(httpx.TimeoutException):
            httpx.get(url + "/health", timeout=1.0)
        command("resume")
        assert psutil.STATUS_STOPPED not in _group_states(pid)
        assert httpx.get(url + "/health", timeout=10.0).status_code == 200
        command("pause")
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(10)
        assert _wait_gone(pid, 90.0), f"the paused server outlived its killed starter: {_group_states(pid)}"
    finally:
        if starter.poll() is None:
            starter.kill()
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)
                os.killpg(pid, signal.SIGKILL)


def test_alone_pauses_the_others_and_resumes_them_after_an_error(tmp_path):
    servers = {name: _sleeper(tmp_path, name) for name in ("a", "b", "c")}
    try:
        assert all(len(psutil.Process(s.proc.pid).children()) == 1 for s in servers.values())
        with pytest.raises(RuntimeError, match="phase failed"), alone(servers, "a"):
            assert psutil.STATUS_STOPPED not in _group_states(servers["a"].proc.pid)
            for name in ("b", "c"):
                assert _group_states(servers[name].proc.pid) == {psutil.STATUS_STOPPED}
            raise RuntimeError("phase failed")
        for srv in servers.values():
            assert psutil.STATUS_STOPPED not in _group_states(srv.proc.pid)
        servers["b"].pause()  # stop() continues a paused group before its SIGTERM
        servers["b"].stop(timeout=5)
        assert not servers["b"].alive()
        assert servers["b"].proc.returncode == -signal.SIGTERM  # ended by the SIGTERM, not the SIGKILL
    finally:
        for srv in servers.values():
            srv.stop(timeout=5)
    for srv in servers.values():
        assert not srv.alive()
