"""No orphaned engine processes: a small watcher process that kills the server's descendants when the
server dies, even by ``kill -9``.

vLLM runs its engine core and workers as child processes. When the server exits normally it stops them,
but a server killed with SIGKILL cannot: its children are re-parented and kept running (measured: the
engine core and a worker, ~4.1 GB, alive for minutes). :func:`start_orphan_reaper` starts a watcher as a
child of the server. The watcher records the server's descendants every ``poll_s`` seconds; when the
server is gone (the kernel's parent-death signal on Linux, or the next poll elsewhere) it sends SIGKILL
to the descendants it last saw, then exits. It holds no lock and writes no file, so a dead server
leaves nothing half-written behind it.

No leftover files either: vLLM's processes talk over ZeroMQ IPC sockets, files named by a fresh UUID in
``VLLM_RPC_BASE_PATH`` (default: the system's temporary folder). Measured: every start of a server left
7 of them in ``/tmp`` after a graceful stop (more after ``kill -9``), thousands over a test suite's
life. :func:`private_rpc_dir` gives the server's vLLM a folder of its own, and the watcher removes it
once the server and its descendants are gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

#: Seconds between two looks at the server's process tree.
POLL_S = 0.5
#: Longest Unix socket path (``sizeof(sockaddr_un.sun_path) - 1`` on Linux): ZeroMQ refuses longer IPC paths.
IPC_PATH_MAX = 107
#: ``/`` and the UUID vLLM names each IPC socket with.
IPC_NAME_LEN = 37
#: PR_SET_PDEATHSIG from <sys/prctl.h>: the signal this process receives when its parent dies (Linux).
_PR_SET_PDEATHSIG = 1


def private_rpc_dir() -> str | None:
    """Point vLLM's IPC sockets (``VLLM_RPC_BASE_PATH``) at a new folder of this process's own, created
    under the temporary folder, and return it. Returns None (and changes nothing) when the variable was
    already set (the operator's choice stays, and is not removed) or when the temporary folder's path is
    too long for a socket path (:data:`IPC_PATH_MAX`). Call before the engine starts; hand the folder to
    :func:`start_orphan_reaper` so that it is removed when the server is gone."""
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        return None
    path = tempfile.mkdtemp(prefix="jfrpc-")
    if len(path) + IPC_NAME_LEN > IPC_PATH_MAX:  # a long TMPDIR: keep vLLM's default rather than fail
        os.rmdir(path)
        return None
    os.environ["VLLM_RPC_BASE_PATH"] = path
    return path


def start_orphan_reaper(poll_s: float = POLL_S, remove: Sequence[str] = ()) -> subprocess.Popen | None:
    """Start the watcher for the current process (returns it; None when ``psutil`` is missing).

    ``remove``: folders the watcher deletes (with their contents) once the server and its descendants
    are gone, e.g. :func:`private_rpc_dir`'s. The watcher survives ``os.execv`` of the current process
    (the pid stays), so it can be started by a command that then becomes vLLM's own server.
    """
    try:
        import psutil  # noqa: F401 - checked here, used in the watcher
    except ImportError:  # pragma: no cover - psutil comes with vLLM
        return None
    code = (f"from jitflow_server.engine.reaper import watch; "
            f"watch({os.getpid()}, {float(poll_s)!r}, {[str(d) for d in remove]!r})")
    # its own session: a SIGKILL to the server's process group (how benchmarks stop a server) must not
    # take the watcher down before it has cleaned up; it exits by itself once the server is gone
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def watch(server_pid: int, poll_s: float = POLL_S, remove: Sequence[str] = ()) -> None:
    """The watcher's loop (runs in its own process): follow ``server_pid``'s descendants; when the server
    is gone, SIGKILL them, wait for them (at most 10 s), delete the ``remove`` folders and return."""
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
        _remove(remove)
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
    with contextlib.suppress(psutil.Error):
        psutil.wait_procs(list(seen.values()), timeout=10)
    with contextlib.suppress(psutil.Error):
        server.wait(timeout=10)  # the server itself may still be closing its sockets
    _remove(remove)


def _remove(folders: Sequence[str]) -> None:
    for d in folders:
        shutil.rmtree(d, ignore_errors=True)


#: Seconds a server told to stop because its parent died (:func:`exit_with_parent`) has to shut down
#: gracefully before it kills its own process group.
PARENT_GONE_GRACE_S = 30.0


def exit_with_parent(parent_pid: int, poll_s: float = POLL_S,
                     grace_s: float = PARENT_GONE_GRACE_S) -> threading.Thread | None:
    """Stop this server when the process that started it (``parent_pid``) is gone: a daemon thread
    checks every ``poll_s`` s whether this process was re-parented, then sends itself SIGTERM (uvicorn's
    graceful shutdown, which stops the engine) and, if it is still alive ``grace_s`` s later, SIGKILLs
    its process group. Returns the thread, or None when the parent is already gone or is not this
    process's parent (nothing is watched then).

    The demo, the benchmarks and the tests start servers in a process group of their own (so that one
    ``killpg`` stops the engine with them); a SIGTERM or SIGKILL to the starting process never reaches
    them, and they used to run on, engine and all, after the run that started them was killed. They set
    ``JITFLOW_PARENT_PID`` (:class:`~jitflow_server.bench.server_process.ServerProcess`), which makes
    ``jitflow serve`` call this.
    """
    if parent_pid <= 1 or os.getppid() != parent_pid:
        return None

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(1)

    t = threading.Thread(target=run, name="exit-with-parent", daemon=True)
    t.start()
    return t
