"""The compound advisor: what the analyzer tells the scheduler about one LLM call (JITServe §4.1).

One object, :class:`CompoundAdvisor`, turns a compound task's *partial pattern graph* (its finished
stages with their lengths and the open stage with its inputs) into a :class:`StageAdvice` for the
open stage: the sub-deadline ``T0 + φ(s)·D`` (accumulated share of the best-matching history graph,
``analyzer/subdeadline.py``), the generation time still to come after this stage
(``task_rem_gen_time``), the task's estimated total tokens, and the past output lengths the open
stage's length bound is computed from (``analyzer/stage_length.py``: the same stage of the
``bound_top_k`` most similar history graphs, refined as tokens are generated). The server's task manager (``api/tasks.py``), the benchmarks and the simulator
(through ``bench/``) all call it, so what is measured is what is served.

Modes:

- ``pattern`` (default): match against the app's history (``analyzer/matcher.py``); without a match,
  the fallback below;
- ``oracle``: the task's own finished graph (simulator only: it needs the future);
- ``none``: never match; the fallback (the paper's average-based ablation).

Fallback: equal shares over the app's typical stage count ``φ(s) = (s+1)/S``, the app's mean stage
time × remaining stages, and the app's mean task tokens (each from :class:`AppStats`, absent values
give the whole deadline, 0 s and no estimate).

:func:`resolve_len_bound` holds the one precedence rule between the length bounds a call can have.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from jitflow_server.analyzer.length_calibration import DEFAULT_QUANTILE
from jitflow_server.analyzer.stage_length import (
    STAGE_TOP_K,
    StageCalibrator,
    StageLengthSamples,
    samples_from_match,
)
from jitflow_server.analyzer.subdeadline import (
    DEFAULT_TIME_MODEL,
    CallTimeModel,
    remaining_time,
    sub_deadline,
)

ADVISOR_MODES = ("pattern", "oracle", "none")
#: Where a length bound came from, strongest first (see :func:`resolve_len_bound`).
BOUND_SOURCES = ("exact", "pattern", "predictor", "max_tokens")


def resolve_len_bound(max_tokens: int, *, exact: bool = False, pattern: int | None = None,
                      predicted: int | None = None, generated: int = 0) -> tuple[int, str]:
    """The output-length upper bound (tokens) of a call and its source, by explicit precedence.

    ``exact`` (``ignore_eos``: the call generates exactly ``max_tokens``) > ``pattern`` (the matched
    pattern graphs' stage, :class:`~jitflow_server.analyzer.stage_length.StageLengthSamples`) >
    ``predicted`` (the length predictor or its fallback) > ``max_tokens``. Every source but ``exact`` is
    refined while the call runs (a pattern bound from its samples, the others by the predictor). The result is within
    ``[generated + 1, max_tokens]``. Raises ``ValueError`` if ``max_tokens < 1``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if exact:
        b, src = max_tokens, "exact"
    elif pattern is not None:
        b, src = int(pattern), "pattern"
    elif predicted is not None:
        b, src = int(predicted), "predictor"
    else:
        b, src = max_tokens, "max_tokens"
    return max(min(b, max_tokens), min(generated + 1, max_tokens), 1), src


@dataclass(frozen=True)
class AppStats:
    """Per-app history summaries used when no graph matches (see the module docstring)."""

    typical_stages: Callable[[str], int | None] = lambda app: None
    mean_stage_time: Callable[[str], float] = lambda app: 0.0
    mean_task_tokens: Callable[[str], int | None] = lambda app: None


@dataclass(frozen=True)
class StageAdvice:
    """Advice for the open stage of a compound task.

    ``sub_deadline``: absolute time on the clock of the task start ``t0`` (s); ``task_rem_gen_time``:
    estimated time of the later stages (s, :func:`remaining_time`); ``task_tokens_est``: estimated input +
    output tokens of the whole task (``None``: unknown); ``len_bound``: bound from the matched stage's
    outputs at 0 generated tokens (tokens, ``None``: no match), not yet capped by ``max_tokens``;
    ``matched``: summary of the match (graph id, score, stage count, candidates, match time in ms) or
    ``None``; ``len_samples``: the past lengths the bound is computed from at any generated count
    (``None``: no match).
    """

    sub_deadline: float
    task_rem_gen_time: float
    task_tokens_est: int | None
    len_bound: int | None = None
    matched: dict[str, Any] | None = field(default=None)
    len_samples: StageLengthSamples | None = None


class CompoundAdvisor:
    """Sub-deadlines, task estimates and stage length bounds of compound calls (module docstring).

    Args:
        mode: one of :data:`ADVISOR_MODES`.
        matcher_for: the matcher of an app (``None``: no history for it); used in ``pattern`` mode.
        time_model: call-time model of the sub-deadline shares and the later stages' time (the served engine's speed).
        stats: fallback summaries per app.
        bound_top_k: history graphs whose same-stage outputs bound the call (:data:`STAGE_TOP_K`).
        quantile: coverage q of the stage bounds.
    The sub-deadline uses the matcher's own ``top_k`` neighbours (the best graph by default) whatever
    ``bound_top_k`` is. :attr:`stage_calibrator` calibrates served stage bounds online.
    Raises ``ValueError`` for an unknown mode or ``bound_top_k < 1``.
    """

    def __init__(self, mode: str = "pattern", *, matcher_for: Callable[[str], Any] | None = None,
                 time_model: CallTimeModel = DEFAULT_TIME_MODEL, stats: AppStats | None = None,
                 bound_top_k: int = STAGE_TOP_K, quantile: float = DEFAULT_QUANTILE) -> None:
        if mode not in ADVISOR_MODES:
            raise ValueError(f"advisor mode must be one of {ADVISOR_MODES}, got {mode!r}")
        if bound_top_k < 1:
            raise ValueError("bound_top_k must be >= 1")
        self.bound_top_k = int(bound_top_k)
        self.quantile = float(quantile)
        self.stage_calibrator = StageCalibrator(quantile)
        self.mode = mode
        self.matcher_for = matcher_for or (lambda app: None)
        self.time_model = time_model
        self.stats = stats or AppStats()
        #: wall-clock ms of every match (diagnostics; the benchmarks report its median)
        self.match_ms: list[float] = []

    def fallback(self, app: str, stage_pos: int, t0: float, deadline: float) -> StageAdvice:
        """Advice without a matched graph (equal shares over the app's typical stage count)."""
        typ = self.stats.typical_stages(app)
        sd = sub_deadline(None, stage_pos, t0, deadline, expected_stages=typ, time_model=self.time_model)
        rem = self.stats.mean_stage_time(app) * max(0, (typ or 0) - stage_pos - 1)
        tokens = self.stats.mean_task_tokens(app) if self.mode == "none" else None
        return StageAdvice(sd, rem, tokens)

    def advise(self, app: str, partial, stage_pos: int, t0: float, deadline: float, *,
               own_graph=None) -> StageAdvice:
        """Advice for stage ``stage_pos`` (0-based position among the task's stages) of a task of ``app``
        started at ``t0`` with deadline ``deadline`` (s). ``partial`` is the task's partial pattern
        graph (``None``: nothing known yet); ``own_graph`` the finished graph (``oracle`` mode only).
        Raises ``ValueError`` in ``oracle`` mode without ``own_graph``.
        """
        if self.mode == "none":
            return self.fallback(app, stage_pos, t0, deadline)
        if self.mode == "oracle":
            if own_graph is None:
                raise ValueError("oracle advice needs the task's own graph")
            i, o = own_graph.total_tokens()
            return StageAdvice(sub_deadline(own_graph, stage_pos, t0, deadline, time_model=self.time_model),
                               remaining_time(own_graph, stage_pos, time_model=self.time_model), i + o)
        matcher = self.matcher_for(app)
        match = None
        t_0 = time.perf_counter()
        if matcher is not None and partial is not None:
            try:
                match = matcher.match(partial, bump=False,
                                      top_k=max(self.bound_top_k, getattr(matcher, "top_k", 1)))
            except ValueError:  # a partial graph the matcher cannot read: no match
                match = None
        ms = (time.perf_counter() - t_0) * 1e3
        if matcher is not None:
            self.match_ms.append(ms)
        if match is None:
            return self.fallback(app, stage_pos, t0, deadline)
        g = match.graph
        i, o = g.total_tokens()
        pool = matcher.stage_outputs(app, stage_pos) if hasattr(matcher, "stage_outputs") else ()
        samples = samples_from_match(match, stage_pos, pool, self.quantile)
        # sub-deadlines from the matcher's own neighbours only (the best graph unless it ensembles)
        timing_match = replace(match, neighbours=match.neighbours[: getattr(matcher, "top_k", 1)])
        matched = {"graph_id": match.graph_id, "score": round(float(match.score), 4), "n_stages": g.n_stages,
                   "task_tokens": int(i + o), "n_candidates": match.n_candidates, "match_ms": round(ms, 3)}
        return StageAdvice(sub_deadline(timing_match, stage_pos, t0, deadline, time_model=self.time_model),
                           remaining_time(timing_match, stage_pos, time_model=self.time_model), i + o,
                           samples.bound(0), matched, samples)
