"""The demo's server processes: starting them, waiting for them, and starting the second one early.

The demo runs its phases on one server per side (stock vLLM, then GMAX). Starting a vLLM server takes
about 30 s on 2 cores, most of it Python imports on one core, and the GMAX server needs the length model
that trains during the first server's start. :class:`EarlyServer` starts the second side's server in a
background thread as soon as its length model exists, so that its start-up overlaps the first side's
start-up and capacity warm-up instead of adding to the run (a 6-minute budget on a machine's first
run). It never overlaps anything measured: the first side waits for it to be healthy before its
capacity window opens and before its own warm-up and phases. Idle, a started server used 0.02 CPU
seconds per second (measured over 15 s on the demo model), and it keeps its KV cache allocated
(4 GiB on the demo model) while the first side runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jitflow_server.bench.server_process import ServerProcess, ServerStartError, free_port, jitflow_command
from jitflow_server.demo.length_model import LengthModelJob
from jitflow_server.demo.plan import DemoError


def start_server(label: str, serve_args: Sequence[str], *, model: str, batch_size: int, startup_timeout: float,
                 tmp: Path, length: LengthModelJob | None, patterns: Sequence[Path]) -> ServerProcess:
    """Spawn ``jitflow serve`` for one side (returns at once): its own history database and telemetry
    file under ``tmp``, the pattern corpora, and the length model when ``length`` is given."""
    args = ["--model", model, "--port", str(free_port()), "--batch-size", str(batch_size), *serve_args,
            "--history-db", str(tmp / f"history-{label}.sqlite")]
    for p in patterns:
        args += ["--patterns", str(p)]
    env = {"JITFLOW_TELEMETRY": str(tmp / f"telemetry-{label}.jsonl")}
    if length is not None:
        env["JITFLOW_LENGTH_MODEL"] = str(length.path)
    srv = ServerProcess(jitflow_command("serve", *args), tmp / f"server-{label}.log", env=env,
                        startup_timeout=startup_timeout)
    srv.start()
    return srv


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
    if not length.done():
        with console.status(f"training the length model ({length.source_kind}) ..."):
            length.wait()
    else:
        length.wait()


class _Cancelled(Exception):
    pass


class EarlyServer:
    """A server started in a background thread once ``length`` is trained (module docstring).

    ``start`` spawns the process (:func:`start_server` with its arguments bound). :attr:`ready` is set
    when the server answers ``/health`` or the start failed; :meth:`join` returns the server (raises
    :class:`DemoError` when it failed), :meth:`close` stops the thread and the server (idempotent). The
    thread is owned by whoever created this object and never outlives :meth:`close`.
    """

    def __init__(self, start: Callable[[], ServerProcess], length: LengthModelJob, what: str,
                 timeout: float) -> None:
        self._start, self._length, self.what, self._timeout = start, length, what, timeout
        self.srv: ServerProcess | None = None
        self.error: BaseException | None = None
        self.started_after_s: float | None = None  # s after this object was made
        self.healthy_after_s: float | None = None
        self.ready = threading.Event()
        self._cancel = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"demo-{what}-server", daemon=True)
        self._thread.start()

    def _check_cancel(self, _elapsed: float = 0.0) -> None:
        if self._cancel.is_set():
            raise _Cancelled

    def _run(self) -> None:
        try:
            while not self._length.done():
                self._check_cancel()
                time.sleep(0.2)
            if not self._length.path.is_file():
                raise DemoError("the length model was not trained; the server that needs it was not started")
            self._check_cancel()
            self.srv = self._start()
            self.started_after_s = time.monotonic() - self._t0
            self.srv.wait_healthy(self._timeout, on_poll=self._check_cancel)
            self.healthy_after_s = time.monotonic() - self._t0
        except BaseException as exc:  # reported by join(); the thread must not die silently
            self.error = exc
        finally:
            self.ready.set()

    def join(self) -> ServerProcess:
        """Wait for the server to be healthy and return it. Raises :class:`DemoError` when its start
        failed (the log tail included)."""
        self._thread.join()
        if isinstance(self.error, ServerStartError):
            raise DemoError(str(self.error))
        if self.error is not None:
            raise self.error if isinstance(self.error, DemoError) else DemoError(
                f"starting the {self.what} server failed: {self.error!r}")
        assert self.srv is not None
        return self.srv

    def close(self) -> None:
        """Stop the start-up thread and the server, if any (idempotent)."""
        self._cancel.set()
        self._thread.join()
        if self.srv is not None:
            self.srv.stop()
