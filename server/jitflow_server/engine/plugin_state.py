"""What the vLLM scheduler plug-in keeps per request, its counters, and the dump of its last frame
(diagnostics).

Kept apart from ``engine/plugin.py`` so that module stays about enforcing the policy's batch.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.request import Request

from jitflow_server.scheduler.hints import SchedHints
from jitflow_server.scheduler.lifecycle import Lifecycle
from jitflow_server.scheduler.types import Decision, RequestView


class RequestMeta:
    """What the plug-in keeps per engine request: its hints on the engine's monotonic clock."""

    __slots__ = ("front_id", "kind", "arrival", "ttft", "tbt", "deadline", "sub_deadline", "waiting_time",
                 "task", "stage", "len_bound", "task_tokens_est", "task_rem_gen_time", "life")

    def __init__(self, req: Request, hints: SchedHints | None, mono_now: float, unix_now: float) -> None:
        h = hints or SchedHints()
        self.front_id = h.request_id or req.request_id
        self.kind = h.kind
        arrival_unix = h.arrival if h.arrival is not None else float(req.arrival_time)
        self.arrival = mono_now - max(0.0, unix_now - arrival_unix)
        self.ttft = h.ttft
        self.tbt = h.tbt
        self.deadline = self.arrival + h.deadline if h.deadline is not None else None
        self.sub_deadline = self.arrival + h.sub_deadline if h.sub_deadline is not None else None
        self.waiting_time = h.waiting_time
        self.task = h.task_id
        self.stage = h.stage_index
        self.len_bound = h.len_bound
        self.task_tokens_est = h.task_tokens_est
        self.task_rem_gen_time = h.task_rem_gen_time
        self.life = Lifecycle(self.arrival)


def plan_dump(last_plan: tuple[float, list[RequestView], Decision] | None) -> dict:
    """The last frame: ``{"time": unix s, "batch": [ids], "preempt": [ids], "requests": [{id, kind,
    running, in_batch, priority, generated, len_bound, input_len, arrival, admit_by, deadline,
    sub_deadline, task}, ...]}`` with every time in unix seconds (diagnostics; ``{}`` before the first
    frame or under fcfs)."""
    if last_plan is None:
        return {}
    t, views, d = last_plan
    off = time.time() - time.monotonic()

    def unix(x: float | None) -> float | None:
        return None if x is None else x + off

    batch = set(d.batch)
    return {"time": unix(t), "frame": d.frame_id, "batch": list(d.batch), "preempt": list(d.preempt),
            "requests": [{"id": v.req_id, "kind": v.kind.value, "running": v.running, "in_batch": v.req_id in batch,
                          "priority": d.priorities.get(v.req_id), "generated": v.generated,
                          "len_bound": v.len_bound, "input_len": v.input_len, "arrival": unix(v.arrival),
                          "admit_by": unix(v.admit_by), "deadline": unix(v.deadline),
                          "sub_deadline": unix(v.sub_deadline), "task": v.task_id} for v in views]}


def plugin_stats(s: Any) -> dict:
    """The plug-in's counters and settings (``EngineCall.STATS``, JSON-ready) for scheduler ``s`` (a
    ``JitflowScheduler``): policy, batch size B, queues, frames and their time (ms), KV cache size (tokens),
    preemptions, resumed requests, the measured service rate, refusals (``rejected``: admission control,
    of which ``engine_admission_refused`` by the engine's own rule), and the step-time tracker."""
    fm = sorted(s.frame_ms)

    def pct(q: float) -> float | None:
        return fm[min(len(fm) - 1, int(q * len(fm)))] if fm else None

    svc = s.tracker.service_rate(s.batch_size)
    return {
        "policy": s.policy_name, "params": s.policy_params, "batch_size": s.batch_size,
        "running": len(s.running), "waiting": len(s.waiting),
        "paused": s.pause_state != PauseState.UNPAUSED,
        "unfinished": s.get_num_unfinished_requests(), "steps": s.step_no, "frames": s.frame_no,
        "frame_ms_p50": statistics.median(fm) if fm else None, "frame_ms_p99": pct(0.99),
        "block_size": int(s.block_size), "kv_capacity_tokens": s._kv_capacity_tokens(),
        "preempted": sum(s.preempted_by_reason.values()), "preempted_by_reason": dict(s.preempted_by_reason),
        "resumed": dict(s.resumed), "service": svc.to_dict() if svc else None,
        "rejected": s.n_rejected, "engine_admission_refused": s.admission.n_refused,
        "policy_refusals": s.n_policy_refusals, "bad_hints": s.n_bad_hints,
        "illegal_transitions": s.n_illegal_transitions, "paced_steps": s.pacer.paced_steps,
        "deferred_prefills": s.pacer.deferred_prefills, "tracker": s.tracker.summary(),
    }
