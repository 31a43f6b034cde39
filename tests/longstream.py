"""A long streaming request run in its own process, for the real-engine ordering tests.

Why a process and not a thread: a thread that reads a fast token stream (hundreds of SSE lines per
second) starves the other threads of the pytest process of the GIL. Measured on the 2-core CI
machine: while two such threads streamed, building an ``httpx.Client`` in the main thread took
5–8 s and a second streaming thread did not send its request until the first stream ended, while
``curl`` from another process got answers from the same server in milliseconds. The engine
tests then saw "the long requests are not in the engine together". In a child process
the stream is read without touching the test process.

Run as a script: ``python longstream.py URL BODY_JSON``; it prints JSON lines on stdout:
``{"status", "rid"}`` on the response headers, ``{"started": n}`` after 3 content chunks,
``{"timing": {...}}`` from the server's final chunk, ``{"tokens": n, "done": true}`` at the end, and
``{"error": "..."}`` on a non-200 answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path


def _main(url: str, body: dict) -> None:
    def emit(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    emit({"phase": "boot", "t": time.time()})
    import httpx

    n = 0
    hooks = {"request": [lambda _: emit({"phase": "send", "t": time.time()})]}
    with httpx.Client(timeout=300, event_hooks=hooks) as c, \
            c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        emit({"status": r.status_code, "rid": r.headers.get("X-Request-Id"), "sent_at": time.time()})
        if r.status_code != 200:
            emit({"error": r.read().decode(errors="replace")})
            return
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "jitflow" in chunk:
                emit({"timing": chunk["jitflow"]})
            elif chunk.get("choices"):
                n += 1
                if n == 3:
                    emit({"started": n})
    emit({"tokens": n, "done": True})


class LongStream:
    """Stream one chat completion in a child process; the parent only reads a few status lines.

    ``body`` is the request JSON (``stream`` is forced on). Attributes filled as lines arrive:
    ``status`` (HTTP code), ``rid`` (server request id), ``started`` (set after 3 chunks),
    ``timing`` (the server's jitflow timing object from the final chunk), ``tokens``, ``error``,
    ``finished`` (event). ``close()`` kills the child, which drops the connection (the server then
    aborts the request), and always reaps it.
    """

    def __init__(self, url: str, body: dict) -> None:
        self.created_at = time.time()
        self.status: int | None = None
        self.rid: str | None = None
        self.sent_at: float | None = None
        self.timing: dict | None = None
        self.tokens = 0
        self.error: str | None = None
        self.phases: dict[str, float] = {}  # child boot / send times, s after creation (diagnostics)
        self.started = threading.Event()
        self.finished = threading.Event()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), url, json.dumps({**body, "stream": True})],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if "phase" in ev:
                self.phases[ev["phase"]] = round(ev["t"] - self.created_at, 3)
            if "status" in ev:
                self.status, self.rid, self.sent_at = ev["status"], ev["rid"], ev["sent_at"]
            if "started" in ev:
                self.started.set()
            if "timing" in ev:
                self.timing = ev["timing"]
            if "error" in ev:
                self.error = ev["error"]
            if "tokens" in ev:
                self.tokens = ev["tokens"]
        rc = self.proc.wait()
        if rc not in (0, -15, -9) and self.error is None:
            self.error = f"stream process exited with {rc}: {self.proc.stderr.read() if self.proc.stderr else ''}"
        self.finished.set()

    def join(self, timeout: float) -> bool:
        """Wait until the stream ends by itself; True if it did."""
        return self.finished.wait(timeout)

    def close(self) -> None:
        """Stop the stream (kill the child) and reap it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=30)

    def describe(self) -> tuple:
        """What the failure messages show about this stream."""
        return (self.rid, self.status, self.tokens, self.created_at, self.phases, self.sent_at, self.error)


if __name__ == "__main__":
    _main(sys.argv[1], json.loads(sys.argv[2]))
