"""A server as a subprocess, for the benchmarks, the demo and the tests: start it, wait for ``/health``,
stop it with everything it spawned.

vLLM spawns an engine-core and a worker process; :class:`ServerProcess` puts the server in its own
process group and stops the whole group, so no engine process outlives the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

#: ``Popen`` keyword for server subprocesses: their own process group (so the engine-core and worker
#: processes are stopped together with ``killpg``) but NOT a new session. With the kernel's autogroup
#: scheduling (``/proc/sys/kernel/sched_autogroup_enabled``), a new session is a separate CPU group, and
#: on a 2-core machine (Linux 6.18) the busy engine's group left the client's processes with almost no
#: CPU: a busy loop got 0.1 s of CPU in 15 s, with 8-s gaps, while the engine generated; in the same
#: session it got its fair share. Load generators and tests that timed their requests were then
#: seconds late.
SERVER_PROCESS_GROUP: dict = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


class ServerStartError(RuntimeError):
    """The server exited during start-up or did not answer ``/health`` in time (message: the log tail)."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def jitflow_command(*args: str) -> list[str]:
    """``jitflow ARGS`` with the console script of the running interpreter's environment (or
    ``python -m jitflow_server.cli`` where the script is missing)."""
    exe = Path(sys.executable).with_name("jitflow")
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "jitflow_server.cli"]
    return [*head, *args]


class ServerProcess:
    """One server subprocess (its own process group) serving HTTP on 127.0.0.1.

    Args:
        cmd: the full command; it must contain ``--port N``.
        log_path: file receiving stdout and stderr (``None``: discarded).
        env: extra environment variables.
        startup_timeout: seconds :meth:`__enter__` waits for ``/health``.
        port_retries: how many times :meth:`wait_healthy` restarts the server on another free port when
            it exited at start-up because its port was taken (seen in its log as "address already in
            use"; needs ``log_path``). A port found free by :func:`free_port` can be taken by another
            process before the server binds it; ``port`` and ``base_url`` follow the move.
    Use as a context manager (start, wait until healthy, stop on exit), or call :meth:`start`,
    :meth:`wait_healthy` and :meth:`stop` yourself.
    """

    def __init__(self, cmd: Sequence[str], log_path: Path | None = None, env: dict[str, str] | None = None,
                 startup_timeout: float = 420.0, port_retries: int = 2) -> None:
        self.cmd = list(cmd)
        if "--port" not in self.cmd:
            raise ValueError("the server command needs --port")
        self.port = int(self.cmd[self.cmd.index("--port") + 1])
        self.log_path = log_path
        self.env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.port_retries = port_retries
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the server (follows a move to another port)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Spawn the server (returns at once)."""
        # the server stops when this process is gone, even killed (engine/reaper.py: exit_with_parent)
        env = {**os.environ, "JITFLOW_PARENT_PID": str(os.getpid()), **self.env}
        if self.log_path is not None:
            with open(self.log_path, "wb") as fh:
                self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                             **SERVER_PROCESS_GROUP)
        else:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                         **SERVER_PROCESS_GROUP)

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the log (empty without one)."""
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_healthy(self, timeout: float | None = None, on_poll: Callable[[float], None] | None = None) -> float:
        """Poll ``/health`` once a second until it answers 200; returns the wait (s).

        ``on_poll(elapsed s)`` is called before each poll (progress displays). Raises
        :class:`ServerStartError` with the log tail if the process exits or ``timeout`` s pass.
        """
        import httpx

        timeout = self.startup_timeout if timeout is None else timeout
        t0 = time.monotonic()
        while True:
            if on_poll is not None:
                on_poll(time.monotonic() - t0)
            if not self.alive() and self.port_retries > 0 and "address already in use" in self.log_tail().lower():
                self.port_retries -= 1
                self.stop()
                self._move_port()
                self.start()
                continue
            if not self.alive():
                code = self.proc.returncode if self.proc is not None else None
                raise ServerStartError(f"{' '.join(self.cmd[:2])} exited with code {code} during start-up; "
                                       f"log tail:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise ServerStartError(f"the server did not become healthy within {timeout:.0f} s; "
                                       f"log tail:\n{self.log_tail()}")
            time.sleep(1.0)

    def _move_port(self) -> None:
        i = self.cmd.index("--port") + 1
        self.port = free_port()
        self.cmd[i] = str(self.port)

    def _signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the process group while its leader runs; returns whether it ran."""
        p = self.proc
        if p is None or p.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)
        return True

    def pause(self) -> None:
        """Stop the whole process group (SIGSTOP) until :meth:`resume`: an idle server still runs its
        engine and API loops (6-8 % of one core on a 2-core machine), which slowed a server measured
        beside it. A no-op when the process has exited. Requests sent to a paused server wait. If this
        process dies while the server is paused, the kernel continues the orphaned group (SIGHUP, SIGCONT:
        POSIX orphaned process groups; the server is in this process's session) and the server stops
        itself (``engine/reaper.py: exit_with_parent``; ``tests/test_server_pause.py`` holds it)."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        """Continue a group stopped by :meth:`pause` (SIGCONT; harmless on a running one)."""
        self._signal_group(signal.SIGCONT)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group (continued first if :meth:`pause` stopped it), SIGKILL it after
        ``timeout`` s, and reap stray workers. Idempotent."""
        p = self.proc
        if p is None:
            return
        self.resume()
        if self._signal_group(signal.SIGTERM):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=timeout)
        # the whole group (engine workers), even if the leader already exited
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
        # ... and until the group is gone: a killed vLLM worker runs on at a full core for ~2 s while it
        # frees its memory (seen at 99 % CPU after stop() had returned), slowing whatever starts next
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15.0:
            try:
                os.killpg(p.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.1)

    def __enter__(self) -> ServerProcess:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
