"""``jitflow bench chaos``: attack a real server the way hostile and careless clients do, and count the damage.

One run starts ``jitflow serve`` (real vLLM engine, the demo model by default) as a subprocess and, in order:

1. *warm-up and capacity*: 2·B streamed requests for ``capacity_s`` seconds; the engine's own step log gives
   the decode throughput (tokens/s) and the mean output length of the burst's request shape;
2. *fuzz*: ≥ 10 000 schema-driven requests (``bench/chaos_fuzz.py``): 5xx answers and 4xx answers not in
   OpenAI's error shape;
3. *disconnects*: streamed requests whose clients hang up after 1-4 chunks; afterwards the engine and the
   API must hold no request (leaked engine requests);
4. *burst*: deadline requests arriving at ``burst_factor`` × capacity (open loop, Poisson) for
   ``burst_s`` seconds; the share of *admitted* (200) requests that missed their deadline, and that every
   refusal is a 429 with ``Retry-After``;
5. *telemetry and kill -9*: compound tasks recorded and completed over HTTP (committed = answered 200),
   resident memory of the server's process tree against the start, then ``kill -9`` of the server alone:
   its descendants must be gone 10 s later (orphans), and after a restart on the same history database
   every committed task's pattern graph must be there and SQLite's integrity check must pass.

With ``compare_admission`` the burst is repeated on a server started with ``--no-deadline-admission``
(same arrivals), so the report shows what deadline admission changes.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from jitflow_server.bench.server_process import ServerProcess, free_port, jitflow_command

MSG = [{"role": "user", "content": "Summarise the last report and list the three next steps."}]


@dataclass
class ChaosOptions:
    """Settings of one chaos run (sizes in requests, times in seconds, lengths in tokens)."""

    out: Path
    model: str = "demo"
    batch_size: int = 16
    fuzz: int = 10_000
    fuzz_concurrency: int = 8
    fuzz_max_tokens: int = 8
    disconnects: int = 1_000
    disconnect_concurrency: int = 32
    capacity_s: float = 12.0
    burst_factor: float = 10.0
    burst_s: float = 20.0
    burst_deadline: float | None = None
    burst_tokens: tuple[int, int] = (32, 128)
    telemetry_tasks: int = 200
    compare_admission: bool = True
    seed: int = 0
    extra_server_args: list[str] = field(default_factory=list)


Say = Callable[[str], None]


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants (empty if it is gone)."""
    import psutil

    try:
        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss_mb(pid: int) -> dict[str, float]:
    """Resident memory (MB) of ``pid`` and its descendants: ``{"total": MB, "<pid> <name>": MB, ...}``."""
    import psutil

    out: dict[str, float] = {}
    for q in tree_pids(pid):
        try:
            p = psutil.Process(q)
            out[f"{q} {p.name()}"] = p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return {"total": sum(out.values()), **out}


def start_server(opts: ChaosOptions, name: str, db: Path, extra: list[str] | None = None) -> ServerProcess:
    """Start ``jitflow serve`` for one part of the run (log in ``out/name.log``) and wait until healthy."""
    port = free_port()
    cmd = jitflow_command("serve", "--model", opts.model, "--port", str(port), "--batch-size",
                          str(opts.batch_size), "--history-db", str(db), *opts.extra_server_args, *(extra or []))
    srv = ServerProcess(cmd, opts.out / f"{name}.log")
    srv.start()
    try:
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    return srv


def engine_state(url: str) -> dict[str, Any]:
    """``GET /v1/jitflow/engine``."""
    return httpx.get(url + "/v1/jitflow/engine", timeout=30).json()


def served_model(url: str) -> str:
    """The model id the server answers to."""
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def longest_prefill(url: str, model: str) -> None:
    """One request whose prompt fills the context (token ids): the engine's buffers reach their largest
    size before memory is first measured. The allocators keep that high-water mark; growth measured
    after it is memory the attacks kept."""
    n = httpx.get(url + "/v1/models", timeout=30).json()["data"][0].get("max_model_len") or 2048
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": [100] * (n - 8), "max_tokens": 4},
                   timeout=600)
    r.raise_for_status()


# --------------------------------------------------------------------------------------- capacity
async def _stream(client: httpx.AsyncClient, body: dict, max_chunks: int | None = None) -> int:
    """Stream one chat completion; read at most ``max_chunks`` SSE data lines (then hang up). Returns the
    number of data lines read."""
    n = 0
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return 0
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                n += 1
                if max_chunks is not None and n >= max_chunks:
                    break
    return n


