"""Drive the real embedded engine (``jitflow serve``) for ``bench profile``, ``bench fidelity`` and
``bench engine``.

:class:`BenchServer` starts ONE ``jitflow serve`` subprocess in its own process group, waits for
``/health`` and kills the whole group on exit or exception (no leaked vLLM workers).
:func:`run_jobs_real` replays a benchmark workload (:mod:`jitflow_server.bench.workload`) against
it over HTTP exactly as a client would, so the server path is what is measured: token-id prompts with
``ignore_eos`` (exact output lengths, which the server gives the scheduler as the length bound), the
SLO object, and for compound tasks a registered task plus the ``jitflow`` task context on every call
(the server's task manager and compound advisor compute the sub-deadlines). It turns the responses'
``jitflow`` summaries (goodput
judged server-side by :func:`jitflow_server.tracker.goodput.evaluate`) into the same job records as
the simulator, so :func:`jitflow_server.bench.metrics.summarize` compares them like for like.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import numpy as np

from jitflow_server.bench.server_process import ServerProcess, ServerStartError, free_port, jitflow_command
from jitflow_server.engine.jobs import Job
from jitflow_server.scheduler.admission import DEFAULT_WAITING_TIME_S


class EngineBenchError(RuntimeError):
    """The server did not start, died, or answered unexpectedly."""


class BenchServer(ServerProcess):
    """``jitflow serve`` for a benchmark: a :class:`~jitflow_server.bench.server_process.ServerProcess`
    plus the control calls the benchmarks make (policy switch, stats, step log, wait until idle).

    Args: ``model`` (demo|demo-small|tiny|dir), ``policy``, ``batch_size`` B, ``port`` (free one if None),
    ``extra`` more CLI args, ``startup_timeout`` s, ``log_path`` for the server's output, ``env`` extra
    environment. Raises :class:`EngineBenchError` if ``/health`` is not OK within ``startup_timeout``.
    """

    def __init__(self, model: str = "demo", policy: str = "gmax", batch_size: int = 32, port: int | None = None,
                 extra: list[str] | None = None, startup_timeout: float = 300.0, log_path: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.model, self.policy, self.batch_size = model, policy, batch_size
        cmd = jitflow_command("serve", "--model", model, "--port", str(port or free_port()), "--policy", policy,
                              "--batch-size", str(batch_size), *(extra or []))
        super().__init__(cmd, log_path, env, startup_timeout)
        self.model_name = model

    def __enter__(self) -> BenchServer:
        import httpx

        try:
            super().__enter__()
        except ServerStartError as exc:
            raise EngineBenchError(str(exc)) from None
        self.model_name = httpx.get(self.base_url + "/health", timeout=10).json().get("model", self.model)
        return self

    # ---- control endpoints ----------------------------------------------------------------------
    def set_policy(self, name: str, params: dict | None = None) -> dict:
        """``POST /v1/jitflow/policy``; raises :class:`EngineBenchError` on a non-200 answer."""
        import httpx

        r = httpx.post(self.base_url + "/v1/jitflow/policy", json={"name": name, "params": params or {}}, timeout=30)
        if r.status_code != 200:
            raise EngineBenchError(f"policy switch to {name} failed: {r.status_code} {r.text[:300]}")
        return r.json()

    def stats(self) -> dict:
        """``GET /v1/jitflow/engine``."""
        import httpx

        return httpx.get(self.base_url + "/v1/jitflow/engine", timeout=30).json()

    def steps(self, since: float = 0.0) -> list[list]:
        """``GET /v1/jitflow/engine/steps``: the engine's step log after unix time ``since`` (s)."""
        import httpx

        return httpx.get(self.base_url + "/v1/jitflow/engine/steps", params={"since": since}, timeout=60).json()["steps"]

    def wait_idle(self, timeout: float = 600.0) -> dict:
        """Poll the engine stats until nothing is in flight; returns the last stats."""
        t0 = time.time()
        while True:
            st = self.stats()
            if not st.get("unfinished") and not st.get("server_in_flight"):
                return st
            if time.time() - t0 > timeout:
                raise EngineBenchError(f"engine not idle after {timeout:.0f} s: {st}")
            time.sleep(0.5)


