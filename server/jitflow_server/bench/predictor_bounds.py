"""Simulator length bounds from the real QRF length predictor (``--length-bound predictor``; JITServe §4.1).

The predictor (:class:`~jitflow_server.analyzer.length.LengthPredictor`) is trained on the AlpacaEval
responses of Meta-Llama-3-8B-Instruct and Mistral-7B-Instruct-v0.2 through the same calls as
``jitflow analyzer train-length`` (``load_examples`` then ``LengthPredictor(q, **TRAIN_PARAMS).fit``, with
that command's defaults) and cached under ``<JITFLOW_CACHE>/sim-length`` (:func:`sim_length_cache_dir`),
keyed by the training files' content hash, the feature and model format versions, the token counter, q and the forest parameters. Tokens are
those of :func:`sim_token_counter` (lengths and bounds alike). Qwen2-72B-Instruct is the held-out model:
its prompts and responses are never trained on.

Held-out prompts (:func:`attach_held_out_prompts`): every single call (``latency``/``deadline`` job) gets
one held-out item, drawn from a seeded permutation of the 805 items (reshuffled when used up). Its
instruction is the call's prompt, its response is what the call generates, and the call's true output
length becomes the response's length in the predictor's tokens. The call keeps its ``input_len``, the
trace's context length (chat history + instruction), which is longer than the bare instruction. The
bounder finds a call's prompt by the call id the simulator passes (``LengthBounds.bound``'s ``rid``) and
never reads the true length.

Single calls (:class:`PredictorBounder`): the bound the server's ``LengthService`` would serve, i.e. the
forest's q-bound on the prompt and the first ``g`` tokens of the response, refined every
``REFINE_EVERY`` = 50 tokens, times the online calibrator's factor (``OnlineCalibrator``, per (app, model,
k-bucket), app ``None`` and model = the held-out generator, as the server submits calls without a task).
All raw bounds of the held-out set (g = 0, 50, ... below each response's length) come from one batched
forest call per process. The calibrator runs once per workload, policy-independently, over the
*nominal* event order: the bound at g is issued at ``arrival + input_len·prefill_s + g·decode_s`` and a
call finishes (and updates the calibrator with every bound it was issued, as ``LengthService.observe``)
at ``arrival + input_len·prefill_s + L·decode_s`` (``decode_s``: the analyzer time model's per-token
decode time at the batch size). The real finish order differs per policy (and rejected calls are never
observed), which this approximation ignores. A refined bound is not smaller than the previous one in
general: the q-quantile of a length known to exceed g grows with g, so refinement mostly repairs the
under-estimates of long calls.

Compound calls have no prompt text; their bound follows ``analyzer.advisor.resolve_len_bound``: the
matched pattern graphs' stage bound (``StageAdvice.len_samples``, recorded by
:meth:`PredictorBounder.wrap_advisor` when the simulator asks the compound advisor at the stage start;
from the first frame on), refined every 50 tokens as on the server (the q-quantile of the neighbours'
same-stage lengths above ``g``, ``analyzer/stage_length.py``; the server also applies its online stage
calibrator, which the simulator leaves out: uncalibrated, these bounds cover 0.90-0.93 of the
deep-research calls) > the q-quantile of the *history* outputs of the same (app, stage) longer than ``g``
(``history_tasks``, never the workload; a stand-in for the predictor, which needs the prompt, refined
every 50 tokens as the server's running-quantile fallback) > ``max_tokens`` (1024, the deep-research
trace's cap).
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from jitflow_server.analyzer.advisor import resolve_len_bound
from jitflow_server.analyzer.length import FORMAT_VERSION, LengthModelError, LengthPredictor
from jitflow_server.analyzer.length_calibration import (
    DEFAULT_QUANTILE,
    OnlineCalibrator,
    finalize_bound,
)
from jitflow_server.analyzer.length_data import load_examples
from jitflow_server.analyzer.length_features import FEATURE_VERSION, prompt_features
from jitflow_server.analyzer.stage_length import StageLengthSamples
from jitflow_server.analyzer.tokens import TokenCounter
from jitflow_server.bench.workload import DataSources, default_data_dir, history_tasks
from jitflow_server.engine.jobs import CallSpec, Job
from jitflow_server.settings import env_settings

HELD_OUT_MODEL = "Qwen2-72B-Instruct"
TRAIN_MODELS = ("Meta-Llama-3-8B-Instruct", "Mistral-7B-Instruct-v0.2")
#: Forest parameters of ``jitflow analyzer train-length`` (its option defaults; checked by the tests).
TRAIN_PARAMS: dict[str, int] = {"n_estimators": 100, "max_depth": 30, "min_samples_leaf": 5}
#: Generated tokens between two refinements (the server's ``LengthService.refine_every``).
REFINE_EVERY = 50
#: ``max_tokens`` of compound calls (tokens; the deep-research trace's output cap).
COMPOUND_MAX_TOKENS = 1024
SINGLE_KINDS = ("latency", "deadline")
#: Fewest history outputs above ``g`` for a per-(app, stage) quantile (else the app's, as the fallback).
MIN_POOL = 20


def sim_length_cache_dir() -> Path:
    """Where trained simulator predictors are cached: ``<JITFLOW_CACHE>/sim-length``
    (``~/.cache/jitflow/sim-length``), read now."""
    return env_settings().cache_dir() / "sim-length"


@dataclass(frozen=True)
class HeldOutPrompt:
    """One held-out AlpacaEval item: ``prompt`` (instruction), ``response`` (the model's full text),
    ``output_len`` (the response's tokens in the predictor's counter), ``model`` (its generator) and
    ``item`` (its position in the file)."""

    item: int
    prompt: str
    response: str
    output_len: int
    model: str


def sim_token_counter() -> TokenCounter:
    """The simulator's token counter: the regex fallback (``regex-words-v1``). On the held-out responses
    it counts 1.34 tokens per whitespace word (median response: 340 tokens, 254 words), close to the ~1.3
    usually quoted for Llama-3's tokenizer (the simulated presets serve Llama-3-8B; its tokenizer is not
    available offline); the demo model's 2.4k-entry BPE, which the ``jitflow`` command line installs as the
    process-wide counter, counts about 2.3 times more."""
    return TokenCounter(None)


def alpaca_dir(path: str | Path | None = None) -> Path:
    """The AlpacaEval directory: ``path``, else ``<shared data>/alpaca_eval`` (``../shared/data`` next to
    the repository). Raises ``FileNotFoundError`` naming the missing directory or file."""
    if path is None:
        root = default_data_dir()
        path = (root if root is not None else Path(__file__).resolve().parents[4] / "shared" / "data") / "alpaca_eval"
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"--length-bound predictor needs the AlpacaEval responses: {p} is missing")
    for m in (*TRAIN_MODELS, HELD_OUT_MODEL):
        if not (p / f"{m}.json").is_file():
            raise FileNotFoundError(f"--length-bound predictor needs {p / f'{m}.json'}, which is missing")
    return p


def predictor_cache_path(files: Sequence[Path], quantile: float, counter: TokenCounter,
                         params: Mapping[str, int], cache_dir: Path | None = None) -> Path:
    """Cache file of the predictor trained on ``files``: named by a SHA-256 over the files' bytes, the
    feature and model format versions, the counter's name, ``quantile`` and the forest ``params``."""
    h = hashlib.sha256(f"f{FEATURE_VERSION}/m{FORMAT_VERSION}/{counter.name}/{quantile!r}/"
                       f"{sorted(params.items())}".encode())
    for f in files:
        h.update(hashlib.sha256(Path(f).read_bytes()).digest())
    base = Path(cache_dir if cache_dir is not None else sim_length_cache_dir()).expanduser()
    return base / f"length-qrf-{h.hexdigest()[:20]}.pkl"