def measure_capacity(url: str, model: str, opts: ChaosOptions, say: Say) -> dict[str, float]:
    """Keep 2·B requests of the burst's shape in flight for ``capacity_s`` s (after 3 s of warm-up); returns
    ``{"tokens_per_s", "mean_output_tokens"}`` from the engine's step log."""
    lo, hi = opts.burst_tokens
    rng = random.Random(opts.seed)
    done_lengths: list[int] = []

    async def worker(stop_at: float) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            while time.time() < stop_at:
                body = {"model": model, "messages": MSG, "max_tokens": rng.randint(lo, hi)}
                r = await client.post("/v1/chat/completions", json=body)
                if r.status_code == 200:
                    done_lengths.append(r.json()["usage"]["completion_tokens"])

    t_start = time.time()
    t0, t1 = t_start + 3.0, t_start + 3.0 + opts.capacity_s

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(2 * opts.batch_size):
                tg.start_soon(worker, t1)

    anyio.run(main)
    steps = httpx.get(url + "/v1/jitflow/engine/steps", params={"since": t0}, timeout=30).json()["steps"]
    decoded = sum(s[3] for s in steps if s[0] <= t1)
    tps = decoded / opts.capacity_s
    mean = sum(done_lengths) / len(done_lengths) if done_lengths else (lo + hi) / 2
    say(f"capacity: {tps:.0f} output tokens/s at B={opts.batch_size}; mean output {mean:.0f} tokens")
    return {"tokens_per_s": tps, "mean_output_tokens": mean}


