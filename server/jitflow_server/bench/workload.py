"""Benchmark workloads: latency / deadline / compound requests mixed 1:1:1 (JITServe §6.1).

A workload is a list of :class:`Job` s sorted by arrival time (seconds from 0). A job is one
*request* in the paper's sense: a latency- or deadline-sensitive single LLM call, or a compound
task (a staged DAG of LLM calls; calls of a stage run in parallel, stages run one after the other).

Data (``data_dir``, default ``../shared/data`` relative to the repository when present):

- latency / deadline calls: ``(input, output)`` pairs of the Azure LLM inference trace 2023
  (``azure_llm_2023/AzureLLMInferenceTrace_conv.csv``); built-in log-normal fit otherwise
  (input median 1020, output median 129 tokens, the conv trace's medians);
- compound ``deep-research`` tasks: the JITServe deep-research trace
  (``deepresearch/deepresearch_training.json``); half of the records (even positions) are the
  *history* the analyzer matches against, the other half is sampled for the workload, so a task is
  never matched against itself; built-in 4-6 stage generator otherwise;
- compound ``tot`` tasks: a tree-of-thoughts-shaped fan-out generator (propose → k parallel
  expansions → k parallel evaluations → final answer, k ∈ [3, 5]);
- arrivals: Poisson at ``rps``, or the Azure trace's timestamps rescaled to ``rps``.

SLOs (JITServe §6.1): TTFT 2 s, TBT 100 ms, deadline 20 s, compound 20 s × stages, all multiplied
by ``tightness`` (a global factor: < 1 tighter, > 1 looser).

Jobs are built by :class:`JobFactory`, which the trace replay (``bench/traces.py``) shares, so a
replayed trace gets the same SLOs and compound task shapes as a synthetic workload.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jitflow_server.engine.jobs import PREFIX_BLOCK_TOKENS, CallSpec, Job

KINDS = ("latency", "deadline", "compound")
BASE_TTFT, BASE_TBT, BASE_DEADLINE, BASE_STAGE_DEADLINE = 2.0, 0.1, 20.0, 20.0


class WorkloadError(ValueError):
    """Invalid workload parameters (mix, rps, counts) or unreadable data files."""


def default_data_dir() -> Path | None:
    """``../shared/data`` relative to the repository root if it exists, else ``None``."""
    repo = Path(__file__).resolve().parents[3]
    p = repo.parent / "shared" / "data"
    return p if p.is_dir() else None


def load_azure_trace(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The Azure LLM inference trace (2023) CSV: arrival times (s from the first row, float array) and
    ``(ContextTokens, GeneratedTokens)`` pairs (int array of shape (n, 2)), sorted by arrival.

    Parsed by :func:`jitflow_server.bench.traces.load_trace`. Raises :class:`WorkloadError` for an
    unreadable or empty file, a file that is not an Azure trace CSV, or a bad row (line and field named).
    """
    from jitflow_server.bench.traces import load_trace

    tr = load_trace(path)
    if tr.format != "azure":
        raise WorkloadError(f"{path}: not an Azure LLM trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)")
    return tr.arrival_s, np.stack([tr.input_len, tr.output_len], axis=1)