def load_or_train_predictor(alpaca: Path, *, quantile: float = DEFAULT_QUANTILE, counter: TokenCounter | None = None,
                            params: Mapping[str, int] | None = None, cache_dir: Path | None = None) -> LengthPredictor:
    """The predictor trained on the :data:`TRAIN_MODELS` responses under ``alpaca`` (as ``jitflow analyzer
    train-length --data ... --quantile q`` would), loaded from its cache file when present, else trained
    (about 7 s with the default 100 trees) and saved there. An unreadable cache file is retrained over.
    Raises ``FileNotFoundError`` for a missing training file."""
    counter = counter or sim_token_counter()
    params = dict(TRAIN_PARAMS if params is None else params)
    files = [alpaca / f"{m}.json" for m in TRAIN_MODELS]
    path = predictor_cache_path(files, quantile, counter, params, cache_dir)
    if path.is_file():
        try:
            return LengthPredictor.load(path, counter=counter)
        except LengthModelError:
            pass
    t0 = time.perf_counter()
    examples = load_examples(files, counter=counter)
    pred = LengthPredictor(quantile, counter=counter, **params).fit(None, None, examples=examples)
    pred.meta = {"data": [str(p) for p in files], "fit_seconds": round(time.perf_counter() - t0, 2)}
    pred.save(path)
    return pred