# --------------------------------------------------------------------------------------- disconnects
def settle(url: str, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the engine and the API hold no request (or ``timeout`` s); returns the last state."""
    t_end = time.time() + timeout
    while True:
        st = engine_state(url)
        busy = (st.get("unfinished") or 0) + (st.get("frontend_unfinished") or 0) + (st.get("server_in_flight") or 0)
        if busy == 0 or time.time() > t_end:
            return st
        time.sleep(0.5)


def run_disconnects(url: str, model: str, opts: ChaosOptions, say: Say) -> dict[str, Any]:
    """``disconnects`` streamed requests hung up after 1-4 chunks; then the leaked requests."""
    rng = random.Random(opts.seed + 1)
    plan = [rng.randint(1, 4) for _ in range(opts.disconnects)]
    read: list[int] = []
    errors = 0
    t0 = time.monotonic()

    async def main() -> None:
        nonlocal errors
        sem = anyio.Semaphore(opts.disconnect_concurrency)
        limits = httpx.Limits(max_connections=opts.disconnect_concurrency * 2)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            async def one(k: int) -> None:
                nonlocal errors
                async with sem:
                    try:
                        read.append(await _stream(client, {"model": model, "messages": MSG, "max_tokens": 256,
                                                           "ignore_eos": True}, k))
                    except httpx.HTTPError:
                        errors += 1
                    if len(read) % 200 == 0:
                        say(f"  disconnects: {len(read)}/{len(plan)}")

            async with anyio.create_task_group() as tg:
                for k in plan:
                    tg.start_soon(one, k)

    anyio.run(main)
    st = settle(url)
    leaked = {"engine": st.get("unfinished") or 0, "frontend": st.get("frontend_unfinished") or 0,
              "api": st.get("server_in_flight") or 0}
    say(f"disconnects: {len(read)} hung up mid-stream in {time.monotonic() - t0:.0f} s; leaked {leaked}")
    return {"sent": len(plan), "completed_reads": len(read), "transport_errors": errors, "leaked": leaked,
            "leaked_total": sum(leaked.values())}


# --------------------------------------------------------------------------------------- burst
def burst_arrivals(rate: float, duration: float, tokens: tuple[int, int], seed: int) -> list[tuple[float, int]]:
    """Poisson arrivals ``(offset s, max_tokens)`` at ``rate`` per second for ``duration`` s."""
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append((t, rng.randint(*tokens)))
        t += rng.expovariate(rate)
    return out


def run_burst(url: str, model: str, arrivals: list[tuple[float, int]], deadline: float, say: Say) -> dict[str, Any]:
    """Send every arrival as a deadline request at its offset; returns counts and the admitted-missed share."""
    results: list[dict[str, Any]] = []

    async def main() -> None:
        limits = httpx.Limits(max_connections=len(arrivals) + 8, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=deadline + 120, limits=limits) as client:
            t0 = time.monotonic()

            async def one(offset: float, max_tokens: int) -> None:
                await anyio.sleep_until(t0 + offset)
                body = {"model": model, "messages": MSG, "max_tokens": max_tokens,
                        "slo": {"kind": "deadline", "deadline": deadline}}
                sent = time.monotonic()
                try:
                    r = await client.post("/v1/chat/completions", json=body)
                except httpx.HTTPError as exc:
                    results.append({"status": type(exc).__name__, "offset": offset})
                    return
                rec: dict[str, Any] = {"status": r.status_code, "offset": offset, "max_tokens": max_tokens,
                                       "latency": time.monotonic() - sent}
                if r.status_code == 200:
                    j = r.json()["jitflow"]
                    rec["slo_met"] = bool(j["slo_met"])
                    rec["tokens"] = r.json()["usage"]["completion_tokens"]
                    rec["len_bound"] = j.get("len_bound")
                    rec["ttft"] = j.get("ttft")
                elif r.status_code == 429:
                    rec["retry_after"] = r.headers.get("Retry-After")
                    rec["code"] = r.json()["error"]["code"]
                results.append(rec)

            async with anyio.create_task_group() as tg:
                for off, n in arrivals:
                    tg.start_soon(one, off, n)

    anyio.run(main)
    admitted = [r for r in results if r["status"] == 200]
    missed = [r for r in admitted if not r["slo_met"]]
    rejected = [r for r in results if r["status"] == 429]
    out = {
        "sent": len(results), "admitted": len(admitted), "met": len(admitted) - len(missed), "missed": len(missed),
        "admitted_missed_share": len(missed) / len(admitted) if admitted else 0.0,
        "rejected_429": len(rejected), "rejected_without_retry_after": sum(1 for r in rejected if not r["retry_after"]),
        "rejected_by_code": {c: sum(1 for r in rejected if r["code"] == c) for c in {r["code"] for r in rejected}},
        "other": {str(s): sum(1 for r in results if r["status"] == s)
                  for s in {r["status"] for r in results} if s not in (200, 429)},
        "goodput_tokens": sum(r["tokens"] for r in admitted if r["slo_met"]),
        "records": sorted(results, key=lambda r: r.get("offset", 0.0)),
    }
    say(f"burst: {out['sent']} sent, {out['admitted']} admitted ({out['met']} met, {out['missed']} missed = "
        f"{100 * out['admitted_missed_share']:.1f} %), {out['rejected_429']} refused with 429")
    return out


# --------------------------------------------------------------------------------------- telemetry, kill -9
def commit_tasks(url: str, n: int, say: Say) -> list[str]:
    """Record and complete ``n`` two-stage compound tasks over HTTP; returns the ids answered 200."""
    committed = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for i in range(n):
            tid = f"chaos-{i}"
            now = time.time()
            if c.post("/v1/tasks", json={"task_id": tid, "app": "chaos", "deadline": 60}).status_code != 201:
                continue
            ev = [{"type": "llm", "call_id": "a", "model": "m", "stage_index": 0, "start": now, "end": now + 1,
                   "input_tokens": 50, "output_tokens": 20 + i % 7},
                  {"type": "tool", "call_id": "t", "name": "search", "stage_index": 1, "parents": ["a"],
                   "start": now + 1, "end": now + 2},
                  {"type": "llm", "call_id": "b", "model": "m", "stage_index": 2, "parents": ["t"],
                   "start": now + 2, "end": now + 3, "input_tokens": 80, "output_tokens": 40}]
            if c.post(f"/v1/tasks/{tid}/events", json={"events": ev}).status_code != 200:
                continue
            if c.post(f"/v1/tasks/{tid}/complete", json={"outcome": "succeeded"}).status_code == 200:
                committed.append(tid)
    say(f"telemetry: {len(committed)} of {n} tasks committed")
    return committed


def stored_task_ids(db: Path) -> set[str]:
    """Task ids with a pattern graph in the history database."""
    con = sqlite3.connect(db)
    try:
        return {r[0] for r in con.execute("SELECT task_id FROM graphs")}
    finally:
        con.close()


def integrity_ok(db: Path) -> bool:
    """SQLite's ``PRAGMA integrity_check`` on the history database."""
    con = sqlite3.connect(db)
    try:
        return con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()


def kill_and_check_orphans(srv: ServerProcess, say: Say, wait_s: float = 10.0) -> dict[str, Any]:
    """``kill -9`` the server process alone; after ``wait_s`` s, its former descendants still alive."""
    import psutil

    assert srv.proc is not None
    pid = srv.proc.pid
    before = [q for q in tree_pids(pid) if q != pid]
    os.kill(pid, signal.SIGKILL)
    srv.proc.wait(timeout=30)
    time.sleep(wait_s)
    left = [q for q in before if psutil.pid_exists(q) and psutil.Process(q).status() != psutil.STATUS_ZOMBIE]
    say(f"kill -9: {len(before)} engine processes before, {len(left)} alive {wait_s:.0f} s later")
    srv.stop()  # whatever is left of its process group
    return {"descendants": len(before), "orphans": len(left)}
