"""Progress of the long benchmark commands (``bench sim``, ``bench tune``): rich's bar on a terminal, one
plain line per step anywhere else.

rich draws nothing when its output is not a terminal, so a run logged to a file, piped, or run by CI
showed no sign of life until it ended (up to an hour for ``bench sim``). :func:`step_progress` keeps the
bar on a terminal and otherwise prints ``[k/N] description (elapsed s)`` to stderr, one line per step.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


class LineProgress:
    """The part of :class:`rich.progress.Progress` the benchmark runners call (``add_task``, ``update``,
    ``task_ids``), printing one line per update to ``file`` (stderr by default): ``[k/N] description
    (elapsed s)``; the runners advance before each step, so the line names the k-th of N steps as it
    starts, with the seconds since the display started. One task only."""

    def __init__(self, file: TextIO | None = None) -> None:
        self.file = file if file is not None else sys.stderr
        self.task_ids: list[int] = []
        self.total: float | None = None
        self.completed = 0.0
        self.t0 = time.monotonic()

    def __enter__(self) -> LineProgress:
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None) -> int:
        """Start the one task (``total`` steps); returns its id (0)."""
        self.task_ids = [0]
        self.total = total
        self.completed = 0.0
        return 0

    def update(self, task_id: int, advance: float = 0.0, description: str | None = None) -> None:
        """Count ``advance`` steps and print the line of the step ``description`` names."""
        self.completed += advance
        total = "?" if self.total is None else f"{self.total:g}"
        print(f"[{self.completed:g}/{total}] {description or ''} ({time.monotonic() - self.t0:.0f} s)",
              file=self.file, flush=True)


def step_progress(total: int, description: str, width: int = 28) -> Progress | LineProgress:
    """A progress display of ``total`` steps, started with ``description``: rich's transient bar when
    stdout is a terminal, else :class:`LineProgress` on stderr. Use it as a context manager; the runners
    call ``update(task_ids[0], advance=1, description=...)`` once per step."""
    if Console().is_terminal:
        prog: Progress | LineProgress = Progress(
            TextColumn(f"{{task.description:<{width}}}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(), transient=True)
    else:
        prog = LineProgress()
    prog.add_task(description, total=total)
    return prog