def load_held_out(alpaca: Path, counter: TokenCounter) -> list[HeldOutPrompt]:
    """The held-out model's items, lengths counted with ``counter``. Raises ``FileNotFoundError``/``ValueError``
    for a missing or malformed file (``load_examples``)."""
    exs = load_examples([alpaca / f"{HELD_OUT_MODEL}.json"], counter=counter)
    return [HeldOutPrompt(i, e.prompt or "", e.output or "", int(e.output_len), e.model or HELD_OUT_MODEL)
            for i, e in enumerate(exs)]


def attach_held_out_prompts(jobs: Sequence[Job], items: Sequence[HeldOutPrompt], seed: int,
                            ) -> tuple[list[Job], dict[str, HeldOutPrompt]]:
    """New jobs in which every single call generates a held-out response (module docstring).

    Items are drawn in job order from permutations of ``items`` seeded by ``seed`` (the same jobs and seed
    give the same result). Single calls keep ``input_len`` (the trace's context length) and
    ``prefix_ids``; their ``output_len`` becomes the item's length. Compound calls keep their lengths.
    The inputs are not modified. Returns ``(jobs, {call id: item})``. Raises ``ValueError`` for an empty ``items``.
    """
    if not items:
        raise ValueError("no held-out items to attach")
    rng = np.random.default_rng([int(seed), 0x4C454E])
    order: list[int] = []
    out: list[Job] = []
    mapping: dict[str, HeldOutPrompt] = {}
    for job in jobs:
        stages = []
        for s, calls in enumerate(job.stages):
            new = []
            for j, c in enumerate(calls):
                cid = f"{job.job_id}.{s}.{j}"
                if job.kind in SINGLE_KINDS:
                    if not order:
                        order = [int(x) for x in rng.permutation(len(items))][::-1]
                    it = items[order.pop()]
                    mapping[cid] = it
                    new.append(CallSpec(c.input_len, it.output_len, c.prefix_ids))
                else:
                    new.append(CallSpec(c.input_len, c.output_len, c.prefix_ids))
            stages.append(new)
        out.append(replace(job, stages=stages))
    return out, mapping


