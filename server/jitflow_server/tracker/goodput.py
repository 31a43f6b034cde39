"""Goodput and SLO attainment of one finished request (JITServe §3).

Pure functions over measured token times, shared by the HTTP API (the ``slo_met``
field of every response), the benchmarks and the simulator.

Definitions (times in seconds, lengths in tokens):

- ``latency``: token *i* (1-based) is on time if emitted by ``arrival + ttft + (i-1)·tbt``;
  token goodput = number of on-time tokens; the SLO is met when every token is on time.
- ``deadline``: goodput = input + output tokens if the last token arrives by
  ``arrival + deadline``, else 0.
- ``compound``: the same rule applied to the whole task (the task's final call must end
  by the task deadline); a single call's ``slo_met`` is judged against its task deadline.
- ``best_effort``: no SLO; every token counts as goodput and ``slo_met`` is ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jitflow_server.scheduler.types import SLOSpec


@dataclass(frozen=True)
class GoodputResult:
    """Outcome of one request: ``slo_met`` (None for best-effort) and token goodput (tokens)."""

    slo_met: bool | None
    token_goodput: int
    on_time_tokens: int


def on_time_tokens(arrival: float, token_times: Sequence[float], ttft: float, tbt: float) -> int:
    """Count tokens emitted by their latency-SLO timeline ``arrival + ttft + (i-1)·tbt`` (JITServe §3)."""
    n = 0
    for i, t in enumerate(token_times):
        if t <= arrival + ttft + i * tbt + 1e-9:
            n += 1
    return n


def evaluate(
    slo: SLOSpec,
    arrival: float,
    token_times: Sequence[float],
    input_tokens: int,
    *,
    finished_ok: bool = True,
) -> GoodputResult:
    """Goodput of a finished request from its measured token emission times.

    Args:
        slo: the request's SLO.
        arrival: arrival time (s, same clock as ``token_times``).
        token_times: emission time of each output token, in order (s).
        input_tokens: prompt length (tokens).
        finished_ok: False if the request was aborted or failed (no goodput for deadline kinds).

    Returns:
        ``GoodputResult``; ``slo_met`` is ``None`` for best-effort requests.
    """
    n_out = len(token_times)
    if slo.kind == "latency":
        assert slo.ttft is not None and slo.tbt is not None
        ok = on_time_tokens(arrival, token_times, slo.ttft, slo.tbt)
        met = finished_ok and n_out > 0 and ok == n_out
        return GoodputResult(met, ok, ok)
    if slo.kind in ("deadline", "compound"):
        if slo.deadline is None:  # compound call judged at task level only
            return GoodputResult(None, input_tokens + n_out if finished_ok else 0, n_out)
        met = finished_ok and n_out > 0 and token_times[-1] <= arrival + slo.deadline + 1e-9
        return GoodputResult(met, (input_tokens + n_out) if met else 0, n_out if met else 0)
    return GoodputResult(None, n_out if finished_ok else 0, n_out)
