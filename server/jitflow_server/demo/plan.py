"""The demo's load plan: configuration, prompts and arrivals (AlpacaEval, the Azure trace or built-in),
and the open-loop schedule of chat, deadline and agent-task items."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from jitflow_server.scheduler.admission import DEFAULT_WAITING_TIME_S

REPO_ROOT = Path(__file__).resolve().parents[3]
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
        waiting_time: jitflow's admission control (JITServe §5) rejects a request or agent-task call its
            engine has not started within this many seconds (the server's own default, 5 s, when the SLOs
            are as set); stretched with the other SLOs on a slower machine so that it keeps its share of
            the deadline. Stock vLLM has no admission control and ignores it.
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
    waiting_time: float = DEFAULT_WAITING_TIME_S
    chat_tokens: tuple[int, int] = (32, 128)
    deadline_tokens: tuple[int, int] = (64, 192)
    grace: float = 30.0
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in ("duration", "ttft", "tbt", "deadline", "waiting_time", "research_deadline", "tot_deadline"):
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


@dataclass(frozen=True)
class BaseMix:
    """The demo's load at scale 1 (arrivals per second).

    Attributes:
        chat_rate, deadline_rate: streaming chat / deadline requests per second.
        research_rate, tot_rate: deep-research / Tree-of-Thoughts tasks per second.
    """

    chat_rate: float = 0.4
    deadline_rate: float = 0.2
    research_rate: float = 5 / 120
    tot_rate: float = 6 / 120


BASE_MIX = BaseMix()


def scaled_slos(slos: DemoConfig, factor: float) -> DemoConfig:
    """``slos`` with every time SLO (chat TTFT and TBT, the deadline requests' E2EL, both task deadlines)
    and the admission waiting time multiplied by ``factor`` (> 0). Raises ``ValueError`` for a factor that is
    not positive and finite."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"SLO factor must be positive, got {factor!r}")
    return replace(slos, ttft=slos.ttft * factor, tbt=slos.tbt * factor, deadline=slos.deadline * factor,
                   waiting_time=slos.waiting_time * factor, research_deadline=slos.research_deadline * factor,
                   tot_deadline=slos.tot_deadline * factor)


def phase_config(scale: float, duration: float, seed: int, slos: DemoConfig,
                 mix: BaseMix = BASE_MIX) -> DemoConfig:
    """The load of one demo phase: ``mix`` times ``scale`` for ``duration`` seconds (task counts rounded,
    at least 1 of each when ``scale > 0``), with the SLOs, token ranges and grace of ``slos``.

    Raises:
        ValueError: ``scale`` or ``duration`` not positive and finite.
    """
    if not (math.isfinite(scale) and scale > 0 and math.isfinite(duration) and duration > 0):
        raise ValueError(f"scale and duration must be positive, got {scale!r}, {duration!r}")
    return replace(slos, duration=duration, seed=seed, chat_rate=mix.chat_rate * scale,
                   deadline_rate=mix.deadline_rate * scale,
                   research_tasks=max(1, round(mix.research_rate * scale * duration)),
                   tot_tasks=max(1, round(mix.tot_rate * scale * duration)))


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
#: Agent tasks start within this share of a phase (when their deadline is longer than the phase). A
#: phase lasts until its last task ends, and a task runs for most of its deadline under load (50-76 s
#: of 64-86 s on a 2-core float32 Xeon). 0.5 made the demo 6.5 min; 0.2 (tasks start within 8 s of a
#: 40 s phase) saved only 15 s a run there, and the earlier starts crowd the burst's first seconds, so
#: 0.4 stays.
TASK_START_SHARE = 0.4


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
    so that they can finish: starts in ``[0, max(duration - deadline, TASK_START_SHARE · duration)]``.

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
        span = max(cfg.duration - dl, TASK_START_SHARE * cfg.duration)
        for k, t in enumerate(_spread(count, span, rng)):
            if kind == "research":
                jobs.append(LoadItem(t, kind, RESEARCH_QUESTIONS[k % len(RESEARCH_QUESTIONS)], deadline=dl))
            else:
                jobs.append(LoadItem(t, kind, None, numbers=list(TOT_PUZZLES[k % len(TOT_PUZZLES)]), deadline=dl))
    jobs.sort(key=lambda j: (j.t, j.kind))
    for i, j in enumerate(jobs):
        j.idx = i
    return Plan(jobs, prompt_source, arrival_source)
