"""No orphans after ``kill -9``: the watcher kills a dead server's descendants (a plain process tree, and a
real ``jitflow serve`` with its vLLM engine-core and worker processes) and removes vLLM's IPC socket files,
after a kill and after a graceful stop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from jitflow_server.bench.server_process import ServerProcess, free_port, jitflow_command


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    t0 = time.monotonic()
    alive = procs
    while alive and time.monotonic() - t0 < timeout:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    return alive


def _sockets_left(folder, timeout: float) -> list[str]:
    """Socket files under ``folder`` (vLLM's IPC endpoints), waiting up to ``timeout`` s for them to go."""
    import stat
    from pathlib import Path

    t0 = time.monotonic()
    while True:
        left = [str(p) for p in Path(folder).rglob("*") if p.exists() and stat.S_ISSOCK(p.lstat().st_mode)]
        if not left or time.monotonic() - t0 > timeout:
            return left
        time.sleep(0.2)


@pytest.fixture
def short_tmp():
    """A temporary folder with a short path (a Unix socket path holds at most 107 characters)."""
    import shutil
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="jt-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_children_of_a_killed_parent_are_reaped(tmp_path):
    script = textwrap.dedent("""
        import subprocess, sys, time
        from jitflow_server.engine.reaper import start_orphan_reaper
        kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]
        start_orphan_reaper(poll_s=0.1)
        print(" ".join(str(k.pid) for k in kids), flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    tree: list[psutil.Process] = []
    try:
        tree = psutil.Process(parent.pid).children(recursive=True)
        kids = [psutil.Process(int(x)) for x in parent.stdout.readline().split()]
        tree = psutil.Process(parent.pid).children(recursive=True)
        time.sleep(0.6)  # the watcher has seen the tree
        watcher = [c for c in psutil.Process(parent.pid).children() if c.pid not in {k.pid for k in kids}]
        assert len(kids) == 2 and len(watcher) == 1
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert not _wait_gone(kids, 5.0), "children outlived their killed parent"
        assert not _wait_gone(watcher, 5.0), "the watcher did not exit"
    finally:  # only this test's processes (the session's server is a child of pytest too)
        for p in [psutil.Process(parent.pid), *tree] if parent.poll() is None else tree:
            with contextlib.suppress(psutil.Error):
                p.kill()


@pytest.mark.engine
def test_a_server_stops_when_the_process_that_started_it_is_killed(tmp_path, short_tmp):
    """The demo, benchmarks and tests start servers in a process group of their own, which a signal to
    the starting process does not reach: killed with SIGKILL, the starter leaves its server (and the
    engine) to stop by itself (``JITFLOW_PARENT_PID``, ``exit_with_parent``)."""
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from jitflow_server.bench.server_process import ServerProcess, free_port, jitflow_command
        srv = ServerProcess(jitflow_command("serve", "--model", "tiny", "--port", str(free_port()), "--history-db",
                                            {str(tmp_path / "h.sqlite")!r}, "--no-length-predictor"),
                            Path({str(tmp_path / "server.log")!r}), env={{"TMPDIR": {str(short_tmp)!r}}})
        srv.start()
        srv.wait_healthy()
        print(srv.proc.pid, flush=True)
        time.sleep(600)
    """)
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server: list[psutil.Process] = []
    try:
        line = starter.stdout.readline()
        assert line.strip().isdigit(), f"the server did not start: {(tmp_path / 'server.log').read_text()[-2000:]}"
        leader = psutil.Process(int(line))
        server = [leader, *leader.children(recursive=True)]
        assert any("VLLM" in p.name() or "python" in p.name() for p in server[1:]), "no engine process seen"
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(10)
        left = _wait_gone(server, 60.0)
        assert not left, f"still running 60 s after its starter was killed: {[(p.pid, p.name()) for p in left]}"
    finally:
        for p in server:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if starter.poll() is None:
            starter.kill()


@pytest.mark.engine
def test_engine_processes_die_with_a_killed_server(tmp_path, short_tmp):
    tmp = short_tmp  # the server's temporary folder: vLLM's IPC sockets land under it
    srv = ServerProcess(jitflow_command("serve", "--model", "tiny", "--port", str(free_port()), "--history-db",
                                       str(tmp_path / "h.sqlite"), "--no-length-predictor"),
                        tmp_path / "server.log", env={"TMPDIR": str(tmp)})
    with srv:
        assert _sockets_left(tmp, 0.0), "vLLM's IPC sockets are expected under the server's TMPDIR"
        tree = psutil.Process(srv.proc.pid).children(recursive=True)
        names = " ".join(p.name() for p in tree)
        assert len(tree) >= 3, names  # engine core, worker(s), the watcher
        os.kill(srv.proc.pid, signal.SIGKILL)  # the server only, not its process group
        srv.proc.wait(10)
        left = _wait_gone(tree, 10.0)
        assert not left, f"orphans 10 s after kill -9: {[(p.pid, p.name()) for p in left]}"
        assert not _sockets_left(tmp, 15.0), "IPC socket files outlived the killed server"
    with pytest.raises(ProcessLookupError):  # stop() returned: no process of the server's group is left
        os.killpg(srv.proc.pid, 0)


@pytest.mark.engine
def test_sigterm_drains_in_flight_requests_then_stops_the_engine(tmp_path, short_tmp):
    """SIGTERM to the server alone (what systemd and Kubernetes send): no new connections, the streaming
    request in flight runs to its end, then the server and its engine processes exit."""
    import httpx

    tmp = short_tmp
    srv = ServerProcess(jitflow_command("serve", "--model", "tiny", "--port", str(free_port()), "--history-db",
                                       str(tmp_path / "h.sqlite"), "--no-length-predictor", "--drain-timeout", "60"),
                        tmp_path / "server.log", env={"TMPDIR": str(tmp)})
    with srv:
        tree = psutil.Process(srv.proc.pid).children(recursive=True)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 400,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        chunks = 0
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 3:
                        break
            os.kill(srv.proc.pid, signal.SIGTERM)
            time.sleep(1.0)
            with pytest.raises(httpx.ConnectError):  # draining: the listening socket is closed
                httpx.get(srv.base_url + "/health", timeout=5)
            rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]", rest[-3:]
        # every token arrived (a chunk may carry several when the client reads slower than they come)
        usage = json.loads(rest[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 400, usage
        assert srv.proc.wait(60) is not None
        left = _wait_gone(tree, 15.0)
        assert not left, f"engine processes left after the drain: {[(p.pid, p.name()) for p in left]}"
        assert not _sockets_left(tmp, 15.0), "IPC socket files outlived the stopped server"


def test_private_rpc_dir_keeps_an_operator_choice_and_fits_a_socket_path(monkeypatch, tmp_path):
    import tempfile

    from jitflow_server.engine.reaper import IPC_NAME_LEN, IPC_PATH_MAX, private_rpc_dir

    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/srv/rpc")
    assert private_rpc_dir() is None and os.environ["VLLM_RPC_BASE_PATH"] == "/srv/rpc"
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))  # a temporary folder too deep for a socket path
    assert private_rpc_dir() is None and "VLLM_RPC_BASE_PATH" not in os.environ
    assert list(deep.iterdir()) == []  # nothing left behind
    monkeypatch.setattr(tempfile, "tempdir", "/tmp")
    d = private_rpc_dir()
    try:
        assert d is not None and os.environ["VLLM_RPC_BASE_PATH"] == d and os.path.isdir(d)
        assert len(d) + IPC_NAME_LEN <= IPC_PATH_MAX
    finally:
        os.rmdir(d)
