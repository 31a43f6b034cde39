"""The per-task attained-service ledger the LAS baseline reads (tracker/service.py)."""

from __future__ import annotations

import pytest

from jitflow_server.tracker.service import AttainedService


def test_service_accumulates_per_task():
    led = AttainedService()
    led.add("a", 5)
    led.add("b", 2)
    led.add("a", 7)
    assert (led.get("a"), led.get("b"), led.get("never")) == (12, 2, 0)


def test_least_recently_served_task_is_forgotten_first():
    led = AttainedService(max_tasks=2)
    led.add("old", 100)
    led.add("mid", 10)
    led.add("old", 1)  # served again: now the most recent
    led.add("new", 3)  # over the bound: "mid" is the least recently served
    assert len(led) == 2
    assert (led.get("old"), led.get("mid"), led.get("new")) == (101, 0, 3)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="max_tasks"):
        AttainedService(0)
    with pytest.raises(ValueError, match="tokens"):
        AttainedService().add("a", -1)
