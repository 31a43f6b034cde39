"""What the scheduler plug-in needs from vLLM's ``Scheduler``, checked when the plug-in starts.

The plug-in overrides and reads vLLM internals (``v1/core/sched/scheduler.py``); a vLLM release that
renames one of them would break it silently. :func:`missing_vllm_internals` names what is missing, the
plug-in refuses to start without it, and a unit test checks the installed vLLM.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

#: vLLM versions the plug-in was tested with; others are checked against :data:`VLLM_INTERNALS`.
TESTED_VLLM = ("0.32.0",)
#: ``Scheduler`` methods the plug-in calls or overrides, and instance attributes it reads or sets.
#: A vLLM without one of them cannot run the plug-in (checked when the scheduler is built).
VLLM_METHODS = ("_preempt_request", "_is_blocked_waiting_status", "update_from_output", "finish_requests",
                "add_request", "schedule", "get_num_unfinished_requests", "pause_state")
VLLM_ATTRIBUTES = ("max_num_running_reqs", "max_num_active_reqs", "running", "waiting", "requests",
                   "block_size", "cache_config", "vllm_config")


def missing_vllm_internals(sched: object | type = Scheduler) -> list[str]:
    """Names of :data:`VLLM_METHODS` (and, for an instance, :data:`VLLM_ATTRIBUTES`) that ``sched``
    (a ``Scheduler`` class or instance) lacks."""
    names = VLLM_METHODS + (() if isinstance(sched, type) else VLLM_ATTRIBUTES)
    return [n for n in names if not hasattr(sched, n)]