def _prompt(rng: np.random.Generator, n: int, vocab: int = 2000) -> list[int]:
    return rng.integers(10, vocab, size=max(1, n)).tolist()


async def _post(client, url: str, body: dict) -> tuple[int, dict]:
    import httpx

    try:
        r = await client.post(url, json=body)
    except httpx.HTTPError as e:  # connection lost (e.g. the engine died): recorded as an error
        return 599, {"error": f"{type(e).__name__}: {e}"}
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"error": r.text[:300]}


def task_key(run_id: str, job_id: str) -> str:
    """Task id sent to the engine for ``job_id`` in replay ``run_id``. Unique per replay, because
    ``bench engine`` replays the same jobs (same ids) under every policy on one server and the
    engine keeps per-task state across calls (LAS's attained service): with bare job ids, the
    policies run later inherited the earlier runs' service."""
    return f"{run_id}.{job_id}"


def run_jobs_real(base_url: str, model_name: str, jobs: list[Job], waiting_time: float | None = DEFAULT_WAITING_TIME_S, seed: int = 0,
                  progress=None, closed_loop: tuple[int, float] | None = None) -> dict:
    """Replay ``jobs`` (arrival s from now) against the server; returns ``{"jobs": [records], "makespan",
    "t_start", "errors"}`` with records shaped like the simulator's (see :mod:`jitflow_server.bench.metrics`).

    A compound task is registered (``POST /v1/tasks``, id :func:`task_key`, unique per call of this
    function) and runs its stages in order (calls of a stage in parallel, ``tool_time`` between stages),
    each call carrying the ``jitflow`` task context. Tasks are not completed, so the server's history
    store stays what it was loaded with and every policy of a run is matched against the same history.
    A call answered 429 (not admitted within ``waiting_time``) fails its job; a compound task then
    cancels its other calls.

    ``closed_loop=(n, seconds)`` ignores the arrival times instead: ``n`` jobs are kept in flight, in list
    order, each starting when one ends, and no job starts after ``seconds``; the jobs never started have
    no record. That keeps an engine busy on the workload's own calls without a queue that grows.
    """
    return asyncio.run(_run_jobs(base_url, model_name, jobs, waiting_time, seed, progress, closed_loop))


def _record(job: Job, summ: dict | None, input_tokens: int) -> dict:
    """The simulator-shaped record of a single-call job (``summ``: the response's ``jitflow`` object)."""
    if summ is None:
        return {"id": job.job_id, "kind": job.kind, "app": job.app, "arrival": job.arrival, "slo_met": False,
                "goodput": 0, "output_tokens": 0, "input_tokens": input_tokens, "ttft": None,
                "tbt_mean": None, "e2el": None, "rejected": True, "preemptions": 0, "calls": 1}
    return {"id": job.job_id, "kind": job.kind, "app": job.app, "arrival": job.arrival,
            "slo_met": bool(summ["slo_met"]), "goodput": int(summ["token_goodput"]),
            "output_tokens": int(summ["output_tokens"]), "input_tokens": int(summ["prompt_tokens"]),
            "ttft": summ["ttft"], "tbt_mean": summ["tbt_mean"], "e2el": summ["e2el"], "rejected": False,
            "preemptions": 0, "calls": 1}


