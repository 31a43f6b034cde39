"""Shared fixtures: ONE real jitflow server (real vLLM engine on the tiny demo model) per test session.

The server runs as a subprocess (`jitflow serve`) on 127.0.0.1 with a free port, in its own
process group, and is stopped at the end of the session. Tests that change the scheduling
policy use the ``policy`` fixture, which restores GMAX with the default batch afterwards.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from jitflow_server.bench.server_process import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
DEFAULT_BATCH = 32


def cli_text(output: str) -> str:
    """A CLI's output as one line of words: rich wraps a usage error in a box (``│`` borders) and folds it
    at the terminal's width, so a message is matched on this, not on the raw text."""
    return " ".join(output.replace("│", " ").split())


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` when present; skips the test otherwise."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@contextlib.contextmanager
def running_server(cmd: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 420):
    """Run a server command (with ``--port``) until ``/health`` answers 200; yield (url, Popen).

    The whole process group (vLLM's engine-core and worker included) is stopped on exit.
    """
    srv = ServerProcess(cmd, log, env, startup_timeout=timeout)
    with srv:
        yield srv.base_url, srv.proc


def jitflow_exe() -> str:
    """The ``jitflow`` console script of the running interpreter's environment."""
    return str(Path(sys.executable).with_name("jitflow"))


@pytest.fixture(scope="session")
def server_proc(tmp_path_factory):
    """Start `jitflow serve --model tiny --policy gmax` and yield (url, Popen, log path)."""
    tmp = tmp_path_factory.mktemp("server")
    log = tmp / "server.log"
    env = dict(os.environ)
    env["JITFLOW_HISTORY_DB"] = str(tmp / "history.sqlite")
    env["JITFLOW_OTEL_EXPORTER"] = f"file:{tmp / 'spans.jsonl'}"
    env["JITFLOW_TELEMETRY"] = str(tmp / "telemetry.jsonl")
    env["JITFLOW_LENGTH_TELEMETRY"] = str(tmp / "length.jsonl")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("JITFLOW_TIME_MODEL", None)  # the analyzer follows the engine's measured speed
    cmd = [jitflow_exe(), "serve", "--model", "tiny", "--port", str(free_port()), "--policy", "gmax",
           "--batch-size", str(DEFAULT_BATCH), "--max-model-len", "4096", "--kv-cache-gib", "1"]
    with running_server(cmd, log, env) as (url, proc):
        yield url, proc, log


@pytest.fixture(scope="session")
def server_files(server_proc) -> dict[str, Path]:
    """Files the session server writes: history DB, exported spans (JSON lines), call telemetry."""
    tmp = server_proc[2].parent
    return {"db": tmp / "history.sqlite", "spans": tmp / "spans.jsonl", "telemetry": tmp / "telemetry.jsonl",
            "length": tmp / "length.jsonl"}


@pytest.fixture(scope="session")
def server_url(server_proc) -> str:
    """Base URL of the session's real server (tiny model, GMAX)."""
    return server_proc[0]


def wait_idle(url: str, timeout: float = 60.0) -> dict:
    """Poll ``/v1/jitflow/engine`` until no request is unfinished anywhere; returns the last stats."""
    t0 = time.time()
    st: dict = {}
    while time.time() - t0 < timeout:
        st = httpx.get(url + "/v1/jitflow/engine", timeout=10).json()
        if st["unfinished"] == 0 and st["frontend_unfinished"] == 0 and st["server_in_flight"] == 0:
            return st
        time.sleep(0.2)
    return st


@pytest.fixture
def policy(server_url):
    """Switch the server's policy for one test: ``policy("fcfs", batch_size=2)``; restores GMAX/B=32."""

    def set_policy(name: str, batch_size: int | None = None, **params):
        r = httpx.post(server_url + "/v1/jitflow/policy",
                       json={"name": name, "params": params, "batch_size": batch_size}, timeout=30)
        r.raise_for_status()
        return r.json()

    yield set_policy
    wait_idle(server_url)
    set_policy("gmax", batch_size=DEFAULT_BATCH)


@pytest.fixture()
def env(tmp_path, monkeypatch):
    """A private history database and no preloaded patterns or length telemetry, for tests that run the
    API in-process (the FakeEngine servers of ``test_api_fake_engine.serve``). Returns ``tmp_path``."""
    monkeypatch.setenv("JITFLOW_HISTORY_DB", str(tmp_path / "history.db"))
    monkeypatch.delenv("JITFLOW_PATTERNS", raising=False)
    monkeypatch.delenv("JITFLOW_LENGTH_TELEMETRY", raising=False)
    return tmp_path
