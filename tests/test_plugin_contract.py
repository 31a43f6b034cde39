"""The vLLM plug-in's side of the contracts, without starting an engine: the vLLM internals it relies
on exist in the installed vLLM, and a request's hints land on the engine's monotonic clock."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from jitflow_server.engine import plugin, vllm_compat  # noqa: E402
from jitflow_server.engine.protocol import EngineCall  # noqa: E402
from jitflow_server.scheduler import Kind  # noqa: E402
from jitflow_server.scheduler.hints import SchedHints  # noqa: E402


def test_installed_vllm_has_every_scheduler_internal_the_plugin_uses():
    assert vllm_compat.missing_vllm_internals() == []


def test_missing_internals_are_reported_by_name():
    class Stripped:
        def schedule(self): ...

    assert "_preempt_request" in vllm_compat.missing_vllm_internals(Stripped)
    assert "schedule" not in vllm_compat.missing_vllm_internals(Stripped)
    assert "max_num_running_reqs" in vllm_compat.missing_vllm_internals(Stripped())


def test_control_method_is_installed_on_engine_core():
    from vllm.v1.engine.core import EngineCore

    assert callable(getattr(EngineCore, plugin.CONTROL_METHOD))
    assert {c.value for c in EngineCall} >= {"stats", "update", "reject_waiting", "set_policy"}


def _request(hints: SchedHints | None, arrival: float) -> Request:
    sp = SamplingParams(max_tokens=8, extra_args=hints.to_extra_args() if hints else None)
    return Request("engine-1", [1, 2, 3], sp, None, arrival_time=arrival)


def test_hints_map_onto_the_monotonic_clock_relative_to_front_end_arrival():
    unix_now, mono_now = time.time(), time.monotonic()
    h = SchedHints(kind=Kind.COMPOUND, request_id="chatcmpl-x", arrival=unix_now - 2.0, deadline=10.0,
                   sub_deadline=4.0, waiting_time=5.0, task_id="t1", stage_index=1, len_bound=77)
    m = plugin.RequestMeta(_request(h, unix_now), h, mono_now, unix_now)
    assert m.front_id == "chatcmpl-x" and m.kind is Kind.COMPOUND and m.task == "t1" and m.stage == 1
    assert m.arrival == pytest.approx(mono_now - 2.0)
    assert m.deadline == pytest.approx(mono_now + 8.0)
    assert m.sub_deadline == pytest.approx(mono_now + 2.0)
    assert m.len_bound == 77 and m.waiting_time == 5.0


def test_request_without_hints_is_best_effort_from_its_engine_arrival():
    unix_now, mono_now = time.time(), time.monotonic()
    m = plugin.RequestMeta(_request(None, unix_now - 1.0), None, mono_now, unix_now)
    assert m.kind is Kind.BEST_EFFORT and m.front_id == "engine-1" and m.len_bound is None
    assert m.arrival == pytest.approx(mono_now - 1.0)


def test_scheduler_sets_every_instance_attribute_the_plugin_reads():
    """The instance attributes are set in ``Scheduler.__init__`` (checked on its source, no engine needed)."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    src = inspect.getsource(Scheduler.__init__)
    assert [a for a in vllm_compat.VLLM_ATTRIBUTES if f"self.{a}" not in src] == []


def test_plain_vllm_serve_runs_gmax_and_async_scheduling_is_refused_naming_the_flag():
    from types import SimpleNamespace

    def config(async_scheduling: bool, extra: dict | None = None):
        return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
                               additional_config=extra)

    assert vllm_compat.plugin_settings(config(False), 256) == ("gmax", {}, 256)  # `vllm serve --scheduler-cls` alone
    given = {"jitflow": {"policy": "edf", "params": {"delta_steps": 5}, "batch_size": 16}}
    assert vllm_compat.plugin_settings(config(False, given), 256) == ("edf", {"delta_steps": 5}, 16)
    with pytest.raises(RuntimeError, match="--no-async-scheduling"):
        vllm_compat.plugin_settings(config(True), 256)