async def _run_jobs(base_url, model_name, jobs, waiting_time, seed, progress, closed_loop=None) -> dict:
    import httpx

    rng = np.random.default_rng(seed)
    url = base_url + "/v1/completions"
    run_id = uuid.uuid4().hex[:8]
    errors: list[str] = []
    t_start = time.time() + 0.5
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=60.0), limits=limits) as client:

        async def call(job: Job, s: int, j: int, slo: dict, task: dict | None = None):
            c = job.stages[s][j]
            body = {"model": model_name, "prompt": _prompt(rng, c.input_len), "max_tokens": c.output_len,
                    "ignore_eos": True, "temperature": 0.0, "slo": slo}
            if task is not None:
                body["jitflow"] = {**task, "call_id": f"{s}.{j}"}
            code, resp = await _post(client, url, body)
            if code == 200:
                return True, resp["jitflow"], c
            if code != 429:
                errors.append(f"{job.job_id}.{s}.{j}: HTTP {code} {str(resp)[:200]}")
            return False, None, c

        async def run_job(job: Job) -> dict | None:
            if slots is None:
                await asyncio.sleep(max(0.0, t_start + job.arrival - time.time()))
                return await serve_job(job)
            async with slots:
                if time.time() - t_start > closed_loop[1]:
                    return None
                return await serve_job(job)

        async def serve_job(job: Job) -> dict:
            t0 = time.time()
            if job.kind in ("latency", "deadline"):
                slo = ({"kind": "latency", "ttft": job.ttft, "tbt": job.tbt} if job.kind == "latency"
                       else {"kind": "deadline", "deadline": job.deadline})
                if waiting_time:
                    slo["waiting_time"] = waiting_time
                ok, summ, c = await call(job, 0, 0, slo)
                if progress is not None:
                    progress()
                return _record(job, summ if ok else None, c.input_len)
            # compound task: registered, then its stages in order
            d = float(job.deadline)
            tid = task_key(run_id, job.job_id)
            code, resp = await _post(client, base_url + "/v1/tasks", {"task_id": tid, "app": job.app, "deadline": d})
            if code != 201:
                errors.append(f"{job.job_id}: task registration HTTP {code} {str(resp)[:200]}")
            in_tok = out_tok = 0
            first = end = None
            failed = rejected = False
            parents: list[str] = []
            for s in range(len(job.stages)):
                slo = {"kind": "compound", "deadline": max(t0 + d - time.time(), 0.001)}
                if waiting_time:
                    slo["waiting_time"] = waiting_time
                task = {"task_id": tid, "stage": f"s{s}", "stage_index": s, "parents": parents}
                tasks = [asyncio.create_task(call(job, s, j, slo, task)) for j in range(len(job.stages[s]))]
                for fut in asyncio.as_completed(tasks):
                    ok, summ, c = await fut
                    if not ok:
                        failed = rejected = True
                        for t in tasks:
                            t.cancel()  # the agent's task group is cancelled (closes the HTTP requests)
                        break
                    in_tok += int(summ["prompt_tokens"])
                    out_tok += int(summ["output_tokens"])
                    if summ.get("first_token_time") is not None:
                        first = summ["first_token_time"] if first is None else min(first, summ["first_token_time"])
                    if summ.get("last_token_time") is not None:
                        end = summ["last_token_time"] if end is None else max(end, summ["last_token_time"])
                await asyncio.gather(*tasks, return_exceptions=True)
                if failed:
                    break
                parents = [f"{s}.{j}" for j in range(len(job.stages[s]))]
                if s + 1 < len(job.stages):
                    await asyncio.sleep(job.tool_time)
            if progress is not None:
                progress()
            met = (not failed) and end is not None and end <= t0 + d + 1e-9
            return {"id": job.job_id, "kind": "compound", "app": job.app, "arrival": job.arrival, "slo_met": met,
                    "goodput": (in_tok + out_tok) if met else 0, "output_tokens": out_tok,
                    "input_tokens": in_tok, "ttft": (first - t0) if first is not None else None, "tbt_mean": None,
                    "e2el": (end - t0) if (end is not None and not failed) else None, "rejected": rejected,
                    "preemptions": 0, "calls": job.n_calls}

        slots = asyncio.Semaphore(closed_loop[0]) if closed_loop else None  # None: by arrival time
        if slots is not None:
            await asyncio.sleep(max(0.0, t_start - time.time()))
        recs = await asyncio.gather(*(run_job(j) for j in jobs))
    return {"jobs": [r for r in recs if r is not None], "makespan": time.time() - t_start, "t_start": t_start,
            "errors": errors}
