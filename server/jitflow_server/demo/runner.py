"""Runs a demo plan against a server with the SDK: chat and deadline requests, and the example agents
(deep research, Tree of Thoughts) as compound tasks, with a live progress line."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

from jitflow_server.demo.plan import REPO_ROOT, DemoConfig, LoadItem, Plan
from jitflow_server.demo.results import ReqRecord, RunResult, summarize_run
from jitflow_server.engine.jobs import GIVE_UP_AFTER_S  # the simulator's clients give up after as long


# ---------------------------------------------------------------------- load runner
def _import_examples() -> tuple[Any, Any]:
    """``(run_research, run_tot)`` from the repository's ``examples`` package, or ``(None, None)``.

    The example apps are not installed with the package (a top-level ``examples`` package would clash
    with other projects'), so the demo adds the source checkout's root to ``sys.path``, as
    ``python -m examples...`` from the root does.
    """
    if (REPO_ROOT / "examples" / "__init__.py").is_file() and str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        from examples.deep_research import run_research
        from examples.tree_of_thoughts import run_tot
    except ImportError:
        return None, None
    return run_research, run_tot


def _task_without_report(job: LoadItem, outcome: str, error: str) -> dict[str, Any]:
    """The record of an agent task that left no report of its own (``TaskReport.to_dict()``'s keys)."""
    return {"app": "deep-research" if job.kind == "research" else "tree-of-thoughts", "task_id": "",
            "outcome": outcome, "deadline": job.deadline, "elapsed": None, "stages": [], "tokens": 0, "error": error}


def _missed_task(job: LoadItem, ran: dict[str, Any], why: str) -> dict[str, Any]:
    """The record of an agent task stopped past its deadline: the report of the stages it ran (``ran``,
    empty when it left none) as ``deadline_missed`` with ``why``."""
    if ran:
        return {**ran, "outcome": "deadline_missed", "error": why}
    return _task_without_report(job, "deadline_missed", why)


def is_past_due(job: LoadItem, elapsed: float, request_deadline: float) -> bool:
    """True for a deadline request or agent task whose deadline has passed ``elapsed`` s into the load: it
    has missed its SLO whatever happens next. A chat request's SLO is per token, so never. A deadline
    request without its own deadline has ``request_deadline`` (s, the phase's)."""
    if job.kind == "chat":
        return False
    return elapsed > job.t + (job.deadline or request_deadline)


async def _run_request(client: Any, job: LoadItem, cfg: DemoConfig, model: str) -> ReqRecord:
    import anyio

    import jitflow

    msgs = [{"role": "user", "content": job.prompt or ""}]
    limit = None if job.kind == "chat" else (job.deadline or cfg.deadline) + GIVE_UP_AFTER_S
    try:
        with anyio.fail_after(limit):
            if job.kind == "chat":
                stream = await client.chat.completions.create(
                    model=model, messages=msgs, max_tokens=job.max_tokens, stream=True,
                    slo=jitflow.Latency(ttft=cfg.ttft, tbt=cfg.tbt), waiting_time=cfg.waiting_time)
                async with stream:
                    async for _ in stream:
                        pass
                timing, usage = stream.timing, stream.usage
            else:
                r = await client.chat.completions.create(
                    model=model, messages=msgs, max_tokens=job.max_tokens,
                    slo=jitflow.Deadline(job.deadline or cfg.deadline), waiting_time=cfg.waiting_time)
                timing, usage = r.jitflow, r.usage
    except TimeoutError:
        return ReqRecord(job.kind, job.t, "unfinished", error=f"client gave up {GIVE_UP_AFTER_S:g} s after the deadline")
    except jitflow.AdmissionRejectedError as e:
        return ReqRecord(job.kind, job.t, "rejected", error=str(e)[:200])
    except Exception as e:  # jitflow.APIError and anything unexpected: counted, never fatal to the demo
        return ReqRecord(job.kind, job.t, "error", error=f"{type(e).__name__}: {e}"[:200])
    rec = ReqRecord(job.kind, job.t, "ok")
    if usage is not None:
        rec.prompt_tokens, rec.output_tokens = usage.prompt_tokens, usage.completion_tokens
    if timing is not None:
        rec.slo_met = bool(timing.slo_met)
        rec.ttft, rec.e2el, rec.tbt = timing.ttft, timing.e2el, timing.tbt_mean
        extra = timing.model_extra or {}
        if isinstance(extra.get("token_goodput"), int):
            rec.goodput = extra["token_goodput"]
        elif rec.slo_met:
            rec.goodput = rec.output_tokens if job.kind == "chat" else rec.prompt_tokens + rec.output_tokens
    return rec



async def run_load(url: str, plan: Plan, cfg: DemoConfig, policy: str, console: Any,
                   model: str | None = None, phase: str = "", progress: Any = None) -> RunResult:
    """Drive ``plan`` against the server at ``url`` (open loop) and collect the outcomes.

    Jobs start at their offsets; after the last arrival the run waits at most ``cfg.grace``
    seconds for in-flight work, then cancels it (recorded as ``unfinished``, counted as missed).
    ``progress``: a started ``rich.progress.Progress`` to add this run's line to (runs at once share
    one: rich shows one live display at a time); None starts one for this run.
    """
    import anyio
    import httpx
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    import jitflow

    run_research, run_tot = _import_examples()
    res = RunResult(policy, phase=phase)
    label = f"{policy} · {phase}" if phase else policy
    done: dict[int, Any] = {}
    started: set[int] = set()
    transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200))
    client = jitflow.AsyncClient(base_url=url, transport=transport, timeout=httpx.Timeout(600, connect=10),
                                 telemetry_flush_timeout=2.0)
    async with client:
        model = model or (await client.models.list()).data[0].id

        async def run_job(job: LoadItem) -> None:
            started.add(job.idx)
            if job.kind in ("chat", "deadline"):
                done[job.idx] = await _run_request(client, job, cfg, model)
                return
            ran: dict[str, Any] = {}  # the report of what ran, when the time limit below cancels the task

            def keep(report: Any) -> None:
                ran.update(report.to_dict())

            try:
                with anyio.fail_after((job.deadline or 0) + GIVE_UP_AFTER_S):
                    if job.kind == "research":
                        r = await run_research(job.prompt, deadline=job.deadline, client=client, model=model,
                                               on_cancel=keep, waiting_time=cfg.waiting_time)
                    else:
                        r = await run_tot(job.numbers, deadline=job.deadline, client=client, model=model,
                                          on_cancel=keep, waiting_time=cfg.waiting_time)
                done[job.idx] = r.report.to_dict()
            except TimeoutError:
                done[job.idx] = _missed_task(job, ran, f"client gave up {GIVE_UP_AFTER_S:g} s after the deadline")
            except anyio.get_cancelled_exc_class():
                if past_due(job):  # the phase ended with nothing left that could meet an SLO (below)
                    done[job.idx] = _missed_task(job, ran, "past its deadline when the phase ended")
                raise
            except Exception as e:  # an app bug must not abort the whole demo: report it as failed
                done[job.idx] = _task_without_report(job, "failed", f"{type(e).__name__}: {e}")

        jobs = [j for j in plan.jobs if j.kind in ("chat", "deadline") or run_research is not None]
        t0 = time.monotonic()

        def past_due(job: LoadItem) -> bool:
            return is_past_due(job, time.monotonic() - t0, cfg.deadline)

        own = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console)
        with own if progress is None else contextlib.nullcontext(progress) as prog:
            bar = prog.add_task(f"[{label}] load", total=cfg.duration)

            def describe(phase: str) -> str:
                c = {k: 0 for k in ("chat", "deadline", "research", "tot")}
                for j in jobs:
                    if j.idx in done:
                        c[j.kind] += 1
                return (f"[{label}] {phase}: done chat {c['chat']} deadline {c['deadline']} "
                        f"research {c['research']} tot {c['tot']} / {len(jobs)}; in flight {len(started) - len(done)}")

            async def ticker() -> None:
                while True:
                    prog.update(bar, completed=min(cfg.duration, time.monotonic() - t0),
                                description=describe("load" if time.monotonic() - t0 < cfg.duration else "drain"))
                    await anyio.sleep(0.5)

            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                async with anyio.create_task_group() as jobs_tg:
                    for job in jobs:
                        delay = t0 + job.t - time.monotonic()
                        if delay > 0:
                            await anyio.sleep(delay)
                        jobs_tg.start_soon(run_job, job)
                    # Chat requests get ``grace`` s after the load; deadline requests and tasks until the
                    # client gives up on them (GIVE_UP_AFTER_S s past their deadline), or until every job
                    # still running is past its deadline: what is left can no longer meet an SLO, and
                    # waiting for it only lengthens the run (up to GIVE_UP_AFTER_S s per burst phase).
                    give_up = max([j.t + (j.deadline or cfg.deadline) + GIVE_UP_AFTER_S + 1 for j in jobs
                                   if j.kind != "chat"], default=0.0)
                    wait_end = max(cfg.duration + cfg.grace, give_up) + t0 - time.monotonic()
                    with anyio.move_on_after(wait_end):
                        while len(done) < len(jobs):
                            if all(j.idx in started and past_due(j) for j in jobs if j.idx not in done):
                                break
                            await anyio.sleep(0.2)
                    jobs_tg.cancel_scope.cancel()
                tg.cancel_scope.cancel()
            prog.update(bar, completed=cfg.duration, description=describe("finished"))
        res.wall = time.monotonic() - t0
    for job in jobs:
        out = done.get(job.idx)
        if job.kind in ("chat", "deadline"):
            res.records.append(out if out is not None else ReqRecord(job.kind, job.t, "unfinished"))
        else:
            if out is None:
                out = _task_without_report(job, "unfinished", "still running when the demo ended")
            out = dict(out)
            out["t"] = job.t
            out["input"] = job.prompt if job.kind == "research" else " ".join(map(str, job.numbers or []))
            res.tasks.append(out)
    res.summary = summarize_run(res.records, res.tasks, cfg.duration)
    return res
