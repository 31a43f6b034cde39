"""Per-step prefill budget: spend the slack of decoding latency requests, never more.

An engine step runs the decodes of the batch together with up to ``max_num_batched_tokens`` prompt
tokens (chunked prefill). On a GPU a 2,048-token chunk adds milliseconds; on a CPU it adds more than a
second (demo model, 2-core AVX-512: about 0.7 ms per prompt token), and every request decoding in that
step waits for it. A chat request's SLO is a timeline (token *i* due by ``arrival + TTFT + (i-1)·TBT``,
JITServe §3), so a few such steps in a row put its tokens past due even when its average pace is well
inside the TBT SLO: on the demo's normal phase, the chat requests that missed averaged 0.09-0.11 s
between tokens against a 0.12 s SLO, and missed because prefill stalls of agent prompts outlasted
their slack.

SLOs-Serve (§4) plans each step's prefill budget from the TBT SLOs of the running decodes. This is
the simplest form of that idea that needs no plan (:func:`prefill_token_budget`): the step's prefill
tokens are capped so the step ends before the next token of every on-time decoding latency request is
due, less a reserve. Slack that a request has built by decoding faster than its TBT is spent on prefill;
a request already past due is not protected (nothing would win it back, and it would throttle every
prompt). A second rule (:func:`prefills_to_defer`) puts a waiting latency request's own prompt ahead of
the running prompts the plan ranks below it, which vLLM would otherwise prefill first.
An option caps every paced step at a share of the smallest TTFT SLO seen (``max_step_s``; GMAX's
``prefill_ttft_share``), for latency requests still to arrive: an engine takes new requests only between
steps. The cap holds only while the engine has room (at most B requests unfinished): under overload
every step's prefill is work the queue is waiting for, and shorter steps would only serve it slower.

The rules are pure functions; :class:`PrefillPacer` applies both to one engine step and keeps the little
state they need between steps. The vLLM plug-in and the simulator each own one pacer and call it every
step, with their own request objects and their own step-time model (``StepTimeTracker.step_time``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

#: ``(arrival s, TTFT SLO s, TBT SLO s, output tokens generated)`` of a latency request: its SLO timeline.
Timeline = tuple[float, float, float, int]

#: Fewest prompt tokens a step may prefill while a prompt waits (one KV block of the demo engine), so
#: prompts always progress. Kept this small on purpose: once a latency request's slack is spent the rule
#: settles on the prefill its TBT leaves room for in every step, and a larger floor would make each step
#: longer than that TBT (64 tokens at 0.7 ms each did, for a 0.08 s TBT on a 0.036 s decode step).
MIN_PREFILL_TOKENS = 16


def next_token_slack(arrival: float, ttft: float, tbt: float, generated: int, now: float) -> float:
    """Seconds until the next output token of a latency request is due on its SLO timeline.

    Token ``generated + 1`` is due at ``arrival + ttft + generated·tbt`` (JITServe §3); the result is
    that time minus ``now`` (negative: already past due). Times in seconds on one clock.
    """
    return arrival + ttft + generated * tbt - now


def min_decode_slack(decodes: Iterable[tuple[float, float, float, int]], now: float) -> float | None:
    """The smallest positive :func:`next_token_slack` (s) over ``(arrival, ttft, tbt, generated)`` of decoding
    latency requests, or ``None`` when none of them is on time (or there is none)."""
    best = None
    for arrival, ttft, tbt, generated in decodes:
        s = next_token_slack(arrival, ttft, tbt, generated, now)
        if s > 0.0 and (best is None or s < best):
            best = s
    return best


def prefill_token_budget(min_slack: float | None, n_decode: int, step_time: Callable[[int, int], float],
                         max_tokens: int, *, reserve_steps: float = 1.0,
                         min_prefill: int = MIN_PREFILL_TOKENS, max_step_s: float | None = None) -> int:
    """Token budget of one engine step (decodes + prefill tokens) under the tightest decode slack.

    Args:
        min_slack: the smallest :func:`next_token_slack` (s) among the step's decoding latency requests
            that are not past due; ``None`` when there is none (the budget is then ``max_tokens``).
        n_decode: requests decoding in the step (one token of budget each).
        step_time: predicted step seconds for ``(n_decode, prefill_tokens)``, linear in the prefill
            tokens (``StepTimeTracker.step_time``).
        max_tokens: the engine's own budget per step (``max_num_batched_tokens``).
        reserve_steps: slack kept back, in decode steps of ``n_decode`` requests, for what the step-time
            model misses (scheduling, output processing, a step slower than predicted).
        min_prefill: prefill tokens allowed however small the slack (:data:`MIN_PREFILL_TOKENS`).
        max_step_s: the longest the step may run (s), whatever the slack; ``None``: no such cap. An engine
            takes new requests only between steps, so a request arriving during a long prefill step waits
            for all of it before any policy can see it.

    Returns:
        Tokens the step may schedule: ``n_decode + min_prefill`` at least, ``max_tokens`` at most.
    """
    if (min_slack is None and max_step_s is None) or max_tokens <= n_decode:
        return max_tokens
    base = step_time(n_decode, 0)
    per_token = (step_time(n_decode, max_tokens) - base) / max_tokens
    usable = min_slack - (1.0 + reserve_steps) * base if min_slack is not None else float("inf")
    if max_step_s is not None:
        usable = min(usable, max_step_s - base)
    if per_token <= 0.0:
        return max_tokens
    prefill = int(usable / per_token) if usable > 0 else 0
    return min(max_tokens, n_decode + max(prefill, min_prefill))


def prefills_to_defer(plan_rank: dict[str, int], running_prefills: Iterable[str],
                      waiting_latency: Iterable[str]) -> set[str]:
    """Running requests still in prefill that sit this step out so a waiting latency request's prompt goes first.

    vLLM fills a step with its running requests before it admits a waiting one, so a long prompt being
    prefilled in chunks takes the whole budget of every step until it is done, whatever the plan's order:
    a chat request arriving behind one waited 2.5-3.2 s for its first token on the demo's normal phase
    (TTFT SLO 2.4 s). Those ranked by the plan (``plan_rank``: request id -> position in
    ``Decision.batch``) below the best-ranked waiting latency request wait one step; they keep their KV
    cache and go on in the next step.

    Returns the ids of ``running_prefills`` to leave out of this step (empty when no waiting latency
    request is in the plan). Callers leave out of ``waiting_latency`` a request they deferred prompts for in
    the previous step that still waits: the engine could not admit it (no free KV cache), and deferring
    again would stall every prompt until it could.
    """
    top = min((plan_rank[r] for r in waiting_latency if r in plan_rank), default=None)
    if top is None:
        return set()
    return {r for r in running_prefills if plan_rank.get(r, top + 1) > top}


@dataclass
class PacedStep(Generic[T]):
    """One engine step after pacing: ``run`` the running requests to schedule (decodes first when the budget
    is cut), ``deferred`` the running prompts that sit this step out (they keep their KV cache), ``budget``
    the step's token budget (decodes + prefill tokens)."""

    run: list[T]
    deferred: list[T]
    budget: int