class PredictorSource:
    """The trained predictor, the held-out items and their raw bounds (float tokens, before calibration)
    at g = 0, ``grid``, 2·``grid``, ... below each response's length, from one batched forest call."""

    def __init__(self, predictor: LengthPredictor, items: Sequence[HeldOutPrompt], grid: int = REFINE_EVERY) -> None:
        self.predictor, self.items, self.grid = predictor, list(items), int(grid)
        t0 = time.perf_counter()
        counter = predictor.counter
        pf = prompt_features([it.prompt for it in self.items], counter.count([it.prompt for it in self.items]))
        rows_p, texts, ks, owner = [], [], [], []
        for n, it in enumerate(self.items):
            grid_ks = list(range(0, max(it.output_len, 1), self.grid))
            _, prefs = counter.prefixes(it.response, grid_ks)
            rows_p += [n] * len(grid_ks)
            texts += prefs
            ks += grid_ks
            owner.append(len(grid_ks))
        ctx = [{"app": None, "model": self.items[n].model, "stage": None} for n in rows_p]
        X, _ = predictor.features([self.items[n].prompt for n in rows_p], texts, ctx, generated_tokens=ks,
                                  prompt_feats=pf[rows_p])
        raw, spread = predictor.predict_bounds(X)
        self.raw: list[np.ndarray] = np.split(raw, np.cumsum(owner)[:-1])
        #: the forest's spread log(bound / median) per raw bound: the unit of the calibrator's offsets
        self.spread: list[np.ndarray] = np.split(spread, np.cumsum(owner)[:-1])
        self.build_s = time.perf_counter() - t0

    def calibrated_table(self, mapping: Mapping[str, HeldOutPrompt], jobs: Sequence[Job], decode_s: float,
                         prefill_s: float, calibrate: bool = True, step: float = 0.05) -> dict[str, np.ndarray]:
        """Served bounds (int tokens) of every single call of ``mapping`` at g = 0, ``grid``, ...: the raw
        bound times the online calibrator's factor at issue time, replayed in the nominal event order of
        the module docstring (``decode_s`` s per generated token, ``prefill_s`` s per prompt token)."""
        q = self.predictor.quantile
        cal = OnlineCalibrator(q, step=step)
        events: list[tuple[float, int, str, int]] = []  # (time, 0 = finish / 1 = issue, call id, grid index)
        kind_of: dict[str, str] = {}
        for job in jobs:
            if job.kind not in SINGLE_KINDS:
                continue
            for s, calls in enumerate(job.stages):
                for j, c in enumerate(calls):
                    cid = f"{job.job_id}.{s}.{j}"
                    it = mapping.get(cid)
                    if it is None:
                        continue
                    kind_of[cid] = str(job.kind)
                    t = job.arrival + c.input_len * prefill_s
                    events += [(t + i * self.grid * decode_s, 1, cid, i) for i in range(len(self.raw[it.item]))]
                    events.append((t + it.output_len * decode_s, 0, cid, -1))
        heapq.heapify(events)
        table = {cid: np.zeros(len(self.raw[it.item]), dtype=np.int64) for cid, it in mapping.items()}
        issued: dict[str, list[tuple[int, int]]] = {}
        while events:
            _, kind, cid, i = heapq.heappop(events)
            it = mapping[cid]
            if kind == 1:
                k = i * self.grid
                fac = (cal.factor(None, it.model, k, kind=kind_of.get(cid), spread=float(self.spread[it.item][i]))
                       if calibrate else 1.0)
                b = finalize_bound(float(self.raw[it.item][i]) * fac, k, None)
                table[cid][i] = b
                issued.setdefault(cid, []).append((k, b))
            elif calibrate:  # as LengthService.observe
                cal.observe(None, it.model, issued.pop(cid, []), it.output_len, kind=kind_of.get(cid))
        return table


class HistoryQuantiles:
    """Per-(app, stage) q-quantiles (``method="higher"``) of the history tasks' output lengths above ``g``
    (tokens), for compound calls without a pattern bound; the app's pooled outputs when fewer than
    :data:`MIN_POOL` of the stage's exceed ``g``; ``None`` when the app has none either."""

    def __init__(self, data: DataSources, quantile: float, length_scale: float = 1.0,
                 apps: tuple[str, ...] = ("deep-research", "tot")) -> None:
        self.quantile = quantile
        self.pools: dict[tuple[str, Any], np.ndarray] = {}
        for app in apps:
            tasks = history_tasks(app, data, length_scale=length_scale)
            by_stage: dict[int, list[int]] = {}
            for t in tasks:
                for s, st in enumerate(t):
                    by_stage.setdefault(s, []).extend(o for _, o in st)
            for s, v in by_stage.items():
                self.pools[(app, s)] = np.sort(np.asarray(v))
            self.pools[(app, None)] = np.sort(np.asarray([o for v in by_stage.values() for o in v]))
        self._memo: dict[tuple, int | None] = {}

    def bound(self, app: str, stage: int, g: int) -> int | None:
        """The quantile bound (tokens) for a call of ``app`` stage ``stage`` after ``g`` tokens, or ``None``."""
        key = (app, stage, g)
        if key not in self._memo:
            val = None
            for pool_key in ((app, stage), (app, None)):
                pool = self.pools.get(pool_key)
                if pool is not None:
                    above = pool[np.searchsorted(pool, g, side="right"):]
                    if len(above) >= MIN_POOL:
                        val = int(np.quantile(above, self.quantile, method="higher"))
                        break
            self._memo[key] = val
        return self._memo[key]


class _RecordingAdvisor:
    """The compound advisor as the simulator calls it, recording each stage's pattern length samples."""

    def __init__(self, inner: Any, sink: dict[tuple[str, int], StageLengthSamples | None]) -> None:
        self.inner, self.sink = inner, sink

    @property
    def match_ms(self) -> list[float]:
        """The wrapped advisor's match times (ms)."""
        return self.inner.match_ms

    def stage_info(self, job: Job, s: int, t0: float) -> Any:
        """The wrapped advisor's advice for stage ``s`` of ``job``; its ``len_samples`` are recorded."""
        info = self.inner.stage_info(job, s, t0)
        self.sink[(job.job_id, s)] = getattr(info, "len_samples", None)
        return info


