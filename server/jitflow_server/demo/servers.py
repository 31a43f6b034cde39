"""The demo's server processes: starting one per side, waiting for it, and for the length model.

When the sides run in turn, their servers start one at a time, each engine in one process on every core
(``--cpu-engine single``: healthy in 20-29 s on 2 cores, against 35-44 s in vLLM's own two-process
layout, which imports vLLM once more): starting the second with the first, both on every core, was
measured (in the two-process layout): both were healthy after 55-57 s, against about 29 s each one
after the other. When the sides run at once, each engine bound to
its own core, both start together (healthy in about 29-35 s). Once started, both stay up (demo/main.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from jitflow_server.bench.server_process import ServerProcess, ServerStartError, free_port, jitflow_command
from jitflow_server.demo.length_model import LengthModelJob
from jitflow_server.demo.options import cpu_engine
from jitflow_server.demo.plan import DemoError


def start_server(label: str, serve_args: Sequence[str], *, model: str, batch_size: int, startup_timeout: float,
                 tmp: Path, length: LengthModelJob | None, patterns: Sequence[Path],
                 omp_cores: str | None = None) -> ServerProcess:
    """Spawn ``jitflow serve`` for one side (returns at once): its own history database and telemetry
    file under ``tmp``, the pattern corpora, the length model when ``length`` is given, the engine's
    compute threads bound to ``omp_cores`` (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"1"``) when given, else
    on every core in one engine process (:func:`~jitflow_server.demo.options.cpu_engine`)."""
    args = ["--model", model, "--port", str(free_port()), "--batch-size", str(batch_size), *serve_args,
            "--cpu-engine", cpu_engine(omp_cores),
            "--history-db", str(tmp / f"history-{label}.sqlite")]
    for p in patterns:
        args += ["--patterns", str(p)]
    env = {"JITFLOW_TELEMETRY": str(tmp / f"telemetry-{label}.jsonl")}
    if length is not None:
        env["JITFLOW_LENGTH_MODEL"] = str(length.path)
    if omp_cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_cores
    srv = ServerProcess(jitflow_command("serve", *args), tmp / f"server-{label}.log", env=env,
                        startup_timeout=startup_timeout)
    srv.start()
    return srv


@contextlib.contextmanager
def alone(servers: dict[str, ServerProcess], label: str) -> Iterator[None]:
    """Pause every server but ``label``'s (SIGSTOP, :meth:`ServerProcess.pause`) for the block, and continue
    them after it, also on an error. When the sides run in turn, a side's phases then run with no other
    server's idle loops beside them, as the capacity was measured."""
    others = [srv for name, srv in servers.items() if name != label]
    for srv in others:
        srv.pause()
    try:
        yield
    finally:
        for srv in others:
            srv.resume()


def wait_healthy(srv: ServerProcess, what: str, timeout: float, console: Any) -> float:
    """Wait for ``srv``'s ``/health`` (s waited). Raises :class:`DemoError` with the log tail when it
    exits or does not answer within ``timeout`` s."""
    with console.status(f"starting the {what} server (vLLM engine, {srv.base_url}) ..."):
        try:
            return srv.wait_healthy(timeout)
        except ServerStartError as exc:
            raise DemoError(str(exc)) from None


def wait_length_model(length: LengthModelJob, console: Any) -> None:
    """Block until the length model is trained (at once when it was cached or is done). Raises
    :class:`DemoError` when training failed."""
    busy = not length.done()
    with console.status(f"training the length model ({length.source_kind}) ...") if busy else contextlib.nullcontext():
        length.wait()


def engine_state(url: str) -> dict[str, Any]:
    """The server's ``GET /v1/jitflow/engine`` document, ``{}`` when it cannot be read."""
    import httpx

    with contextlib.suppress(Exception):
        return dict(httpx.get(url + "/v1/jitflow/engine", timeout=10).json())
    return {}


def generated_output_tokens(url: str) -> int | None:
    """Output tokens the server at ``url`` has generated so far: the sum of its ``jitflow_output_tokens``
    counter over every kind and application, read from ``/metrics`` (every finished call counts, the
    aborted and the rejected included). None when the endpoint cannot be read or parsed."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(url + "/metrics", timeout=10)
        r.raise_for_status()
        return int(sum(s.value for fam in text_string_to_metric_families(r.text) if fam.name == "jitflow_output_tokens"
                       for s in fam.samples if s.name == "jitflow_output_tokens_total"))
    except (httpx.HTTPError, ValueError):
        return None


def wait_idle(url: str, timeout: float = 60.0) -> None:
    """Wait (at most ``timeout`` s) until the server at ``url`` has no call in flight or queued."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = engine_state(url)
        if st and not st.get("unfinished") and not st.get("frontend_unfinished") and not st.get("server_in_flight"):
            return
        time.sleep(0.5)
