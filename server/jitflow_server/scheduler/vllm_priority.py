"""``vllm-priority``: vLLM's ``--scheduling-policy priority`` with priorities a vLLM user derives from the SLO.

vLLM v1 (``vllm/v1/core/sched/request_queue.py``, ``PriorityRequestQueue``; ``vllm/v1/request.py``,
``Request.__lt__``) keeps the waiting queue as a heap ordered by ``(priority, arrival_time)``, a
*lower* priority value first. ``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py``) first
schedules every running request, then admits waiting requests in heap order while a slot
(``max_num_seqs``) and KV blocks are free, stopping at the first that does not fit. When a *running*
request cannot get its next KV blocks, vLLM preempts ``max(running, key=(priority, arrival_time))``,
the running request with the largest priority value and, among equals, the latest arrival (possibly
the request itself); no waiting request is admitted in a step that preempted. The installed v1
scheduler never preempts a running request to make room for a waiting one: a waiting request with a
better priority waits for a slot to free. vLLM v0's ``_schedule_priority_preemption`` did: while the
best waiting request has a strictly smaller ``(priority, arrival)`` than the worst running one and
cannot get a slot or KV, that running request is preempted (``preempt_for_waiting=True`` here).

Priority of a request (an integer, fixed at its first frame; vLLM priorities are set per request
at submission and never change): its due time in whole seconds on the scheduler clock,
``floor(due)``, with ``due`` = ``deadline`` (deadline requests), ``sub_deadline`` else the task
``deadline`` (compound calls, as known at arrival), ``arrival + ttft`` (latency requests) and
``arrival + best_effort_deadline`` (best-effort). A user would send the same number as ``priority``.

What this module models and simplifies:

- ordering and slot admission as in v1: running requests first (all of them, up to B, ordered by
  ``(priority, arrival)``), then waiting requests by ``(priority, arrival)`` into the free slots;
- KV-pressure preemption is left to the engine, which preempts the *last running request in plan
  order* when a running request cannot grow (the simulator and the plug-in do this, like vLLM's
  ``_preempt_request``); since running requests are listed by ``(priority, arrival)``, that victim is
  vLLM's ``max(running, key=(priority, arrival_time))``; the engine also stops admitting at the
  first waiting request whose KV does not fit (vLLM's ``break``);
- with ``preempt_for_waiting=True`` the policy itself preempts, for each waiting request in
  priority order that cannot get a slot (or, when ``kv_capacity_tokens`` is known, its
  ``input + generated`` tokens of KV), the worst running request while that one's
  ``(priority, arrival)`` is strictly larger; it stops at the first waiting request it cannot place;
- not modelled: chunked-prefill token budgets, prefix-cache hits and LoRA/encoder budgets (the
  engine applies its own), and priority changes after arrival (``invalidate`` re-reads the static
  fields but keeps the priority, as vLLM keeps a request's priority).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jitflow_server.scheduler.frames import frame_order
from jitflow_server.scheduler.peer_common import COMMON_PARAMS, PeerPolicy, check_bool
from jitflow_server.scheduler.snapshot import Snapshot
from jitflow_server.scheduler.types import Decision, RequestView, SchedContext


class VLLMPriorityPolicy(PeerPolicy):
    """vLLM priority scheduling with SLO-derived integer priorities (see the module docstring).

    Parameters: ``preempt_for_waiting`` (False: vLLM v1 as installed, running requests keep their
    slots; True: vLLM v0's priority preemption for waiting requests) and the common ones of
    :class:`~jitflow_server.scheduler.peer_common.PeerPolicy` (``delta_steps`` default 1: vLLM
    schedules every step). ``Decision.priorities`` holds ``-priority`` (larger = more urgent).
    """

    name = "vllm-priority"
    PARAMS = (*COMMON_PARAMS, "preempt_for_waiting")

    def __init__(self, preempt_for_waiting: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.preempt_for_waiting = check_bool("preempt_for_waiting", preempt_for_waiting)
        self._prio: dict[str, int] = {}

    def priority_values(self, snap: Snapshot) -> np.ndarray:
        """Integer priority (int64) per request: ``floor(due)`` at its first frame (s), kept after."""
        ids, prio = snap.ids, self._prio
        got = np.fromiter((prio.get(i, -(2**62)) for i in ids), np.int64, snap.n)
        new = np.flatnonzero(got == -(2**62))
        if new.size:
            due = np.floor(self.completion_due(snap)[new])
            vals = np.clip(due, -(2**61), 2**61).astype(np.int64)
            got[new] = vals
            prio.update(zip([ids[i] for i in new.tolist()], vals.tolist(), strict=True))
            if len(prio) > 2 * snap.n + 1024:  # forget departed requests (amortised O(1) per request)
                self._prio = dict(zip(ids, got.tolist(), strict=True))
        return got

    def schedule(self, views: Sequence[RequestView], ctx: SchedContext) -> Decision:
        """Running requests keep their slots (by priority), free slots go to waiting requests by
        ``(priority, arrival)``; with ``preempt_for_waiting`` worse running requests are preempted."""
        snap = self.begin_frame(views, ctx)
        if snap is None:
            return Decision([], [], {}, self.frame_id)
        n, B = snap.n, ctx.batch_size
        prio = self.priority_values(snap)
        order = frame_order(n, prio, snap.arrival)
        run_o = order[snap.running[order]]
        wait_o = order[~snap.running[order]]
        kept = run_o[:B]  # vLLM never holds more than max_num_seqs; extra running ones stay paused
        preempt_idx: list[int] = []
        if not self.preempt_for_waiting:
            admitted = wait_o[: B - kept.size]
        else:
            kept, admitted, preempt_idx = self._v0_preemption(snap, prio, run_o, kept, wait_o, ctx)
        batch_idx = np.concatenate([kept, admitted])
        ids = snap.ids
        shown = self.shown(order, snap, ctx)
        pr = dict(zip([ids[i] for i in shown], (-prio[shown].astype(float)).tolist(), strict=True))
        return Decision([ids[i] for i in batch_idx.tolist()], [ids[i] for i in preempt_idx], pr,
                        self.frame_id, {"n": n})

    def _v0_preemption(self, snap: Snapshot, prio: np.ndarray, run_o: np.ndarray, kept: np.ndarray,
                       wait_o: np.ndarray, ctx: SchedContext) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """vLLM v0 ``_schedule_priority_preemption``: greedy merge of the best waiting requests with the
        worst running ones (all running requests are candidates, worst first; a victim that held a
        slot frees it), O(B + preemptions). Returns ``(kept running, admitted waiting, preempted)``."""
        B = ctx.batch_size
        free = B - kept.size
        cap = ctx.kv_capacity_tokens
        kv_free = float("inf") if cap is None else cap - float(snap.kv_tokens[snap.running].sum())
        victims = run_o[::-1].tolist()  # worst first
        vi = 0
        slot = np.zeros(snap.n, bool)
        slot[kept] = True
        arr = snap.arrival
        need_all = snap.input_len + snap.generated
        admitted: list[int] = []
        preempted: list[int] = []
        for w in wait_o.tolist():
            if len(admitted) >= B:
                break
            need = float(need_all[w])
            while not (free > 0 and need <= kv_free) and vi < len(victims):
                v = victims[vi]
                if (int(prio[v]), float(arr[v])) <= (int(prio[w]), float(arr[w])):  # no strict inversion
                    break
                vi += 1
                preempted.append(v)
                free += int(slot[v])
                kv_free += float(snap.kv_tokens[v])
            if free > 0 and need <= kv_free:
                admitted.append(w)
                free -= 1
                kv_free -= need
            else:
                break  # strict priority order: nothing behind it is admitted
        gone = set(preempted)
        kept = np.array([i for i in kept.tolist() if i not in gone], np.int64)
        return kept, np.array(admitted, np.int64), preempted
