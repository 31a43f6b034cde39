"""Compound-task API (``/v1/tasks``): filled in by the compound-task work (issue 5)."""

from __future__ import annotations


async def attach_tasks(app, state) -> None:
    """Attach the task routes and a ``TaskManager`` to ``state`` (no-op until implemented)."""
