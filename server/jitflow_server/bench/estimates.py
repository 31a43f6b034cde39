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

Compound sub-deadlines (``--analyzer``):

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

from jitflow_server.bench.workload import DataSources, Job, history_tasks

Z90 = 1.2815515655446004  # Φ⁻¹(0.9)
LENGTH_MODES = ("noisy", "oracle", "average")
ANALYZER_MODES = ("pattern", "oracle", "none")


def _zq(q: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(q))


@dataclass
class LengthBounder:
    """Upper bounds on a call's total output length (tokens); see module docstring.

    ``mode`` in :data:`LENGTH_MODES`; ``sigma`` log-std of the noisy bound; ``quantile`` its coverage.
    Raises ``ValueError`` for an unknown mode or a quantile outside (0, 1).
    """

    mode: str = "noisy"
    sigma: float = 0.5
    quantile: float = 0.9
    refine_every: int = 50

    def __post_init__(self) -> None:
        if self.mode not in LENGTH_MODES:
            raise ValueError(f"length-bound mode must be one of {LENGTH_MODES}, got {self.mode!r}")
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

    def bound(self, true_len: int, generated: int, z: float, cls: tuple) -> int:
        """Bound (tokens, ≥ generated + 1) for a call with ``generated`` tokens so far."""
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


@dataclass
class StageInfo:
    """Analyzer output for one stage of a compound task (absolute seconds, tokens)."""

    sub_deadline: float
    task_rem_gen_time: float
    task_tokens_est: int | None


class CompoundAnalyzer:
    """Sub-deadlines and task estimates of compound stages (see module docstring).

    Args:
        mode: ``pattern`` | ``oracle`` | ``none``.
        data: data sources (the deep-research history half).
        decode_s, prefill_s: per-token decode and prefill seconds of the
            :class:`~jitflow_server.analyzer.subdeadline.TokenTimeModel` (from the engine preset).
        length_scale: scale of the workload lengths (history is scaled the same way).
    Raises ``ValueError`` for an unknown mode.
    """

    def __init__(self, mode: str, data: DataSources, decode_s: float, prefill_s: float,
                 length_scale: float = 1.0, apps: tuple[str, ...] = ("deep-research", "tot")) -> None:
        from jitflow_server.analyzer.matcher import Matcher
        from jitflow_server.analyzer.patterns import PatternGraph
        from jitflow_server.analyzer.subdeadline import TokenTimeModel, stage_times

        if mode not in ANALYZER_MODES:
            raise ValueError(f"analyzer mode must be one of {ANALYZER_MODES}, got {mode!r}")
        self.mode = mode
        self.tm = TokenTimeModel(prefill_s_per_token=prefill_s, decode_s_per_token=decode_s)
        self._PG = PatternGraph
        self.matchers: dict[str, Matcher] = {}
        self.typical: dict[str, int] = {}
        self.mean_stage_time: dict[str, float] = {}
        self.mean_tokens: dict[str, float] = {}
        self.match_ms: list[float] = []
        for app in apps:
            hist = history_tasks(app, data, length_scale=length_scale)
            graphs = [PatternGraph.from_stage_lengths(app, t, task_id=f"h{i}") for i, t in enumerate(hist)]
            self.typical[app] = int(math.ceil(float(np.median([g.n_stages for g in graphs]))))
            self.mean_stage_time[app] = float(np.mean([stage_times(g, self.tm).mean() for g in graphs]))
            self.mean_tokens[app] = float(np.mean([sum(g.total_tokens()) for g in graphs]))
            if mode == "pattern":
                self.matchers[app] = Matcher.from_graphs(graphs, bump=False)

    def _partial(self, job: Job, s: int):
        from jitflow_server.analyzer.patterns import DEEPRESEARCH_MODEL, CallNode

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

    def stage_info(self, job: Job, s: int, t0: float) -> StageInfo:
        """Sub-deadline (absolute s on the clock of ``t0``), remaining time and task tokens for stage ``s``."""
        import time

        from jitflow_server.analyzer.subdeadline import remaining_time, sub_deadline

        d = float(job.deadline or 0.0)
        if self.mode == "none":
            typ = self.typical.get(job.app, len(job.stages))
            sd = sub_deadline(None, s, t0, d, expected_stages=typ, time_model=self.tm)
            rem = self.mean_stage_time.get(job.app, 0.0) * max(0, typ - s - 1)
            return StageInfo(sd, rem, int(self.mean_tokens.get(job.app, 0)) or None)
        if self.mode == "oracle":
            g = self._PG.from_stage_lengths(job.app, [[(c.input_len, c.output_len) for c in st] for st in job.stages])
            i, o = g.total_tokens()
            return StageInfo(sub_deadline(g, s, t0, d, time_model=self.tm), remaining_time(g, s, time_model=self.tm),
                             i + o)
        t_0 = time.perf_counter()
        m = self.matchers[job.app].match(self._partial(job, s), bump=False)
        self.match_ms.append((time.perf_counter() - t_0) * 1e3)
        if m is None:
            typ = self.typical.get(job.app, len(job.stages))
            return StageInfo(sub_deadline(None, s, t0, d, expected_stages=typ, time_model=self.tm),
                             self.mean_stage_time.get(job.app, 0.0) * max(0, typ - s - 1), None)
        i, o = m.graph.total_tokens()
        return StageInfo(sub_deadline(m, s, t0, d, time_model=self.tm), remaining_time(m, s, time_model=self.tm),
                         i + o)
