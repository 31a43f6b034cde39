"""Length bounds of compound-task stages from pattern history, refined as tokens are generated.

JITServe §4.1 bounds a compound call by the matched pattern graph's stage. One matched graph is a
sample of one: its stage's outputs covered 0.70 of the deep-research calls at 1.2× headroom. This module
pools the same-stage LLM output lengths of the ``top_k`` (16) most similar history graphs
(:attr:`Match.neighbours`) and bounds a call after ``k`` generated tokens by the q-quantile of the
pooled lengths that exceed ``k`` (survival conditioning: the call is known to be longer than ``k``);
with fewer than ``min_samples`` (10) such lengths it uses the app's pool of the same stage index over
the whole history. An online calibrator per (app, stage) scales the served bound like the single-call
calibrator does (adaptive conformal inference).

:class:`StageLengthSamples` is plain data (it crosses from the analyzer to the serving layer and the
simulator); :func:`evaluate_stage_bounds` is the evaluation behind ``jitflow analyzer eval-length
--stages``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jitflow_server.analyzer.length_calibration import DEFAULT_QUANTILE, OnlineCalibrator

#: Neighbour graphs whose same-stage outputs are pooled.
STAGE_TOP_K = 16
#: Fewest pooled lengths above ``k`` before the app-wide stage pool is used instead.
MIN_STAGE_SAMPLES = 10
#: k at which the stage bounds are evaluated (generated tokens).
STAGE_EVAL_KS: tuple[int, ...] = (0, 50, 100, 200, 400)


@dataclass(frozen=True)
class StageLengthSamples:
    """Past output lengths (tokens) a compound call's bound is computed from.

    ``neighbours``: same-stage LLM output lengths of the matched history graphs, sorted ascending; ``pool``:
    all history outputs of this app's stage, sorted ascending (:meth:`bound` bisects both); ``quantile``: q; ``stage``: the stage index, the
    calibration group.
    """

    neighbours: tuple[int, ...]
    pool: tuple[int, ...]
    quantile: float = DEFAULT_QUANTILE
    stage: int = 0
    min_samples: int = MIN_STAGE_SAMPLES

    def bound(self, k: int = 0) -> int | None:
        """q-quantile of the neighbours' lengths above ``k`` (the pool's when fewer than ``min_samples``),
        never below ``k + 1``; ``None`` when neither has a length above ``k``. Tokens."""
        for src in (self.neighbours, self.pool):
            lo = bisect.bisect_right(src, k)
            m = len(src) - lo
            if m >= self.min_samples or (src is self.pool and m):
                return max(int(math.ceil(sorted_quantile(src, lo, self.quantile))), k + 1)
        return None


def sorted_quantile(xs: Sequence[float], lo: int, q: float) -> float:
    """``np.quantile(xs[lo:], q)`` (numpy's default "linear" method, the same float operations) of the
    sorted ``xs``, without copying. Why not numpy: a call of ``np.quantile`` costs about 100 µs on these
    few hundred lengths and the simulator bounds compound calls 26 000 times per 3 000 requests (3 s of
    a 27 s run); this costs about 1 µs."""
    m = len(xs) - lo
    h = (m - 1) * q
    i = math.floor(h)
    if i >= m - 1:
        return float(xs[-1])
    gamma = h - i
    a, b = float(xs[lo + i]), float(xs[lo + i + 1])
    d = b - a
    return b - d * (1 - gamma) if gamma >= 0.5 else a + d * gamma


def stage_pools(graphs: Sequence[Any]) -> dict[tuple[str, int], tuple[int, ...]]:
    """``{(app, stage index): sorted LLM output lengths}`` over ``graphs`` (as
    :meth:`Matcher.stage_outputs` computes per app)."""
    pools: dict[tuple[str, int], list[int]] = {}
    for g in graphs:
        for n in g.nodes:
            if n.kind == "llm" and n.output_len:
                pools.setdefault((g.app, int(n.stage)), []).append(int(n.output_len))
    return {k: tuple(sorted(v)) for k, v in pools.items()}


def samples_from_match(match: Any, stage: int, pool: Sequence[int],
                       quantile: float = DEFAULT_QUANTILE) -> StageLengthSamples:
    """:class:`StageLengthSamples` of stage index ``stage`` from a :class:`Match` (its neighbours, or the
    best graph alone) and the app's pool for the stage (sorted lengths, tokens)."""
    graphs = [g for g, _, _ in match.neighbours] if match.neighbours else [match.graph]
    outs = sorted(int(n.output_len) for g in graphs for n in g.nodes
                  if n.stage == stage and n.kind == "llm" and n.output_len)
    return StageLengthSamples(tuple(outs), tuple(pool), quantile, int(stage))


class StageCalibrator:
    """Online calibration of stage bounds per (app, stage index, k-bucket): an :class:`OnlineCalibrator`
    with the stage in its model field (plain log offsets: a stage bound has no spread). Thread-safe."""

    def __init__(self, quantile: float = DEFAULT_QUANTILE, step: float = 0.05) -> None:
        self._cal = OnlineCalibrator(quantile, step=step)

    def apply(self, app: str | None, stage: int, k: int, raw: int) -> int:
        """Calibrated bound (tokens, >= k + 1) of a raw stage bound issued after ``k`` tokens."""
        return max(int(math.ceil(raw * self._cal.factor(app, f"stage{stage}", k, kind="compound"))), k + 1)

    def observe(self, app: str | None, stage: int, issued: Sequence[tuple[int, int]], true_len: int) -> None:
        """A call finished with ``true_len`` tokens; ``issued`` are its (k, bound) pairs in issue order
        (:meth:`OnlineCalibrator.observe`)."""
        self._cal.observe(app, f"stage{stage}", issued, true_len, kind="compound")


def _summ(y: list[float], b: list[float]) -> dict[str, float]:
    ya, ba = np.asarray(y, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if not len(ya):
        return {"n": 0}
    r = ba / np.maximum(ya, 1.0)
    return {"n": int(len(ya)), "coverage": float(np.mean(ya <= ba)), "median_ratio": float(np.median(r)),
            "p90_ratio": float(np.percentile(r, 90)),
            "over_reservation": float(np.sum(np.maximum(ba - ya, 0.0)) / max(float(np.sum(ya)), 1.0))}


def evaluate_stage_bounds(graphs: Sequence[Any], quantile: float = DEFAULT_QUANTILE, folds: int = 2, seed: int = 0,
                          top_k: int = STAGE_TOP_K, ks: Sequence[int] = STAGE_EVAL_KS,
                          warmup: int = 100) -> dict[str, Any]:
    """Stage bounds of compound tasks, cross-fitted by task: every task's calls are bounded from the
    history of the other folds (``Matcher.from_graphs(history, top_k=top_k)``, matched on the task's
    finished stages as the server matches).

    Methods: ``previous`` (1.2 × the longest same-stage output of the single best match + 1, never
    refined: the bound at k is max(bound, k + 1)), ``empirical`` (q-quantile of the history's same-stage
    outputs above k), ``knn`` (:class:`StageLengthSamples`), ``knn_calibrated`` (with
    :class:`StageCalibrator`; tasks streamed in order, each call scored before its length is revealed,
    counted after ``warmup`` calls). Per method and k: n, coverage, median / P90 bound/true and
    over-reservation, over the calls still running at k. Raises ``ValueError`` for fewer than ``2·folds``
    graphs.
    """
    from jitflow_server.analyzer.matcher import Matcher

    if len(graphs) < 2 * folds:
        raise ValueError(f"need at least {2 * folds} task graphs, got {len(graphs)}")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(graphs))
    fold_of = {int(t): i % folds for i, t in enumerate(perm)}
    rec: dict[str, dict[int, tuple[list[float], list[float]]]] = {
        m: {k: ([], []) for k in ks} for m in ("previous", "empirical", "knn", "knn_calibrated")}
    cal = StageCalibrator(quantile)
    fallback = 1024  # tokens: the bound without any history length above k (the deep-research trace's cap)
    n_calls = 0
    for f in range(folds):
        hist = [g for t, g in enumerate(graphs) if fold_of[t] != f]
        test = [g for t, g in enumerate(graphs) if fold_of[t] == f]
        matcher = Matcher.from_graphs(hist, top_k=top_k)
        pools = stage_pools(hist)
        for g in test:
            for s in range(g.n_stages):
                calls = [n for n in g.nodes if n.stage == s and n.kind == "llm" and n.output_len]
                if not calls:
                    continue
                empirical = StageLengthSamples((), pools.get((g.app, s), ()), quantile, s)
                m = matcher.match(g.prefix(s, open_next=True), bump=False)
                if m is not None:
                    samples = samples_from_match(m, s, empirical.pool, quantile)
                    best = [n.output_len for n in m.graph.nodes if n.stage == s and n.kind == "llm" and n.output_len]
                    prev0 = int(math.ceil(1.2 * max(best)) + 1) if best else None
                else:
                    samples, prev0 = empirical, None
                for n in calls:
                    y = int(n.output_len)
                    issued = []
                    for k in ks:
                        if y <= k:
                            continue
                        raw = samples.bound(k)
                        emp = empirical.bound(k)
                        vals = {"previous": max(prev0 or fallback, k + 1), "empirical": emp or fallback,
                                "knn": raw or fallback}
                        vals["knn_calibrated"] = cal.apply(g.app, s, k, raw or fallback)
                        issued.append((k, vals["knn_calibrated"]))
                        for name, b in vals.items():
                            if name == "knn_calibrated" and n_calls < warmup:
                                continue
                            rec[name][k][0].append(y)
                            rec[name][k][1].append(b)
                    cal.observe(g.app, s, issued, y)
                    n_calls += 1
    return {"quantile": quantile, "folds": folds, "top_k": top_k, "n_tasks": len(graphs), "n_calls": n_calls,
            "warmup": warmup,
            "methods": {m: {str(k): _summ(*rec[m][k]) for k in ks} for m in rec}}


STAGE_METHOD_NAMES = {"previous": "best match's stage × 1.2 (previous, not refined)",
                      "empirical": "history q-quantile of the stage",
                      "knn": f"{STAGE_TOP_K} neighbours' stage outputs > k (uncalibrated)",
                      "knn_calibrated": f"{STAGE_TOP_K} neighbours' stage outputs > k, calibrated (served)"}


def render_stage_markdown(res: dict[str, Any]) -> str:
    """Markdown table of an :func:`evaluate_stage_bounds` result."""
    lines = [f"{res['n_tasks']} tasks, {res['n_calls']} LLM calls, {res['folds']}-fold task-disjoint "
             f"cross-fitting, q = {res['quantile']}; calibrated counted after {res['warmup']} calls.", "",
             "| method | k | n | coverage | median bound/true | P90 bound/true | over-reservation |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for m, by_k in res["methods"].items():
        for k, s in by_k.items():
            if s.get("n"):
                lines.append(f"| {STAGE_METHOD_NAMES[m]} | {k} | {s['n']} | {s['coverage']:.3f} | "
                             f"{s['median_ratio']:.2f} | {s['p90_ratio']:.2f} | {s['over_reservation']:.2f} |")
    return "\n".join(lines)