@dataclass
class DataSources:
    """Length and arrival sources loaded once (``None`` fields fall back to built-in distributions)."""

    pairs: np.ndarray | None = None  # (n, 2) input, output of single calls (Azure conv)
    azure_times: np.ndarray | None = None  # arrival timestamps (s, from 0) of the Azure conv trace
    deepresearch: list[list[list[tuple[int, int]]]] | None = None  # workload half: stages of (in, out)
    deepresearch_history: list[list[list[tuple[int, int]]]] | None = None  # history half
    origin: dict = field(default_factory=dict)

    @classmethod
    def load(cls, data_dir: Path | None) -> DataSources:
        """Load what exists under ``data_dir`` (see module docstring). Raises :class:`WorkloadError`
        when ``data_dir`` is given but is not a directory."""
        ds = cls()
        if data_dir is None:
            ds.origin = {"single": "builtin", "arrivals": "builtin", "deep-research": "builtin"}
            return ds
        data_dir = Path(data_dir)
        if not data_dir.is_dir():
            raise WorkloadError(f"--data {data_dir} is not a directory")
        conv = data_dir / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
        if conv.exists():
            ds.azure_times, ds.pairs = load_azure_trace(conv)
            ds.origin["single"] = ds.origin["arrivals"] = str(conv)
        dr = data_dir / "deepresearch" / "deepresearch_training.json"
        if dr.exists():
            recs = json.loads(dr.read_text())
            tasks = []
            for rec in recs:
                st = sorted(rec["stages"], key=lambda s: s["stage_number"])
                tasks.append([[(int(r["input_tokens"]), int(r["output_tokens"])) for r in s["requests"]] for s in st])
            ds.deepresearch_history = tasks[0::2]
            ds.deepresearch = tasks[1::2]
            ds.origin["deep-research"] = str(dr)
        ds.origin.setdefault("single", "builtin")
        ds.origin.setdefault("arrivals", "builtin")
        ds.origin.setdefault("deep-research", "builtin")
        return ds


