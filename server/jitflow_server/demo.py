"""``jitflow demo``: the main job as a real mixed-workload run.

Starts ``jitflow serve`` (demo model, GMAX, ``patterns/*.jsonl`` as initial pattern history) as a
subprocess in its own process group, waits for ``/health``, then for a bounded time drives one
open-loop load of the three SLO kinds of JITServe §3 against it:

* ``chat`` -- streaming chat users with a latency SLO (TTFT, TBT);
* ``deadline`` -- non-streamed requests with an end-to-end deadline;
* ``compound`` -- concurrent deep-research and Tree-of-Thoughts tasks (``examples/``) with task
  deadlines, which the server splits into per-stage sub-deadlines (JITServe §4.1).

With ``--data DIR`` chat/deadline prompts are AlpacaEval instructions (``DIR/alpaca_eval/*.json``,
``max_tokens`` from the reference answer's length) and arrivals come from the Azure LLM inference
trace (``DIR/azure_llm_2023/*conv.csv``) rescaled to the target rate, keeping its burstiness;
otherwise a built-in prompt set and Poisson arrivals are used. The report gives per kind the SLO
attainment and goodput (tokens, JITServe §3), per task its stages with sub-deadlines (from
``GET /v1/tasks/{id}``) and outcome; it is written as JSON and a PNG. ``--compare fcfs`` replays
the same load (same prompts, arrival times, tasks) on the same server after switching the policy
(``POST /v1/jitflow/policy``) and prints the goodput ratio (the second run's pattern history also
holds the first run's tasks). The server is always stopped (process-group kill).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import typer

from jitflow_server.bench.server_process import ServerProcess, ServerStartError, free_port, jitflow_command

__all__ = [
    "DemoConfig",
    "LoadItem",
    "Plan",
    "ReqRecord",
    "DemoError",
    "build_plan",
    "azure_arrivals",
    "load_alpaca",
    "summarize_run",
    "plot_report",
    "run_demo",
    "register",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
KINDS = ("chat", "deadline", "compound")


class DemoError(RuntimeError):
    """The demo could not run (server failed to start or died, bad data directory)."""


# ---------------------------------------------------------------------- configuration
@dataclass
class DemoConfig:
    """Load shape of one demo run (times in seconds, rates in requests per second).

    Attributes:
        duration: arrivals are spread over ``[0, duration)``.
        chat_rate, deadline_rate: mean arrival rates of streaming chat / deadline requests.
        research_tasks, tot_tasks: number of deep-research / Tree-of-Thoughts tasks.
        research_deadline, tot_deadline: their task deadlines.
        ttft, tbt: latency SLO of chat requests.
        deadline: SLO of deadline requests (E2EL).
        chat_tokens, deadline_tokens: ``(min, max)`` ``max_tokens`` of chat / deadline requests.
        grace: after the last arrival, wait at most this long for in-flight work.
        seed: RNG seed of the plan (same seed = same load).
    """

    duration: float = 120.0
    chat_rate: float = 0.4
    deadline_rate: float = 0.2
    research_tasks: int = 5
    tot_tasks: int = 6
    research_deadline: float = 60.0
    tot_deadline: float = 45.0
    ttft: float = 2.0
    tbt: float = 0.1
    deadline: float = 20.0
    chat_tokens: tuple[int, int] = (32, 128)
    deadline_tokens: tuple[int, int] = (64, 192)
    grace: float = 30.0
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in ("duration", "ttft", "tbt", "deadline", "research_deadline", "tot_deadline"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        for name in ("chat_rate", "deadline_rate", "grace"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be >= 0, got {v!r}")
        for name in ("research_tasks", "tot_tasks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("chat_tokens", "deadline_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must satisfy 1 <= min <= max, got {(lo, hi)}")


def scaled_tasks(per_120s: int, duration: float) -> int:
    """``per_120s`` tasks per 120 s of load, scaled to ``duration`` (at least 1)."""
    return max(1, round(per_120s * duration / 120.0))


# ---------------------------------------------------------------------- built-in load
BUILTIN_PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about the sea at night.",
    "Give me three tips for learning a new language.",
    "What is the difference between weather and climate?",
    "Summarise the plot of a detective story in five sentences.",
    "How do I make a simple tomato sauce?",
    "Describe the water cycle for a ten-year-old.",
    "Write an email asking a colleague to review my code.",
    "What are the pros and cons of electric cars?",
    "Explain recursion with an everyday example.",
    "Plan a one-day walking tour of an old city.",
    "Why do cats purr?",
    "List five healthy breakfast ideas.",
    "Explain what a database index is and when to use one.",
    "Write a limerick about a sleepy programmer.",
    "How does compound interest work?",
    "Compare trains and planes for a 500 km trip.",
    "Give a step-by-step guide to changing a bicycle tyre.",
    "What causes the seasons on Earth?",
    "Explain the rules of chess in simple terms.",
    "Write a thank-you note to a teacher.",
    "How can I improve my sleep?",
    "Describe how a bill becomes a law.",
    "What is machine learning, in two paragraphs?",
]

RESEARCH_QUESTIONS = [
    "Why is the sky blue?",
    "How does continuous batching speed up LLM serving?",
    "What limits the throughput of the KV cache in LLM inference?",
    "How do deep research agents decide when to stop searching?",
    "How does GMAX choose which requests to run?",
    "What is the difference between goodput and throughput?",
    "How does speculative decoding reduce latency?",
    "How do vaccines train the immune system?",
    "What caused the Industrial Revolution?",
    "How do pattern graphs give agent stages sub-deadlines?",
]

TOT_PUZZLES = [
    [4, 9, 10, 13], [1, 4, 8, 8], [2, 3, 5, 12], [3, 3, 8, 8], [1, 2, 7, 10], [4, 4, 6, 8],
    [2, 5, 5, 10], [1, 3, 4, 6], [5, 6, 7, 8], [3, 4, 4, 13], [1, 5, 5, 5], [2, 2, 6, 9],
]


# ---------------------------------------------------------------------- plan
@dataclass
class LoadItem:
    """One scheduled unit of the demo's load, run by the SDK (a chat or deadline request, or an agent task;
    the benchmarks' token-length replay uses ``engine.jobs.Job`` instead).

    Attributes:
        t: start offset from the beginning of the load (s).
        kind: ``chat`` | ``deadline`` | ``research`` | ``tot``.
        prompt: chat/deadline prompt, research question, or ``None`` for ToT.
        max_tokens: output cap (chat/deadline).
        numbers: Game-of-24 numbers (ToT).
        deadline: task deadline (research/ToT) or request deadline (deadline kind), s.
    """

    t: float
    kind: str
    prompt: str | None = None
    max_tokens: int = 0
    numbers: list[int] | None = None
    deadline: float | None = None
    idx: int = 0


@dataclass
class Plan:
    """The full open-loop load: jobs sorted by start time plus where prompts/arrivals came from."""

    jobs: list[LoadItem]
    prompt_source: str
    arrival_source: str

    def counts(self) -> dict[str, int]:
        """Jobs per kind."""
        out: dict[str, int] = {}
        for j in self.jobs:
            out[j.kind] = out.get(j.kind, 0) + 1
        return out


def load_alpaca(data_dir: Path) -> list[tuple[str, int]]:
    """AlpacaEval ``(instruction, reference answer length in words)`` pairs, deduplicated by
    instruction, from ``data_dir/alpaca_eval/*.json`` (lists of ``{"instruction", "output"}``).

    Raises:
        DemoError: no such files or none parses.
    """
    files = sorted((data_dir / "alpaca_eval").glob("*.json"))
    if not files:
        raise DemoError(f"no AlpacaEval files in {data_dir / 'alpaca_eval'}")
    seen: dict[str, int] = {}
    for f in files:
        try:
            rows = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DemoError(f"{f}: not a JSON file: {e}") from e
        if not isinstance(rows, list):
            raise DemoError(f"{f}: expected a JSON list of records")
        for r in rows:
            if isinstance(r, dict) and isinstance(r.get("instruction"), str) and r["instruction"].strip():
                ins = r["instruction"].strip()
                words = len(str(r.get("output") or "").split())
                seen[ins] = max(seen.get(ins, 0), words)
    if not seen:
        raise DemoError(f"no instructions found in {[str(f) for f in files]}")
    return sorted(seen.items())


def azure_arrivals(path: Path, n: int, rate: float, rng: random.Random) -> list[float]:
    """``n`` arrival offsets (s, starting at 0) from a window of the Azure LLM trace, rescaled so
    that the mean rate is ``rate`` requests/s (inter-arrival ratios, i.e. burstiness, are kept).

    Raises:
        DemoError: unreadable file or fewer than ``n + 1`` rows.
        ValueError: ``n < 1`` or ``rate <= 0``.
    """
    if n < 1 or rate <= 0:
        raise ValueError("need n >= 1 and rate > 0")
    from jitflow_server.bench.workload import WorkloadError, load_azure_trace

    try:
        ts = load_azure_trace(path)[0].tolist()
    except WorkloadError as e:
        raise DemoError(str(e)) from e
    if len(ts) < n + 1:
        raise DemoError(f"{path}: {len(ts)} rows, need {n + 1}")
    start = rng.randrange(0, len(ts) - n)
    win = ts[start:start + n + 1]
    span = win[-1] - win[0]
    scale = (n / rate) / span if span > 0 else 0.0
    return [(t - win[0]) * scale for t in win[:n]]


def _spread(n: int, span: float, rng: random.Random) -> list[float]:
    """``n`` start times spread evenly over ``[0, span]`` with a little jitter."""
    if n <= 0:
        return []
    step = span / n
    return [min(span, i * step + rng.uniform(0, step * 0.5)) for i in range(n)]


def build_plan(cfg: DemoConfig, data_dir: Path | None = None) -> Plan:
    """The deterministic load for ``cfg`` (same ``cfg.seed`` and data = same plan).

    Chat and deadline requests share one arrival process (Azure trace window or Poisson) at
    ``chat_rate + deadline_rate``; each arrival is a chat with probability
    ``chat_rate / (chat_rate + deadline_rate)``. Tasks are spread over the first part of the run
    so that they can finish: starts in ``[0, max(duration - deadline, duration / 2)]``.

    Raises:
        ValueError: invalid ``cfg``.
        DemoError: ``data_dir`` given but its AlpacaEval / Azure files are unusable.
    """
    cfg.validate()
    rng = random.Random(cfg.seed)
    rate = cfg.chat_rate + cfg.deadline_rate
    n = int(round(rate * cfg.duration))
    prompts: list[tuple[str, int | None]]
    prompt_source, arrival_source = "builtin", "poisson"
    if data_dir is not None:
        prompts = [(p, w) for p, w in load_alpaca(data_dir)]
        rng.shuffle(prompts)
        prompt_source = "alpaca_eval"
    else:
        prompts = [(p, None) for p in BUILTIN_PROMPTS]
    arrivals: list[float] = []
    if n > 0:
        conv = sorted((data_dir / "azure_llm_2023").glob("*conv.csv")) if data_dir is not None else []
        if conv:
            arrivals = azure_arrivals(conv[0], n, rate, rng)
            arrival_source = f"azure:{conv[0].name}"
        else:
            t = 0.0
            for _ in range(n):
                arrivals.append(t)
                t += rng.expovariate(rate)
    arrivals = [a for a in arrivals if a < cfg.duration]
    jobs: list[LoadItem] = []
    for i, t in enumerate(arrivals):
        prompt, words = prompts[i % len(prompts)]
        is_chat = rng.random() < (cfg.chat_rate / rate)
        lo, hi = cfg.chat_tokens if is_chat else cfg.deadline_tokens
        want = int(words * 1.3) if words else rng.randint(lo, hi)
        jobs.append(LoadItem(t, "chat" if is_chat else "deadline", prompt, max(lo, min(hi, want)),
                        deadline=None if is_chat else cfg.deadline))
    for kind, count, dl in (("research", cfg.research_tasks, cfg.research_deadline),
                            ("tot", cfg.tot_tasks, cfg.tot_deadline)):
        span = max(cfg.duration - dl, cfg.duration / 2)
        for k, t in enumerate(_spread(count, span, rng)):
            if kind == "research":
                jobs.append(LoadItem(t, kind, RESEARCH_QUESTIONS[k % len(RESEARCH_QUESTIONS)], deadline=dl))
            else:
                jobs.append(LoadItem(t, kind, None, numbers=list(TOT_PUZZLES[k % len(TOT_PUZZLES)]), deadline=dl))
    jobs.sort(key=lambda j: (j.t, j.kind))
    for i, j in enumerate(jobs):
        j.idx = i
    return Plan(jobs, prompt_source, arrival_source)


# ---------------------------------------------------------------------- results
@dataclass
class ReqRecord:
    """Outcome of one chat or deadline request.

    ``status``: ``ok`` | ``rejected`` (admission, HTTP 429) | ``error`` | ``unfinished`` (still
    running when the run ended). ``goodput`` in tokens (on-time output tokens for
    latency SLOs; input + output tokens when a deadline is met). Times in seconds.
    """

    kind: str
    t: float
    status: str
    slo_met: bool = False
    ttft: float | None = None
    e2el: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    goodput: int = 0
    error: str | None = None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize_run(records: list[ReqRecord], tasks: list[dict[str, Any]], duration: float) -> dict[str, dict[str, Any]]:
    """Per-kind SLO attainment and goodput.

    Args:
        records: chat/deadline request outcomes.
        tasks: task reports (``TaskReport.to_dict()`` of the examples: ``outcome``, ``tokens``,
            ``elapsed`` ...); compound goodput = all the task's tokens if it met its deadline.
        duration: load duration (s) for goodput rates.

    Returns:
        ``{kind: {"n", "met", "attainment", "goodput_tokens", "goodput_tok_s", "rejected",
        "errors", "unfinished", "p50_ttft", "p95_ttft", "p50_e2el", "p95_e2el"}}`` for kinds
        ``chat``, ``deadline``, ``compound`` and ``all`` (attainment over all units).
    """
    out: dict[str, dict[str, Any]] = {}
    for kind in ("chat", "deadline"):
        rs = [r for r in records if r.kind == kind]
        met = sum(r.slo_met for r in rs)
        gp = sum(r.goodput for r in rs)
        ttfts = [r.ttft for r in rs if r.ttft is not None]
        e2els = [r.e2el for r in rs if r.e2el is not None and r.status == "ok"]
        out[kind] = {
            "n": len(rs), "met": met, "attainment": met / len(rs) if rs else None,
            "goodput_tokens": gp, "goodput_tok_s": gp / duration,
            "rejected": sum(r.status == "rejected" for r in rs), "errors": sum(r.status == "error" for r in rs),
            "unfinished": sum(r.status == "unfinished" for r in rs),
            "p50_ttft": _pct(ttfts, 0.5), "p95_ttft": _pct(ttfts, 0.95),
            "p50_e2el": _pct(e2els, 0.5), "p95_e2el": _pct(e2els, 0.95),
        }
    met_t = [t for t in tasks if t.get("outcome") == "succeeded"]
    gp_t = sum(int(t.get("tokens") or 0) for t in met_t)
    el = [float(t["elapsed"]) for t in tasks if t.get("outcome") in ("succeeded", "deadline_missed")
          and t.get("elapsed") is not None and math.isfinite(float(t["elapsed"]))]
    out["compound"] = {
        "n": len(tasks), "met": len(met_t), "attainment": len(met_t) / len(tasks) if tasks else None,
        "goodput_tokens": gp_t, "goodput_tok_s": gp_t / duration,
        "rejected": 0, "errors": sum(t.get("outcome") == "failed" for t in tasks),
        "unfinished": sum(t.get("outcome") == "unfinished" for t in tasks),
        "deadline_missed": sum(t.get("outcome") == "deadline_missed" for t in tasks),
        "p50_ttft": None, "p95_ttft": None, "p50_e2el": _pct(el, 0.5), "p95_e2el": _pct(el, 0.95),
    }
    n_all = sum(out[k]["n"] for k in KINDS)
    met_all = sum(out[k]["met"] for k in KINDS)
    gp_all = sum(out[k]["goodput_tokens"] for k in KINDS)
    out["all"] = {"n": n_all, "met": met_all, "attainment": met_all / n_all if n_all else None,
                  "goodput_tokens": gp_all, "goodput_tok_s": gp_all / duration}
    return out


# ---------------------------------------------------------------------- server process
def wait_healthy(url: str, server: ServerProcess | None, timeout: float, console: Any) -> float:
    """Wait for ``url/health`` with a rich spinner; returns the wait in seconds.

    Raises:
        DemoError: the process exited or ``timeout`` s passed (with the server log's tail).
    """
    import httpx
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    t0 = time.monotonic()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=False) as prog:
        tid = prog.add_task(f"starting the jitflow server at {url} (vLLM engine) ...", total=None)
        if server is not None:
            try:
                server.wait_healthy(timeout)
            except ServerStartError as exc:
                raise DemoError(str(exc)) from None
        else:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() - t0 > timeout:
                    raise DemoError(f"the server at {url} did not become healthy within {timeout:.0f}s")
                time.sleep(1.0)
        prog.update(tid, description=f"server ready at {url}")
    return time.monotonic() - t0


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


async def _run_request(client: Any, job: LoadItem, cfg: DemoConfig, model: str) -> ReqRecord:
    import jitflow

    msgs = [{"role": "user", "content": job.prompt or ""}]
    try:
        if job.kind == "chat":
            stream = await client.chat.completions.create(
                model=model, messages=msgs, max_tokens=job.max_tokens, stream=True,
                slo=jitflow.Latency(ttft=cfg.ttft, tbt=cfg.tbt))
            async with stream:
                async for _ in stream:
                    pass
            timing, usage = stream.timing, stream.usage
        else:
            r = await client.chat.completions.create(
                model=model, messages=msgs, max_tokens=job.max_tokens,
                slo=jitflow.Deadline(job.deadline or cfg.deadline))
            timing, usage = r.jitflow, r.usage
    except jitflow.AdmissionRejectedError as e:
        return ReqRecord(job.kind, job.t, "rejected", error=str(e)[:200])
    except Exception as e:  # jitflow.APIError and anything unexpected: counted, never fatal to the demo
        return ReqRecord(job.kind, job.t, "error", error=f"{type(e).__name__}: {e}"[:200])
    rec = ReqRecord(job.kind, job.t, "ok")
    if usage is not None:
        rec.prompt_tokens, rec.output_tokens = usage.prompt_tokens, usage.completion_tokens
    if timing is not None:
        rec.slo_met = bool(timing.slo_met)
        rec.ttft, rec.e2el = timing.ttft, timing.e2el
        extra = timing.model_extra or {}
        if isinstance(extra.get("token_goodput"), int):
            rec.goodput = extra["token_goodput"]
        elif rec.slo_met:
            rec.goodput = rec.output_tokens if job.kind == "chat" else rec.prompt_tokens + rec.output_tokens
    return rec


@dataclass
class RunResult:
    """One load run under one policy."""

    policy: str
    records: list[ReqRecord] = field(default_factory=list)
    tasks: list[dict[str, Any]] = field(default_factory=list)
    wall: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)


async def run_load(url: str, plan: Plan, cfg: DemoConfig, policy: str, console: Any,
                   model: str | None = None) -> RunResult:
    """Drive ``plan`` against the server at ``url`` (open loop) and collect the outcomes.

    Jobs start at their offsets; after the last arrival the run waits at most ``cfg.grace``
    seconds for in-flight work, then cancels it (recorded as ``unfinished``, counted as missed).
    """
    import anyio
    import httpx
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    import jitflow

    run_research, run_tot = _import_examples()
    res = RunResult(policy)
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
            app = "deep-research" if job.kind == "research" else "tree-of-thoughts"
            try:
                if job.kind == "research":
                    r = await run_research(job.prompt, deadline=job.deadline, client=client, model=model)
                else:
                    r = await run_tot(job.numbers, deadline=job.deadline, client=client, model=model)
                done[job.idx] = r.report.to_dict()
            except Exception as e:  # an app bug must not abort the whole demo: report it as failed
                done[job.idx] = {"app": app, "task_id": "", "outcome": "failed", "deadline": job.deadline,
                                 "elapsed": None, "stages": [], "tokens": 0, "error": f"{type(e).__name__}: {e}"}

        jobs = [j for j in plan.jobs if j.kind in ("chat", "deadline") or run_research is not None]
        t0 = time.monotonic()
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as prog:
            bar = prog.add_task(f"[{policy}] load", total=cfg.duration)

            def describe(phase: str) -> str:
                c = {k: 0 for k in ("chat", "deadline", "research", "tot")}
                for j in jobs:
                    if j.idx in done:
                        c[j.kind] += 1
                return (f"[{policy}] {phase}: done chat {c['chat']} deadline {c['deadline']} "
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
                    wait_end = max(t0 + cfg.duration - time.monotonic(), 0) + cfg.grace
                    with anyio.move_on_after(wait_end):
                        while len(done) < len(jobs):
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
                out = {"app": "deep-research" if job.kind == "research" else "tree-of-thoughts", "task_id": "",
                       "outcome": "unfinished", "deadline": job.deadline, "elapsed": None, "stages": [],
                       "tokens": 0, "error": "still running when the demo ended"}
            out = dict(out)
            out["t"] = job.t
            out["input"] = job.prompt if job.kind == "research" else " ".join(map(str, job.numbers or []))
            res.tasks.append(out)
    res.summary = summarize_run(res.records, res.tasks, cfg.duration)
    return res


# ---------------------------------------------------------------------- reporting
def _fmt(x: Any, spec: str = ".2f", unit: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:{spec}}{unit}"


def print_summary(run: RunResult, console: Any) -> None:
    """Rich tables: per-kind SLO attainment and goodput; per task its stages and outcome."""
    from rich.table import Table

    t = Table(title=f"SLO attainment and goodput per kind (policy {run.policy})")
    for c in ("kind", "n", "met", "attainment", "goodput tok", "goodput tok/s", "rejected", "err/unfin.",
              "P50 TTFT", "P95 TTFT", "P50 E2EL", "P95 E2EL"):
        t.add_column(c, justify="left" if c == "kind" else "right")
    for kind in (*KINDS, "all"):
        s = run.summary[kind]
        att = s["attainment"]
        t.add_row(kind, str(s["n"]), str(s["met"]), "-" if att is None else f"{100 * att:.0f}%",
                  str(s["goodput_tokens"]), _fmt(s["goodput_tok_s"], ".1f"), str(s.get("rejected", "")),
                  f"{s.get('errors', 0)}/{s.get('unfinished', 0)}" if kind != "all" else "",
                  _fmt(s.get("p50_ttft"), ".2f", "s"), _fmt(s.get("p95_ttft"), ".2f", "s"),
                  _fmt(s.get("p50_e2el"), ".1f", "s"), _fmt(s.get("p95_e2el"), ".1f", "s"))
    console.print(t)
    tt = Table(title=f"compound tasks (policy {run.policy}): stages as name end/sub-deadline (s from start)")
    for c in ("start", "app", "task", "deadline", "elapsed", "outcome", "matched", "stages"):
        tt.add_column(c, justify="right" if c in ("start", "deadline", "elapsed") else "left", overflow="fold")
    for task in sorted(run.tasks, key=lambda x: x.get("t", 0)):
        stages = []
        for s in task.get("stages") or []:
            end, sd = s.get("end"), s.get("sub_deadline")
            mark = "" if s.get("met_sub_deadline") is None else ("✓" if s["met_sub_deadline"] else "✗")
            stages.append(f"{s['name']} {_fmt(end, '.1f')}/{_fmt(sd, '.1f')}{mark}")
        colour = {"succeeded": "green", "deadline_missed": "yellow"}.get(task.get("outcome"), "red")
        matched = (task.get("server_view") or {}).get("matched")
        tt.add_row(_fmt(task.get("t"), ".0f"), task.get("app", ""), (task.get("task_id") or "")[:8],
                   _fmt(task.get("deadline"), ".0f"), _fmt(task.get("elapsed"), ".1f"),
                   f"[{colour}]{task.get('outcome')}[/{colour}]", "yes" if matched else "no", "; ".join(stages))
    console.print(tt)


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Write the demo's figure: per-kind SLO attainment and goodput (one bar per policy run), the
    compound tasks' stage timelines with sub-deadlines and deadlines, and the chat TTFT CDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax_att, ax_gp, ax_tl, ax_cdf = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        xs = [k + i * width for k in range(len(KINDS))]
        att = [100 * (run["summary"][k]["attainment"] or 0) for k in KINDS]
        gp = [run["summary"][k]["goodput_tok_s"] for k in KINDS]
        ax_att.bar(xs, att, width, label=run["policy"])
        ax_gp.bar(xs, gp, width, label=run["policy"])
    for ax, title, ylabel in ((ax_att, "SLO attainment per kind", "% of requests / tasks meeting SLO"),
                              (ax_gp, "goodput per kind", "goodput (tokens/s)")):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(KINDS))])
        ax.set_xticklabels(KINDS)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend()
    ax_att.set_ylim(0, 105)
    # Task timelines of the first run.
    tasks = sorted(runs[0]["tasks"], key=lambda x: x.get("t", 0)) if runs else []
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names: dict[str, str] = {}
    for row, task in enumerate(tasks):
        t0 = task.get("t", 0.0)
        for s in task.get("stages") or []:
            if s.get("end") is None:
                continue
            c = names.setdefault(s["name"], colours[len(names) % len(colours)])
            ax_tl.barh(row, s["end"] - s["start"], left=t0 + s["start"], color=c, height=0.6,
                       label=s["name"] if list(names).index(s["name"]) == len(names) - 1 and
                       not any(s["name"] == lab for lab in ax_tl.get_legend_handles_labels()[1]) else None)
            if s.get("sub_deadline") is not None:
                ax_tl.plot([t0 + s["sub_deadline"]] * 2, [row - 0.38, row + 0.38], color="black", lw=0.9)
        if task.get("deadline"):
            ok = task.get("outcome") == "succeeded"
            ax_tl.plot(t0 + task["deadline"], row, marker="|", ms=14, mew=2.5, color="green" if ok else "red")
    ax_tl.set_yticks(range(len(tasks)))
    short = {"deep-research": "DR", "tree-of-thoughts": "ToT"}
    verdict = {"succeeded": "met", "deadline_missed": "missed"}
    ax_tl.set_yticklabels([f"{short.get(t.get('app', ''), t.get('app', ''))} {verdict.get(t.get('outcome'), t.get('outcome'))}"
                           for t in tasks], fontsize=7)
    ax_tl.set_xlabel("time since load start (s)")
    ax_tl.set_title(f"compound tasks ({runs[0]['policy'] if runs else ''}): stages, sub-deadlines (black ticks), "
                    "deadline (green: met, red: missed)", fontsize=9)
    if names:
        ax_tl.legend(fontsize=7, loc="lower right")
    for run in runs:
        ttfts = sorted(r["ttft"] for r in run["records"] if r["kind"] == "chat" and r.get("ttft") is not None)
        if ttfts:
            ax_cdf.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=run["policy"])
    ttft_slo = report.get("config", {}).get("ttft")
    if ttft_slo:
        ax_cdf.axvline(ttft_slo, color="grey", ls="--", label="TTFT SLO")
    ax_cdf.set_xlabel("chat TTFT (s)")
    ax_cdf.set_ylabel("CDF")
    ax_cdf.set_title("streaming chat: time to first token")
    ax_cdf.legend()
    fig.suptitle(f"jitflow demo: model {report.get('model')}, {report.get('plan', {}).get('counts')}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _run_dict(run: RunResult) -> dict[str, Any]:
    return {"policy": run.policy, "wall": run.wall, "summary": run.summary,
            "records": [asdict(r) for r in run.records], "tasks": run.tasks}


def _set_policy(url: str, name: str) -> None:
    import httpx

    r = httpx.post(url + "/v1/jitflow/policy", json={"name": name}, timeout=30)
    if r.status_code >= 400:
        raise DemoError(f"could not switch the policy to {name!r}: HTTP {r.status_code} {r.text[:200]}")


def _current_policy(url: str) -> str | None:
    import httpx

    with contextlib.suppress(Exception):
        st = httpx.get(url + "/v1/jitflow/engine", timeout=10).json()
        pol = st.get("policy")
        if isinstance(pol, dict):
            pol = pol.get("name")
        return pol if isinstance(pol, str) else None
    return None


def _wait_idle(url: str, timeout: float = 60.0) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with contextlib.suppress(Exception):
            st = httpx.get(url + "/v1/jitflow/engine", timeout=10).json()
            if not st.get("unfinished") and not st.get("frontend_unfinished") and not st.get("server_in_flight"):
                return
        time.sleep(0.5)


def _healthy(url: str) -> bool:
    import httpx

    with contextlib.suppress(Exception):
        return httpx.get(url + "/health", timeout=5).status_code == 200
    return False


def run_demo(
    cfg: DemoConfig,
    *,
    data_dir: Path | None = None,
    compare: str | None = None,
    model: str = "demo",
    policy: str = "gmax",
    out: Path = Path("demo-report.json"),
    plot: Path | None = None,
    server_url: str | None = None,
    patterns: list[Path] | None = None,
    port: int = 0,
    startup_timeout: float = 300.0,
    history_db: Path | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """Run the demo end to end and return the report dict (also written to ``out`` and ``plot``).

    Args:
        cfg: load shape.
        data_dir: trace directory (AlpacaEval + Azure), or None for the built-in load.
        compare: a second policy (e.g. ``fcfs``) to replay the same load under.
        model: ``jitflow serve --model`` value.
        policy: the first run's policy.
        server_url: use this running server instead of starting one (its policy is switched
            to ``policy`` and restored afterwards).
        patterns: JSONL corpora for ``--patterns`` (default ``patterns/*.jsonl`` of the repo).
        port: server port (0 = a free one).
        history_db: the server's history DB (default: a fresh temporary file).

    Raises:
        DemoError: the server failed to start, died, or the policy could not be switched.
        ValueError: invalid ``cfg``.
    """
    import anyio
    from rich.console import Console

    import jitflow

    console = console or Console()
    cfg.validate()
    plan = build_plan(cfg, data_dir)
    plot = plot or out.with_suffix(".png")
    if patterns is None:
        patterns = sorted((REPO_ROOT / "patterns").glob("*.jsonl"))
    if _import_examples()[0] is None and (cfg.research_tasks or cfg.tot_tasks):
        console.print("[yellow]warning:[/yellow] the examples/ package is not importable (run from a source "
                      "checkout); running without compound tasks")
    server: ServerProcess | None = None
    tmp = tempfile.TemporaryDirectory(prefix="jitflow-demo-")
    t_start = time.monotonic()
    restore: str | None = None
    keep_log = False
    warnings.simplefilter("ignore", jitflow.TelemetryWarning)
    try:
        if server_url is None:
            port = port or free_port()
            url = f"http://127.0.0.1:{port}"
            args = ["--model", model, "--port", str(port), "--policy", policy,
                    "--history-db", str(history_db or Path(tmp.name) / "history.sqlite")]
            for p in patterns:
                args += ["--patterns", str(p)]
            server = ServerProcess(jitflow_command("serve", *args), Path(tmp.name) / "server.log",
                                   env={"JITFLOW_TELEMETRY": str(Path(tmp.name) / "telemetry.jsonl")})
            console.print(f"jitflow demo: model [bold]{model}[/bold], policy [bold]{policy}[/bold], "
                          f"{len(patterns)} pattern corpora, load {cfg.duration:.0f}s "
                          f"({plan.prompt_source} prompts, {plan.arrival_source} arrivals): {plan.counts()}")
            server.start()
        else:
            url = server_url.rstrip("/")
            restore = _current_policy(url)
        startup = wait_healthy(url, server, startup_timeout, console)
        if server_url is not None:
            _set_policy(url, policy)
        _warmup(url)
        runs = []
        for pol in [policy] + ([compare] if compare else []):
            if pol != policy:
                _wait_idle(url)
                _set_policy(url, pol)
                console.print(f"replaying the same load under [bold]{pol}[/bold]")
            run = anyio.run(run_load, url, plan, cfg, pol, console)
            if not _healthy(url):
                raise DemoError("the server stopped answering /health during the run"
                                + (f"; log tail:\n{server.log_tail()}" if server else ""))
            print_summary(run, console)
            runs.append(run)
        report: dict[str, Any] = {
            "model": model, "server": url, "startup_s": startup, "wall_s": None,
            "config": asdict(cfg), "data": str(data_dir) if data_dir else None,
            "plan": {"prompt_source": plan.prompt_source, "arrival_source": plan.arrival_source,
                     "counts": plan.counts()},
            "patterns": [str(p) for p in patterns] if server is not None else None,
            "runs": [_run_dict(r) for r in runs],
        }
        if compare:
            a, b = runs[0].summary, runs[1].summary
            ratio = {k: (a[k]["goodput_tokens"] / b[k]["goodput_tokens"]) if b[k]["goodput_tokens"] else None
                     for k in (*KINDS, "all")}
            report["compare"] = {"policies": [policy, compare], "goodput_ratio": ratio}
            r_all = ratio["all"]
            console.print(f"[bold]goodput ratio {policy}/{compare}: "
                          f"{'n/a' if r_all is None else f'{r_all:.2f}x'}[/bold] (per kind: "
                          + ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}x'}" for k, v in ratio.items()
                                      if k != "all") + ")")
        report["wall_s"] = time.monotonic() - t_start
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))
        plot_report(report, plot)
        console.print(f"wrote {out} and {plot} (total {report['wall_s']:.0f}s incl. {startup:.0f}s start-up)")
        errors = sum(r.status == "error" for run in runs for r in run.records) + sum(
            t.get("outcome") == "failed" for run in runs for t in run.tasks)
        if errors and server is not None:
            keep_log = True
            console.print(f"[yellow]{errors} requests/tasks failed with errors; server log kept at "
                          f"{out.with_suffix('.server.log')}[/yellow]")
        return report
    except BaseException:
        keep_log = server is not None
        raise
    finally:
        if server is not None:
            server.stop()
            if keep_log:
                with contextlib.suppress(OSError):
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.with_suffix(".server.log").write_text(server.log_path.read_text(errors="replace"))
        elif restore is not None:
            with contextlib.suppress(Exception):
                _wait_idle(url, 30)
                _set_policy(url, restore)
        tmp.cleanup()


def _warmup(url: str) -> None:
    """One plain and one JSON-schema request so start-up costs (grammar compiler) are not
    charged to the first requests of the load."""
    import httpx

    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    with contextlib.suppress(Exception):
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        httpx.post(url + "/v1/chat/completions", json={**body, "model": model}, timeout=120)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        httpx.post(url + "/v1/chat/completions", json={
            **body, "model": model, "max_tokens": 100,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}, timeout=120)


# ---------------------------------------------------------------------- CLI
def register(app: typer.Typer) -> None:
    """Attach ``jitflow demo`` to the root CLI."""

    @app.command()
    def demo(
        data: Optional[Path] = typer.Option(None, "--data", help="Trace folder with alpaca_eval/*.json and "
                                            "azure_llm_2023/*conv.csv (e.g. ../shared/data)."),
        duration: float = typer.Option(120.0, help="Seconds of load (arrivals); the run then drains."),
        compare: Optional[str] = typer.Option(None, help="Replay the same load under this policy (e.g. fcfs) "
                                              "and print the goodput ratio."),
        model: str = typer.Option("demo", help="'demo', 'tiny' or a model directory."),
        out: Path = typer.Option(Path("demo-report.json"), help="Report JSON (the plot goes next to it as .png)."),
        plot: Optional[Path] = typer.Option(None, help="Plot path (default: OUT with .png)."),
        policy: str = typer.Option("gmax", help="Policy of the first run."),
        server: Optional[str] = typer.Option(None, help="Use a running server at this URL instead of "
                                             "starting one."),
        patterns: Optional[list[Path]] = typer.Option(None, "--patterns", help="Pattern corpora (default: "
                                                      "patterns/*.jsonl)."),
        no_patterns: bool = typer.Option(False, "--no-patterns", help="Start with an empty pattern history."),
        port: int = typer.Option(0, help="Server port (0: a free port)."),
        seed: int = typer.Option(0, help="Seed of the load plan."),
        chat_rate: float = typer.Option(0.4, help="Streaming chat arrivals per second."),
        deadline_rate: float = typer.Option(0.2, help="Deadline-request arrivals per second."),
        research_tasks: Optional[int] = typer.Option(None, help="Deep-research tasks (default: 5 per 120 s of "
                                                     "load, at least 1)."),
        tot_tasks: Optional[int] = typer.Option(None, help="Tree-of-Thoughts tasks (default: 6 per 120 s of "
                                                "load, at least 1)."),
        research_deadline: float = typer.Option(60.0, help="Deep-research task deadline (s)."),
        tot_deadline: float = typer.Option(45.0, help="Tree-of-Thoughts task deadline (s)."),
        ttft: float = typer.Option(2.0, help="Chat TTFT SLO (s)."),
        tbt: float = typer.Option(0.1, help="Chat TBT SLO (s)."),
        deadline: float = typer.Option(20.0, help="Deadline-request SLO (s)."),
        grace: float = typer.Option(30.0, help="Max seconds to wait for in-flight work after the load."),
        startup_timeout: float = typer.Option(300.0, help="Max seconds to wait for the server's /health."),
    ) -> None:
        """The main job: a mixed chat / deadline / agent-task load on one server, with a goodput report."""
        from rich.console import Console

        from jitflow_server.scheduler import POLICY_NAMES

        for name, pol in (("--policy", policy), ("--compare", compare)):
            if pol is not None and pol not in POLICY_NAMES:
                raise typer.BadParameter(f"choose one of {list(POLICY_NAMES)}", param_hint=name)
        if data is not None and not data.is_dir():
            raise typer.BadParameter(f"{data} is not a directory", param_hint="--data")
        if patterns:
            for p in patterns:
                if not p.is_file():
                    raise typer.BadParameter(f"no such file: {p}", param_hint="--patterns")
        if research_tasks is None:
            research_tasks = scaled_tasks(5, duration)
        if tot_tasks is None:
            tot_tasks = scaled_tasks(6, duration)
        cfg = DemoConfig(duration=duration, chat_rate=chat_rate, deadline_rate=deadline_rate,
                         research_tasks=research_tasks, tot_tasks=tot_tasks, research_deadline=research_deadline,
                         tot_deadline=tot_deadline, ttft=ttft, tbt=tbt, deadline=deadline, grace=grace, seed=seed)
        try:
            cfg.validate()
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        console = Console()
        try:
            run_demo(cfg, data_dir=data, compare=compare, model=model, policy=policy, out=out, plot=plot,
                     server_url=server, patterns=[] if no_patterns else (list(patterns) if patterns else None),
                     port=port,
                     startup_timeout=startup_timeout, console=console)
        except DemoError as e:
            console.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
            raise typer.Exit(code=1) from None
        except KeyboardInterrupt:
            console.print("[red]interrupted[/red]; server stopped")
            raise typer.Exit(code=130) from None
