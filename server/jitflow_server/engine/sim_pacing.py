"""The simulator's side of a policy's per-step prefill pacing (``scheduler/prefill_budget.py``).

The same rules the vLLM plug-in applies to ``vllm.v1.request.Request`` objects
(``JitflowScheduler._pace``), applied to the simulator's calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from jitflow_server.scheduler.prefill_budget import min_decode_slack, prefill_token_budget, prefills_to_defer
from jitflow_server.scheduler.types import Kind

if TYPE_CHECKING:
    from jitflow_server.engine.sim import _Call


def decoding(c: _Call) -> bool:
    """True once the call's prompt (or its recomputation after a preemption) is in the KV cache."""
    return c.generated > 0 and c.computed >= c.input_len + c.generated - 1


def paced_select(run_sel: list[_Call], hidden: list[_Call], wait_sel: list[_Call], rank: dict[str, int],
                 deferred_for: set[str]) -> tuple[list[_Call], list[_Call], set[str]]:
    """``(run_sel, hidden, deferred_for)`` with the running prompts ranked below a waiting latency call moved to
    ``hidden`` for this step (:func:`~jitflow_server.scheduler.prefill_budget.prefills_to_defer`). Latency calls
    in ``deferred_for`` (those the last step deferred prompts for) that still wait could not be admitted (KV
    cache): no prompt is deferred for them again. The returned set is the next step's ``deferred_for``."""
    latency = {c.rid for c in wait_sel if c.view.kind is Kind.LATENCY}
    defer = prefills_to_defer(rank, [c.rid for c in run_sel if not decoding(c)], latency - deferred_for)
    if not defer:
        return run_sel, hidden, set()
    return [c for c in run_sel if c.rid not in defer], hidden + [c for c in run_sel if c.rid in defer], latency


def paced_budget(run_sel: list[_Call], wait_sel: list[_Call], now: float, step_time: Callable[[int, int], float],
                 budget: int) -> tuple[list[_Call], int]:
    """``(run_sel with decodes first, token budget)`` of one step
    (:func:`~jitflow_server.scheduler.prefill_budget.prefill_token_budget`); ``budget`` unchanged when
    nothing waits for prefill."""
    dec = [c for c in run_sel if decoding(c)]
    if not wait_sel and len(dec) == len(run_sel):
        return run_sel, budget
    slack = min_decode_slack(((c.view.arrival, c.view.ttft, c.view.tbt, c.generated) for c in dec
                              if c.view.kind is Kind.LATENCY), now)
    return dec + [c for c in run_sel if not decoding(c)], prefill_token_budget(slack, len(dec), step_time, budget)
