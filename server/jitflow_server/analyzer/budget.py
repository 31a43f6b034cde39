"""The analyzer off the request path: pattern matches in one owned thread, within a time budget.

A compound call needs its stage's advice (sub-deadline, task estimates, length bound) before it can be
scheduled, and the advice comes from matching the task's partial pattern graph against history
(:class:`~jitflow_server.analyzer.advisor.CompoundAdvisor`). A match reads SQLite and scores up to
thousands of graphs; run on the event loop, a slow or stuck match would stall every request and
``/health``. :class:`BudgetedAdvisor` runs matches in one thread it owns and waits at most ``budget``
seconds for each: past it, or when ``queue`` matches are already queued or running, or when the match
raises, the call gets :meth:`CompoundAdvisor.fallback` (equal shares over the app's typical stage
count, no length bound) and :attr:`BudgetedAdvisor.stats` counts why. An abandoned match finishes in
the background (a thread cannot be interrupted) and still holds its queue slot until then, so a stuck
matcher costs each call nothing past the first ``queue`` ones.

The matcher and the history store take their own locks, so matches in this thread and history writes
from other threads do not race.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jitflow_server.analyzer.advisor import CompoundAdvisor, StageAdvice

logger = logging.getLogger("jitflow.analyzer")

#: Why a call was served without the analyzer's advice (see the module docstring).
ANALYZER_FALLBACKS = ("timeout", "busy", "error")
#: Default time budget of one match (s) and matches queued or running at once. Measured: a match takes
#: 0.28 ms P50 and 0.6-6 ms P99 at 500 graphs (docs/analyzer.md, "Latency"), so 50 ms is never hit by a
#: healthy matcher and still keeps a stuck one from being felt.
DEFAULT_ANALYZER_BUDGET = 0.05
DEFAULT_ANALYZER_QUEUE = 4


class BudgetedAdvisor:
    """A :class:`CompoundAdvisor` whose matches run in one owned thread within a time budget.

    Args:
        advisor: the advisor whose :meth:`~CompoundAdvisor.advise` runs in the thread.
        budget: the longest a call waits for its match (s, > 0).
        queue: matches queued or running at once (≥ 1).
    Raises ``ValueError`` for a budget that is not a positive finite number or ``queue < 1``.
    :meth:`close` stops the thread; :attr:`stats` counts ``ok`` and each of :data:`ANALYZER_FALLBACKS`.
    """

    def __init__(self, advisor: CompoundAdvisor, budget: float = DEFAULT_ANALYZER_BUDGET,
                 queue: int = DEFAULT_ANALYZER_QUEUE) -> None:
        if not (isinstance(budget, int | float) and math.isfinite(budget) and budget > 0):
            raise ValueError(f"analyzer budget must be a positive number of seconds, got {budget!r}")
        if int(queue) < 1:
            raise ValueError(f"analyzer queue must be >= 1, got {queue!r}")
        self.advisor = advisor
        self.budget = float(budget)
        self.queue = int(queue)
        self.stats: dict[str, int] = {"ok": 0, **{k: 0 for k in ANALYZER_FALLBACKS}}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jitflow-analyzer")
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Matches queued or running now (abandoned ones included until they finish)."""
        return self._pending

    def _release(self, _fut: Any) -> None:
        with self._lock:
            self._pending -= 1

    async def advise(self, app: str, partial, stage_pos: int, t0: float, deadline: float
                     ) -> tuple[StageAdvice, str]:
        """The advice for stage ``stage_pos`` of a task of ``app`` started at ``t0`` (unix s) with deadline
        ``deadline`` (s), and how it was obtained: ``"ok"`` or one of :data:`ANALYZER_FALLBACKS`.
        Never raises for the matcher's failures (they are logged and counted as ``error``)."""
        with self._lock:
            full = self._pending >= self.queue
            if not full:
                self._pending += 1
        if full:
            outcome = "busy"
        else:
            try:
                fut = self._pool.submit(self.advisor.advise, app, partial, stage_pos, t0, deadline)
            except RuntimeError:  # closed
                self._release(None)
                outcome = "error"
            else:
                fut.add_done_callback(self._release)
                try:
                    # shield: the timeout abandons the wait, not the match (it cannot be interrupted)
                    advice = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.budget)
                    self.stats["ok"] += 1
                    return advice, "ok"
                except TimeoutError:
                    outcome = "timeout"
                except Exception:
                    logger.warning("pattern match for app %s failed; serving the fallback advice", app,
                                   exc_info=True)
                    outcome = "error"
        self.stats[outcome] += 1
        return self.advisor.fallback(app, stage_pos, t0, deadline), outcome

    def close(self) -> None:
        """Stop the thread; a running match is abandoned, queued ones are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)