class PrefillPacer(Generic[T]):
    """Both pacing rules applied to one engine step, for any request type.

    Args:
        rid: the request's id (the key of the plan's ranks).
        decoding: True once the request's prompt (or its recomputation after a preemption) is in the KV
            cache, so the step gives it one token.
        timeline: the request's :data:`Timeline` if it is a latency request, else ``None``.

    Attributes:
        paced_steps: steps whose budget was cut below the engine's.
        deferred_prefills: running prompts deferred, summed over steps.
        min_ttft: the smallest TTFT SLO (s) of the latency requests seen so far (``inf`` before any).
    """

    def __init__(self, rid: Callable[[T], str], decoding: Callable[[T], bool],
                 timeline: Callable[[T], Timeline | None]) -> None:
        self._rid, self._decoding, self._timeline = rid, decoding, timeline
        self._deferred_for: set[str] = set()  # the waiting latency requests the last step deferred prompts for
        self.paced_steps = 0
        self.deferred_prefills = 0
        self.min_ttft = float("inf")  # the smallest TTFT SLO (s) of the latency requests seen so far

    def step(self, run_sel: list[T], wait_sel: list[T], rank: dict[str, int], now: float,
             step_time: Callable[[int, int], float], max_tokens: int, ttft_share: float = 0.0,
             overloaded: bool = False) -> PacedStep[T]:
        """Pace one step.

        Args:
            run_sel: running requests the plan runs, in plan order.
            wait_sel: waiting requests the plan admits, in plan order.
            rank: request id -> position in the plan (``Decision.batch``).
            now: the clock of the timelines (s).
            step_time: predicted step seconds for ``(n_decode, prefill_tokens)``.
            max_tokens: the engine's own token budget per step.
            ttft_share: when > 0, no step runs longer than this share of the smallest TTFT SLO (s) of the
                latency requests seen so far, even with no latency request decoding, so that one still to
                arrive is not held past its TTFT by a long prefill step (``max_step_s`` of
                :func:`prefill_token_budget`).
            overloaded: True when the engine holds more unfinished requests than its batch size B (the
                caller's count: running and waiting); the ``ttft_share`` cap is then not applied.

        Returns:
            A :class:`PacedStep`: :func:`prefills_to_defer` applied (not again for a latency request the last
            step deferred prompts for and that still waits: the engine could not admit it), then
            :func:`prefill_token_budget` under the tightest decoding latency request's slack.
        """
        latency = {self._rid(r) for r in wait_sel if self._timeline(r) is not None}
        dec = [r for r in run_sel if self._decoding(r)]
        prefilling = [r for r in run_sel if not self._decoding(r)]
        defer = prefills_to_defer(rank, [self._rid(r) for r in prefilling], latency - self._deferred_for)
        self._deferred_for = latency if defer else set()
        deferred = [r for r in prefilling if self._rid(r) in defer]
        if defer:
            self.deferred_prefills += len(deferred)
            run_sel = [r for r in run_sel if self._rid(r) not in defer]
            prefilling = [r for r in prefilling if self._rid(r) not in defer]
        if not wait_sel and not prefilling:  # nothing to prefill: nothing to pace
            return PacedStep(run_sel, deferred, max_tokens)
        dec_lines = [t for r in dec if (t := self._timeline(r)) is not None]
        cap = None
        if ttft_share > 0:
            seen = dec_lines + [t for r in wait_sel if (t := self._timeline(r)) is not None]
            self.min_ttft = min((self.min_ttft, *(t[1] for t in seen)))
            if not overloaded and self.min_ttft < float("inf"):
                cap = ttft_share * self.min_ttft
        slack = min_decode_slack(dec_lines, now)
        budget = prefill_token_budget(slack, len(dec), step_time, max_tokens, max_step_s=cap)
        if budget < max_tokens:  # decodes first: the budget holds one token for each of them
            self.paced_steps += 1
            run_sel = dec + prefilling
        return PacedStep(run_sel, deferred, budget)
