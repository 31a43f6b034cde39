"""What the request analyzer tells the scheduler in the benchmarks: length bounds and compound-task
sub-deadlines (JITServe §4.1), with the ablation and oracle variants.

Length bounds (``--length-bound``):

- ``noisy`` (default): a *noisy-oracle* stand-in for the QRF upper bound at quantile q (0.9): for a
  call with true output length L and g tokens generated, the bound is
  ``g + ceil((L − g)·exp(σ·(z + Φ⁻¹(q))))`` with one ``z ~ N(0, 1)`` per call (a persistent
  prediction error), so the bound covers the truth with probability q; it is refined every 50
  generated tokens (JITServe §4.1) and never falls below ``g + 1``. The QRF itself
  (``analyzer/length.py``) needs prompt text, which the length-only traces do not have.
- ``oracle``: the true length (the ``oracle`` policy reads ``true_len`` anyway).
- ``average``: the ``--analyzer none`` ablation: the mean output length of the call's class
  (kind, app, stage) from the workload; once exceeded, ``g + 50`` (the next refinement point).
- ``predictor``: the real QRF length predictor on held-out AlpacaEval prompts and responses attached
  to the single calls, with the server's refinement and online calibration; compound calls get the
  pattern stage bound or a history quantile (``bench/predictor_bounds.py``, built by ``run_sim_one``,
  not by :class:`LengthBounder`).

Compound sub-deadlines (``--analyzer``), from the analyzer's ``CompoundAdvisor`` (``analyzer/advisor.py``, the
object the server uses too):

- ``pattern`` (default): at the start of stage s the partial pattern graph of the task (finished
  stages with their lengths, the open stage with its inputs) is matched against the app's history
  (``analyzer/matcher.py``); the stage gets ``T0 + φ(s)·D`` (``analyzer/subdeadline.py``,
  accumulated share), the matched graph's remaining stage time (``task_rem_gen_time``) and its total
  tokens (``task_tokens_est``);
- ``oracle``: the same formulas on the task's own true graph;
- ``none``: equal shares over the app's typical stage count (``φ(s) = (s+1)/S``), the mean stage
  time × remaining stages, the mean task tokens (the paper's average-based fallback).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jitflow_server.bench.workload import DataSources, history_tasks
from jitflow_server.engine.jobs import Job

Z90 = 1.2815515655446004  # Φ⁻¹(0.9)
LENGTH_MODES = ("noisy", "oracle", "average", "predictor")
ANALYZER_MODES = ("pattern", "oracle", "none")


def _zq(q: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(q))


@dataclass
class LengthBounder:
    """Upper bounds on a call's total output length (tokens); see module docstring.

    ``mode`` in :data:`LENGTH_MODES` except ``predictor`` (served by
    :class:`~jitflow_server.bench.predictor_bounds.PredictorBounder`); ``sigma`` log-std of the noisy bound;
    ``quantile`` its coverage. Raises ``ValueError`` for an unknown mode, ``predictor`` or a quantile outside (0, 1).
    """

    mode: str = "noisy"
    sigma: float = 0.5
    quantile: float = 0.9
    refine_every: int = 50

    def __post_init__(self) -> None:
        if self.mode not in LENGTH_MODES:
            raise ValueError(f"length-bound mode must be one of {LENGTH_MODES}, got {self.mode!r}")
        if self.mode == "predictor":
            raise ValueError("predictor bounds come from bench.predictor_bounds.PredictorBounder (run_sim_one builds it)")
        if not 0.0 < self.quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {self.quantile}")
        self._zq = Z90 if abs(self.quantile - 0.9) < 1e-12 else _zq(self.quantile)
        self.class_mean: dict[tuple, float] = {}

    def fit_averages(self, jobs: list[Job]) -> None:
        """Mean output length per (kind, app, stage) class (used by ``average``)."""
        acc: dict[tuple, list[int]] = {}
        for j in jobs:
            for s, calls in enumerate(j.stages):
                for c in calls:
                    acc.setdefault((j.kind, j.app, s), []).append(c.output_len)
        self.class_mean = {k: float(np.mean(v)) for k, v in acc.items()}

    def bound(self, true_len: int, generated: int, z: float, cls: tuple, rid: str | None = None) -> int:
        """Bound (tokens, ≥ generated + 1) for a call with ``generated`` tokens so far (``rid`` unused)."""
        g = generated - generated % self.refine_every  # refined every refine_every tokens
        if self.mode == "oracle":
            return max(true_len, generated + 1)
        if self.mode == "average":
            m = self.class_mean.get(cls, 256.0)
            b = int(math.ceil(m)) if generated < m else g + self.refine_every
            return max(b, generated + 1)
        rem = max(true_len - g, 1)
        b = g + int(math.ceil(rem * math.exp(self.sigma * (z + self._zq))))
        return max(b, generated + 1)


class CompoundAnalyzer:
    """The analyzer's :class:`~jitflow_server.analyzer.advisor.CompoundAdvisor` fed with benchmark jobs.

    Builds the history of each app (the deep-research history half, scaled like the workload), a
    matcher per app and the fallback summaries, and turns a :class:`Job` and a stage index into the
    partial pattern graph the server would have built at that point.

    Args:
        mode: ``pattern`` | ``oracle`` | ``none`` (:data:`ANALYZER_MODES`).
        data: data sources (the deep-research history half).
        decode_s, prefill_s: per-token decode and prefill seconds of the
            :class:`~jitflow_server.analyzer.subdeadline.CallTimeModel` (from the engine preset).
        length_scale: scale of the workload lengths (history is scaled the same way).
    Raises ``ValueError`` for an unknown mode.
    """

    def __init__(self, mode: str, data: DataSources, decode_s: float, prefill_s: float,
                 length_scale: float = 1.0, apps: tuple[str, ...] = ("deep-research", "tot")) -> None:
        from jitflow_server.analyzer.advisor import AppStats, CompoundAdvisor
        from jitflow_server.analyzer.matcher import Matcher
        from jitflow_server.analyzer.subdeadline import CallTimeModel, stage_times
        from jitflow_server.store.graph import PatternGraph

        if mode not in ANALYZER_MODES:
            raise ValueError(f"analyzer mode must be one of {ANALYZER_MODES}, got {mode!r}")
        self.mode = mode
        tm = CallTimeModel(prefill_s_per_token=prefill_s, decode_s_per_token=decode_s)
        self._PG = PatternGraph
        self.history: dict[str, list] = {}
        matchers: dict[str, Matcher] = {}
        typical: dict[str, int] = {}
        mean_stage_time: dict[str, float] = {}
        mean_tokens: dict[str, float] = {}
        for app in apps:
            hist = history_tasks(app, data, length_scale=length_scale)
            graphs = [PatternGraph.from_stage_lengths(app, t, task_id=f"h{i}") for i, t in enumerate(hist)]
            self.history[app] = graphs
            typical[app] = int(math.ceil(float(np.median([g.n_stages for g in graphs]))))
            mean_stage_time[app] = float(np.mean([stage_times(g, tm).mean() for g in graphs]))
            mean_tokens[app] = float(np.mean([sum(g.total_tokens()) for g in graphs]))
            if mode == "pattern":
                matchers[app] = Matcher.from_graphs(graphs, bump=False)
        self.time_model = tm
        stats = AppStats(typical_stages=lambda app: typical.get(app),
                         mean_stage_time=lambda app: mean_stage_time.get(app, 0.0),
                         mean_task_tokens=lambda app: int(mean_tokens.get(app, 0)) or None)
        self.advisor = CompoundAdvisor(mode, matcher_for=matchers.get, time_model=tm, stats=stats)

    @property
    def match_ms(self) -> list[float]:
        """Wall-clock ms of every match so far (the advisor's)."""
        return self.advisor.match_ms

    def _partial(self, job: Job, s: int):
        from jitflow_server.store.graph import DEEPRESEARCH_MODEL, CallNode

        nodes, prev = [], []
        for k in range(s + 1):
            cur = []
            for j, c in enumerate(job.stages[k]):
                nid = f"{k}.{j}"
                nodes.append(CallNode(nid, "llm", DEEPRESEARCH_MODEL, c.input_len,
                                      c.output_len if k < s else None, parents=list(prev), stage=k))
                cur.append(nid)
            prev = cur
        return self._PG.from_calls(job.app, nodes)

    def stage_info(self, job: Job, s: int, t0: float):
        """:class:`~jitflow_server.analyzer.advisor.StageAdvice` for stage ``s`` of ``job`` started at ``t0``
        (absolute s on the clock of ``t0``)."""
        d = float(job.deadline or 0.0)
        if self.mode == "oracle":
            g = self._PG.from_stage_lengths(job.app, [[(c.input_len, c.output_len) for c in st] for st in job.stages])
            return self.advisor.advise(job.app, None, s, t0, d, own_graph=g)
        partial = self._partial(job, s) if self.mode == "pattern" else None
        return self.advisor.advise(job.app, partial, s, t0, d)
