"""Attained service per task: the tokens generated so far for each compound task (program).

Autellix's program-level least attained service (PLAS) ranks an LLM call by the service its whole
program has received, so the engine must remember it across the program's calls, after each call
finishes. The engine never learns when a program ends, so the ledger is bounded: least recently
served tasks are forgotten first (a forgotten task restarts at 0, which only matters for a task
idle longer than ``max_tasks`` other tasks were served).
"""

from __future__ import annotations

from collections import OrderedDict


class AttainedService:
    """Tokens served per task id, least recently served evicted beyond ``max_tasks``.

    ``add(task, tokens)`` records service (tokens ≥ 0); ``get(task)`` returns the total (0 if
    unknown or forgotten); ``len()`` the number of tasks held. Raises ``ValueError`` for
    ``max_tasks < 1`` or negative tokens.
    """

    def __init__(self, max_tasks: int = 65_536) -> None:
        if max_tasks < 1:
            raise ValueError(f"max_tasks must be >= 1, got {max_tasks}")
        self.max_tasks = int(max_tasks)
        self._tokens: OrderedDict[str, int] = OrderedDict()

    def add(self, task: str, tokens: int) -> None:
        """Add ``tokens`` generated for ``task`` and mark it most recently served."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        self._tokens[task] = self._tokens.pop(task, 0) + int(tokens)
        while len(self._tokens) > self.max_tasks:
            self._tokens.popitem(last=False)

    def get(self, task: str) -> int:
        """Tokens served to ``task`` so far (0 if unknown)."""
        return self._tokens.get(task, 0)

    def __len__(self) -> int:
        return len(self._tokens)