class PredictorBounder:
    """The simulator's ``LengthBounds`` backed by the predictor (module docstring); one per run.

    ``table``: served bounds (tokens) per single call id at g = 0, ``grid``, ...; ``history``: the compound
    fallback; ``refine_every``: generated tokens between refinements (``10**9``: never refined).
    ``bound`` raises :class:`PredictorBoundsError` for a single call whose length names no call of the table.
    """

    mode = "predictor"

    def __init__(self, table: Mapping[str, np.ndarray], history: HistoryQuantiles, *, refine_every: int = REFINE_EVERY,
                 grid: int = REFINE_EVERY, compound_max_tokens: int = COMPOUND_MAX_TOKENS) -> None:
        self.table, self.history = table, history
        self.refine_every, self.grid, self.max_tokens = int(refine_every), int(grid), int(compound_max_tokens)
        self.pattern: dict[tuple[str, int], StageLengthSamples | None] = {}

    def wrap_advisor(self, advisor: Any) -> Any:
        """``advisor`` (a ``StageAdvisor``) wrapped to record pattern bounds for this bounder; ``None`` stays ``None``."""
        return None if advisor is None else _RecordingAdvisor(advisor, self.pattern)

    def bound(self, true_len: int, generated: int, z: float, cls: tuple, rid: str | None = None) -> int:
        """Bound (tokens, ≥ ``generated`` + 1) of call ``rid`` with ``generated`` tokens so far. Never reads
        ``true_len`` or ``z``."""
        kind, app, stage = cls[0], cls[1], cls[2]
        g_issue = generated - generated % self.refine_every
        cid = rid
        if kind in SINGLE_KINDS:
            arr = self.table.get(cid) if cid is not None else None
            if arr is None:
                raise PredictorBoundsError(f"single call {cid!r} has no held-out prompt attached; build the workload "
                                           "with attach_held_out_prompts (run_sim_one does for length_bound='predictor')")
            return max(int(arr[min(g_issue // self.grid, len(arr) - 1)]), generated + 1)
        pat = None
        if cid is not None:
            job_id, _, _ = cid.rsplit(".", 2)
            samples = self.pattern.get((job_id, int(stage)))
            pat = samples.bound(g_issue) if samples is not None else None
        b, _ = resolve_len_bound(self.max_tokens, pattern=pat, predicted=self.history.bound(app, int(stage), g_issue),
                                 generated=generated)
        return max(b, generated + 1)


class PredictorBoundsError(RuntimeError):
    """The predictor bounds cannot serve a call (no held-out prompt attached to it)."""


@dataclass
class PreparedRun:
    """A workload with held-out prompts attached and its bound table (shared by every policy of a run set)."""

    jobs: list[Job]
    prompts: dict[str, HeldOutPrompt]
    table: dict[str, np.ndarray]
    history: HistoryQuantiles
    prepare_s: float

    def bounder(self, refine_every: int = REFINE_EVERY) -> PredictorBounder:
        """A fresh bounder for one run (its pattern record is per run)."""
        return PredictorBounder(self.table, self.history, refine_every=refine_every)


_SOURCES: dict[tuple, PredictorSource] = {}
_PREPARED: OrderedDict[tuple, PreparedRun] = OrderedDict()


def get_source(alpaca: str | Path | None = None, quantile: float = DEFAULT_QUANTILE,
               params: Mapping[str, int] | None = None, counter: TokenCounter | None = None) -> PredictorSource:
    """The :class:`PredictorSource` for ``alpaca`` (see :func:`alpaca_dir`), built once per process.
    Raises ``FileNotFoundError`` naming missing data."""
    a = alpaca_dir(alpaca)
    counter = counter or sim_token_counter()
    key = (str(a.resolve()), quantile, tuple(sorted((params or TRAIN_PARAMS).items())), counter.name)
    if key not in _SOURCES:
        pred = load_or_train_predictor(a, quantile=quantile, counter=counter, params=params)
        _SOURCES[key] = PredictorSource(pred, load_held_out(a, counter))
    return _SOURCES[key]


def _fingerprint(jobs: Sequence[Job]) -> int:
    """Hash of everything a run reads from a workload (identity, arrival, app, SLOs, tool time, lengths): two
    workloads that differ in any of it, e.g. only in their SLOs (an SLO-tightness sweep), never share an
    attachment."""
    return hash(tuple((j.job_id, j.kind, j.arrival, j.app, j.ttft, j.tbt, j.deadline, j.tool_time,
                       tuple((c.input_len, int(c.output_len), c.prefix_ids) for s in j.stages for c in s))
                      for j in jobs))


def prepare_predictor_run(jobs: Sequence[Job], data: DataSources, *, seed: int, decode_s: float, prefill_s: float,
                          quantile: float = DEFAULT_QUANTILE, length_scale: float = 1.0,
                          alpaca: str | Path | None = None, params: Mapping[str, int] | None = None) -> PreparedRun:
    """Attach held-out prompts to ``jobs`` (seeded by ``seed``) and build the calibrated bound table, once
    per (workload, seed, timing, quantile): later calls return the cached :class:`PreparedRun` (the same job
    objects), so every policy runs the same attached workload. A workload this function returned, passed
    back in, is kept as it is.

    Raises ``ValueError`` for ``length_scale != 1`` (held-out lengths are real token counts) and
    ``FileNotFoundError`` naming the missing AlpacaEval directory or file.
    """
    if length_scale != 1.0:
        raise ValueError(f"--length-bound predictor needs length_scale 1 (got {length_scale}): held-out responses "
                         "have their real lengths")
    t0 = time.perf_counter()
    src = get_source(alpaca, quantile, params)
    key = (id(src), _fingerprint(jobs), int(seed), float(decode_s), float(prefill_s))
    hit = _PREPARED.get(key)
    if hit is None:
        for prep in _PREPARED.values():  # an already attached workload passed back in
            if prep.jobs is jobs or (len(prep.jobs) == len(jobs) and all(a is b for a, b in zip(prep.jobs, jobs))):
                return prep
        new_jobs, prompts = attach_held_out_prompts(jobs, src.items, seed)
        table = src.calibrated_table(prompts, new_jobs, decode_s, prefill_s)
        hit = PreparedRun(new_jobs, prompts, table, HistoryQuantiles(data, quantile, length_scale),
                          time.perf_counter() - t0)
        _PREPARED[key] = hit
        while len(_PREPARED) > 4:
            _PREPARED.popitem(last=False)
    return hit


def bound_quality(prep: PreparedRun, advisor: Any, ks: Sequence[int] = (0, 400)) -> dict[str, dict[str, dict]]:
    """Coverage and tightness of the bounds a run of ``prep`` serves, per call group and ``g`` in ``ks``.

    Groups: ``single`` (predictor, calibrated) and ``compound`` (pattern bound from ``advisor``, the
    simulator's ``StageAdvisor``, asked at each stage's start with its finished stages, else the history
    quantile), with ``compound_pattern`` / ``compound_quantile`` splitting the latter by source. At each
    ``g``, the calls still running (true length > g) count: ``n``, ``coverage`` (share with true ≤ bound),
    ``median_ratio`` and ``p90_ratio`` of bound / true (tokens / tokens).
    """
    b = prep.bounder()
    an = b.wrap_advisor(advisor)
    rows: dict[str, dict[int, list[tuple[int, int]]]] = {}
    for job in prep.jobs:
        for s, calls in enumerate(job.stages):
            if job.kind not in SINGLE_KINDS and an is not None:
                an.stage_info(job, s, job.arrival)
            for j, c in enumerate(calls):
                cls = (job.kind, job.app, s)
                rid = f"{job.job_id}.{s}.{j}"
                groups = ["single"] if job.kind in SINGLE_KINDS else [
                    "compound", "compound_pattern" if b.pattern.get((job.job_id, s)) is not None else "compound_quantile"]
                for k in ks:
                    if int(c.output_len) > k:
                        for gname in groups:
                            rows.setdefault(gname, {}).setdefault(k, []).append(
                                (int(c.output_len), b.bound(c.output_len, k, 0.0, cls, rid)))
    out: dict[str, dict[str, dict]] = {}
    for gname, by_k in rows.items():
        out[gname] = {}
        for k, pairs in sorted(by_k.items()):
            t = np.asarray([p[0] for p in pairs], dtype=float)
            bd = np.asarray([p[1] for p in pairs], dtype=float)
            r = bd / np.maximum(t, 1.0)
            out[gname][str(k)] = {"n": len(pairs), "coverage": float(np.mean(t <= bd)),
                                  "median_ratio": float(np.median(r)), "p90_ratio": float(np.percentile(r, 90))}
    return out