def _lognormal_int(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    # plain min/max: np.clip on a scalar costs ~4 µs, most of the time of building a large workload
    return int(min(max(round(rng.lognormal(math.log(median), sigma)), lo), hi))


def builtin_single(rng: np.random.Generator) -> tuple[int, int]:
    """A built-in (input, output) pair: log-normal with the Azure conv medians (1020, 129 tokens)."""
    return _lognormal_int(rng, 1020, 0.8, 8, 8000), _lognormal_int(rng, 129, 0.9, 4, 1000)


def builtin_deepresearch(rng: np.random.Generator) -> list[list[tuple[int, int]]]:
    """A built-in deep-research-shaped task (stage statistics of the data README, section 1)."""
    six = rng.random() < 0.6
    st = [[(_lognormal_int(rng, 402, 0.1, 139, 600), _lognormal_int(rng, 49, 0.5, 13, 200))]]
    st.append([(_lognormal_int(rng, 155, 0.1, 100, 250), _lognormal_int(rng, 669, 0.4, 50, 1024))
               for _ in range(int(rng.choice([1, 2, 3], p=[0.67, 0.24, 0.09])))])
    st.append([(_lognormal_int(rng, 2146, 0.5, 500, 7000), _lognormal_int(rng, 78, 0.5, 13, 200))])
    if six:
        st.append([(_lognormal_int(rng, 900, 0.8, 150, 6000), _lognormal_int(rng, 669, 0.4, 50, 1024))
                   for _ in range(int(rng.choice([1, 2, 3], p=[0.86, 0.07, 0.07])))])
        st.append([(_lognormal_int(rng, 4278, 0.3, 1500, 7500), _lognormal_int(rng, 88, 0.5, 13, 200))])
    st.append([(_lognormal_int(rng, 4050, 0.3, 1500, 7500), _lognormal_int(rng, 900, 0.3, 100, 1024))])
    return st


def builtin_tot(rng: np.random.Generator) -> list[list[tuple[int, int]]]:
    """A tree-of-thoughts-shaped fan-out task: propose → k expansions → k evaluations → final (k ∈ [3, 5])."""
    k = int(rng.integers(3, 6))
    return [
        [(_lognormal_int(rng, 300, 0.3, 50, 2000), _lognormal_int(rng, 150, 0.4, 20, 600))],
        [(_lognormal_int(rng, 500, 0.3, 50, 3000), _lognormal_int(rng, 250, 0.5, 20, 1000)) for _ in range(k)],
        [(_lognormal_int(rng, 700, 0.3, 50, 4000), _lognormal_int(rng, 30, 0.5, 5, 200)) for _ in range(k)],
        [(_lognormal_int(rng, 1500, 0.3, 100, 6000), _lognormal_int(rng, 400, 0.4, 50, 1024))],
    ]


def parse_mix(text: str) -> tuple[float, float, float]:
    """``"1:1:1"`` → weights of (latency, deadline, compound). Raises :class:`WorkloadError`."""
    try:
        parts = [float(x) for x in text.split(":")]
    except ValueError:
        raise WorkloadError(f"mix must look like 1:1:1 (latency:deadline:compound), got {text!r}") from None
    if len(parts) != 3 or any(p < 0 or not math.isfinite(p) for p in parts) or sum(parts) <= 0:
        raise WorkloadError(f"mix needs three non-negative weights with a positive sum, got {text!r}")
    return parts[0], parts[1], parts[2]


def arrival_times(n: int, rps: float, mode: str, rng: np.random.Generator, data: DataSources) -> np.ndarray:
    """``n`` arrival times (s from 0) with mean rate ``rps``.

    ``mode="poisson"``: exponential gaps. ``mode="azure"``: the Azure conv trace's inter-arrival gaps
    (cyclically if ``n`` exceeds the trace, from a random offset), rescaled so that the mean rate is
    exactly ``rps`` over the ``n`` arrivals. Raises :class:`WorkloadError` for an unknown mode,
    ``rps <= 0``, or ``azure`` without the trace.
    """
    if not (rps > 0 and math.isfinite(rps)):
        raise WorkloadError(f"rps must be > 0, got {rps}")
    if n <= 0:
        return np.zeros(0)
    if mode == "poisson":
        gaps = rng.exponential(1.0 / rps, n)
        gaps[0] = 0.0
        return np.cumsum(gaps)
    if mode == "azure":
        if data.azure_times is None:
            raise WorkloadError("--arrivals azure needs azure_llm_2023/AzureLLMInferenceTrace_conv.csv under --data")
        g = np.diff(data.azure_times)
        start = int(rng.integers(0, g.size))
        idx = (start + np.arange(n - 1)) % g.size
        gaps = g[idx]
        if n == 1 or gaps.sum() <= 0:
            return np.zeros(n)
        gaps = gaps * ((n - 1) / rps) / gaps.sum()  # mean gap exactly 1/rps
        return np.concatenate(([0.0], np.cumsum(gaps)))
    raise WorkloadError(f"arrivals must be 'poisson' or 'azure', got {mode!r}")


def check_job_params(tightness: float, length_scale: float, compound_apps: tuple[str, ...],
                     max_context: int | None = None) -> None:
    """Validate the job-shaping parameters shared by :func:`make_workload` and trace replay.

    Raises :class:`WorkloadError` for ``tightness <= 0`` or non-finite, ``length_scale <= 0``, an unknown
    compound app, or ``max_context < 2`` tokens.
    """
    if not (tightness > 0 and math.isfinite(tightness)):
        raise WorkloadError(f"tightness must be > 0, got {tightness}")
    if not (length_scale > 0):
        raise WorkloadError(f"length_scale must be > 0, got {length_scale}")
    for a in compound_apps:
        if a not in ("deep-research", "tot"):
            raise WorkloadError(f"unknown compound app {a!r} (deep-research, tot)")
    if max_context is not None and max_context < 2:
        raise WorkloadError(f"max_context must be >= 2 tokens, got {max_context}")


def kind_sequence(n: int, mix: tuple[float, float, float], rng: np.random.Generator) -> np.ndarray:
    """``n`` kind indices into :data:`KINDS` following ``mix`` exactly up to rounding (largest-remainder
    apportionment of the weights latency:deadline:compound), in a random order drawn from ``rng``.

    Raises :class:`WorkloadError` for a mix with a negative or non-finite weight or a zero sum.
    """
    w = np.asarray(mix, float)
    if w.shape != (3,) or not np.isfinite(w).all() or w.sum() <= 0 or (w < 0).any():
        raise WorkloadError(f"bad mix {mix}")
    quota = w / w.sum() * n
    counts = np.floor(quota).astype(int)
    for i in np.argsort(-(quota - counts), kind="stable")[: n - counts.sum()]:
        counts[i] += 1
    kinds = np.repeat(np.arange(3), counts)
    rng.shuffle(kinds)
    return kinds


class JobFactory:
    """Builds the jobs of one workload: per-kind SLOs, length scaling and compound task shapes.

    Shared by :func:`make_workload` (synthetic) and :func:`jitflow_server.bench.traces.trace_workload`
    (replayed traces), so both give a kind the same SLOs (s; see the module docstring) and draw compound
    stage structures from the same sources, consuming ``rng`` in the same order. Compound apps alternate
    in ``compound_apps`` over the factory's compound jobs. Parameters are not validated here (see
    :func:`check_job_params`).
    """

    def __init__(self, data: DataSources, rng: np.random.Generator, *, tightness: float = 1.0,
                 length_scale: float = 1.0, max_context: int | None = None,
                 compound_apps: tuple[str, ...] = ("deep-research", "tot"), tool_time: float = 0.5) -> None:
        self.data, self.rng = data, rng
        self.tightness, self.length_scale, self.max_context = tightness, length_scale, max_context
        self.compound_apps, self.tool_time = compound_apps, tool_time
        self.n_compound = 0

    def call(self, i: int, o: int, prefix_ids: tuple[int, ...] | None = None) -> CallSpec:
        """A call of ``i`` input and ``o`` output tokens, times ``length_scale`` (each >= 1 token), with
        input + output capped at ``max_context``. ``prefix_ids`` (ids of the prompt's
        :data:`~jitflow_server.engine.jobs.PREFIX_BLOCK_TOKENS`-token blocks) are re-blocked to the scaled
        prompt (:func:`rescale_prefix_ids`) and cut to its length."""
        ls, mc = self.length_scale, self.max_context
        ii, oo = max(1, int(round(i * ls))), max(1, int(round(o * ls)))
        if mc is not None and ii + oo > mc:
            ii = max(1, mc - oo)
            if ii + oo > mc:
                oo = max(1, mc - 1)
                ii = 1
        if prefix_ids:
            return CallSpec(ii, oo, rescale_prefix_ids(prefix_ids, ls, ii))
        return CallSpec(ii, oo)

    def single(self, jid: str, kind: str, t: float, call: CallSpec) -> Job:
        """A ``latency`` (app ``chat``: TTFT, TBT SLOs) or ``deadline`` (app ``batch``) job of one call
        arriving at ``t`` s."""
        if kind == "latency":
            return Job(jid, kind, t, "chat", [[call]], ttft=BASE_TTFT * self.tightness, tbt=BASE_TBT * self.tightness)
        return Job(jid, kind, t, "batch", [[call]], deadline=BASE_DEADLINE * self.tightness)

    def sampled_single(self, jid: str, kind: str, t: float) -> Job:
        """A single-call job whose lengths are drawn from the Azure pairs (or the built-in fit)."""
        data, rng = self.data, self.rng
        if data.pairs is not None:
            i, o = data.pairs[int(rng.integers(0, len(data.pairs)))]
        else:
            i, o = builtin_single(rng)
        return self.single(jid, kind, t, self.call(int(i), int(o)))

    def compound(self, jid: str, t: float) -> Job:
        """A compound job arriving at ``t`` s: the next app of ``compound_apps``, stages from a deep-research
        trace record (built-in generator without one) or the tot generator; deadline 20 s per stage."""
        data, rng = self.data, self.rng
        app = self.compound_apps[self.n_compound % len(self.compound_apps)]
        self.n_compound += 1
        if app == "deep-research":
            st = (data.deepresearch[int(rng.integers(0, len(data.deepresearch)))] if data.deepresearch
                  else builtin_deepresearch(rng))
        else:
            st = builtin_tot(rng)
        stages = [[self.call(i, o) for i, o in s] for s in st]
        return Job(jid, "compound", t, app, stages, deadline=BASE_STAGE_DEADLINE * len(stages) * self.tightness,
                   tool_time=self.tool_time)


def rescale_prefix_ids(ids: tuple[int, ...], length_scale: float, input_len: int) -> tuple[int, ...]:
    """Prefix-block ids for a prompt of ``input_len`` tokens whose lengths were scaled by ``length_scale``.

    ``ids`` name the original prompt's ``B`` = :data:`~jitflow_server.engine.jobs.PREFIX_BLOCK_TOKENS`-token
    blocks (equal ids at equal positions: shared prefix). Scaled block ``j`` covers original blocks
    ``floor(j/s) .. ceil((j+1)/s) - 1``; its id is a hash of theirs, so two scaled prompts share a block iff
    the original prompts shared every block it covers. With ``s = 1`` the ids are kept; in every case
    they are cut to the ``ceil(input_len / B)`` blocks of the prompt.
    """
    n = -(-int(input_len) // PREFIX_BLOCK_TOKENS)
    if length_scale == 1.0:
        return tuple(ids[:n])
    out = []
    for j in range(n):
        a = math.floor(j / length_scale)
        if a >= len(ids):
            break
        b = max(a + 1, min(len(ids), math.ceil((j + 1) / length_scale)))
        out.append(hash(tuple(ids[a:b])))
    return tuple(out)


def make_workload(
    n_jobs: int,
    rps: float,
    *,
    mix: tuple[float, float, float] = (1.0, 1.0, 1.0),
    arrivals: str = "poisson",
    data: DataSources | None = None,
    seed: int = 0,
    tightness: float = 1.0,
    compound_apps: tuple[str, ...] = ("deep-research", "tot"),
    length_scale: float = 1.0,
    max_context: int | None = None,
    tool_time: float = 0.5,
) -> list[Job]:
    """Build ``n_jobs`` jobs (JITServe §6.1 workload; see module docstring), sorted by arrival.

    Kinds follow ``mix`` exactly up to rounding (largest-remainder apportionment, then shuffled:
    :func:`kind_sequence`). ``length_scale`` multiplies every input/output length (≥ 1 token; used to
    fit the CPU demo engine); ``max_context`` caps input + output of each call (tokens). Compound apps
    alternate in ``compound_apps``; ``tool_time`` s between stages. Jobs are built by
    :class:`JobFactory`. Raises :class:`WorkloadError` for bad parameters.
    """
    if n_jobs < 0:
        raise WorkloadError("n_jobs must be >= 0")
    check_job_params(tightness, length_scale, compound_apps)
    data = data or DataSources.load(None)
    rng = np.random.default_rng(seed)
    kinds = kind_sequence(n_jobs, mix, rng)
    times = arrival_times(n_jobs, rps, arrivals, rng, data)
    fac = JobFactory(data, rng, tightness=tightness, length_scale=length_scale, max_context=max_context,
                     compound_apps=compound_apps, tool_time=tool_time)
    jobs: list[Job] = []
    for j in range(n_jobs):
        k = KINDS[int(kinds[j])]
        if k == "compound":
            jobs.append(fac.compound(f"j{j}", float(times[j])))
        else:
            jobs.append(fac.sampled_single(f"j{j}", k, float(times[j])))
    return jobs


def history_tasks(app: str, data: DataSources, n: int = 200, seed: int = 12345,
                  length_scale: float = 1.0) -> list[list[list[tuple[int, int]]]]:
    """Historical compound tasks of ``app`` for the analyzer's pattern matching (never the workload's
    own records: the deep-research history is the other half of the trace; tot uses another seed)."""
    rng = np.random.default_rng(seed)
    if app == "deep-research":
        src = data.deepresearch_history or [builtin_deepresearch(rng) for _ in range(n)]
    elif app == "tot":
        src = [builtin_tot(rng) for _ in range(n)]
    else:
        raise WorkloadError(f"unknown compound app {app!r}")
    return [[[(max(1, round(i * length_scale)), max(1, round(o * length_scale))) for i, o in s] for s in t]
            for t in src]


def workload_summary(jobs: list[Job]) -> dict:
    """Counts per kind, calls, tokens and the offered rate (jobs/s) of a workload."""
    out: dict = {"jobs": len(jobs), "calls": sum(j.n_calls for j in jobs)}
    for k in KINDS:
        out[k] = sum(1 for j in jobs if j.kind == k)
    if len(jobs) > 1:
        out["span_s"] = jobs[-1].arrival - jobs[0].arrival
        out["offered_rps"] = (len(jobs) - 1) / max(out["span_s"], 1e-9)
    tok = np.array([j.total_tokens for j in jobs]) if jobs else np.zeros((0, 2))
    out["input_tokens"] = int(tok[:, 0].sum()) if len(jobs) else 0
    out["output_tokens"] = int(tok[:, 1].sum()) if len(jobs) else 0
    return out
