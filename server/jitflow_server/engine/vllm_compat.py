"""What the scheduler plug-in needs from vLLM's ``Scheduler``, checked when the plug-in starts.

The plug-in overrides and reads vLLM internals (``v1/core/sched/scheduler.py``); a vLLM release that
renames one of them would break it silently. :func:`missing_vllm_internals` names what is missing, the
plug-in refuses to start without it, and a unit test checks the installed vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

#: vLLM versions the plug-in was tested with; others are checked against :data:`VLLM_INTERNALS`.
TESTED_VLLM = ("0.32.0",)
#: ``Scheduler`` methods the plug-in calls or overrides, and instance attributes it reads or sets.
#: A vLLM without one of them cannot run the plug-in (checked when the scheduler is built).
VLLM_METHODS = ("_preempt_request", "_is_blocked_waiting_status", "update_from_output", "finish_requests",
                "add_request", "schedule", "get_num_unfinished_requests", "pause_state")
VLLM_ATTRIBUTES = ("max_num_running_reqs", "max_num_active_reqs", "max_num_scheduled_tokens", "running", "waiting",
                   "requests", "block_size", "cache_config", "vllm_config")


def missing_vllm_internals(sched: object | type = Scheduler) -> list[str]:
    """Names of :data:`VLLM_METHODS` (and, for an instance, :data:`VLLM_ATTRIBUTES`) that ``sched``
    (a ``Scheduler`` class or instance) lacks."""
    names = VLLM_METHODS + (() if isinstance(sched, type) else VLLM_ATTRIBUTES)
    return [n for n in names if not hasattr(sched, n)]


#: The policy of a plug-in started without ``additional_config["jitflow"]["policy"]`` (e.g. plain
#: ``vllm serve MODEL --scheduler-cls jitflow_server.engine.plugin.JitflowScheduler``).
DEFAULT_POLICY = "gmax"


def plugin_settings(vllm_config: Any, max_num_seqs: int) -> tuple[str, dict, int]:
    """``(policy, params, B)`` of the plug-in from vLLM's config: ``additional_config["jitflow"]``'s
    ``policy`` (default :data:`DEFAULT_POLICY`), ``params`` and ``batch_size`` (default ``max_num_seqs``).

    Raises:
        RuntimeError: vLLM runs with async scheduling, which plans a step before the previous step's
            output is known; the message names ``--no-async-scheduling``.
    """
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        raise RuntimeError(
            "the jitflow plug-in schedules each step from the last one's output, which vLLM's async "
            "scheduling runs ahead of: start vLLM with --no-async-scheduling (vLLM turns it off itself "
            "on CPU)")
    cfg = dict((vllm_config.additional_config or {}).get("jitflow", {}))
    return str(cfg.get("policy", DEFAULT_POLICY)), dict(cfg.get("params") or {}), int(
        cfg.get("batch_size") or max_num_seqs)
