"""No orphaned engine processes: a small watcher process that kills the server's descendants when the
server dies, even by ``kill -9``.

vLLM runs its engine core and workers as child processes. When the server exits normally it stops them,
but a server killed with SIGKILL cannot: its children are re-parented and kept running (measured: the
engine core and a worker, ~4.1 GB, alive for minutes). :func:`start_orphan_reaper` starts a watcher as a
child of the server. The watcher records the server's descendants every ``poll_s`` seconds; when the
server is gone (the kernel's parent-death signal on Linux, or the next poll elsewhere) it sends SIGKILL
to the descendants it last saw, then exits. It holds no lock and touches no file, so a dead server
leaves nothing half-written behind it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

#: Seconds between two looks at the server's process tree.
POLL_S = 0.5
#: PR_SET_PDEATHSIG from <sys/prctl.h>: the signal this process receives when its parent dies (Linux).
_PR_SET_PDEATHSIG = 1


def start_orphan_reaper(poll_s: float = POLL_S) -> subprocess.Popen | None:
    """Start the watcher for the current process (returns it; None when ``psutil`` is missing).

    The watcher survives ``os.execv`` of the current process (the pid stays), so it can be started by a
    command that then becomes vLLM's own server.
    """
    try:
        import psutil  # noqa: F401 - checked here, used in the watcher
    except ImportError:  # pragma: no cover - psutil comes with vLLM
        return None
    code = f"from jitflow_server.engine.reaper import watch; watch({os.getpid()}, {float(poll_s)!r})"
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, close_fds=True)


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def watch(server_pid: int, poll_s: float = POLL_S) -> None:
    """The watcher's loop (runs in its own process): follow ``server_pid``'s descendants; when the server
    is gone, SIGKILL them and return."""
    import psutil

    me = os.getpid()
    seen: dict[int, psutil.Process] = {}
    stop = False

    def on_parent_death(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_parent_death)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server; it stops its own children
    _set_parent_death_signal()
    try:
        server = psutil.Process(server_pid)
    except psutil.NoSuchProcess:
        return
    while not stop:
        try:
            if os.getppid() != server_pid or not server.is_running():
                break
            for child in server.children(recursive=True):
                if child.pid != me:
                    seen[child.pid] = child
        except psutil.Error:
            break
        time.sleep(poll_s)
    for proc in seen.values():
        with contextlib.suppress(psutil.Error):
            if proc.is_running():  # is_running also checks the create time: never a recycled pid
                proc.kill()
