"""vLLM v1 scheduler plug-in: makes vLLM run exactly the batch the jitflow policy core picks.

Use it as ``scheduler_cls`` (``"jitflow_server.engine.plugin.JitflowScheduler"``) in an
embedded ``AsyncLLM`` (``jitflow serve``) or a stand-alone vLLM OpenAI server
(``jitflow vllm-serve``). Policy settings travel in ``additional_config["jitflow"]``
(``{"policy": "gmax", "params": {...}, "batch_size": 32}``). Per-request scheduling hints travel as
one :class:`~jitflow_server.scheduler.hints.SchedHints` JSON string in ``SamplingParams.extra_args``
under ``"jitflow_hints"`` (vLLM's OpenAI server: ``vllm_xargs``); a request without hints is
best-effort, a request with invalid hints too (logged, counted as ``bad_hints`` in the stats).

Clock: every time the policy sees is ``time.monotonic()`` of the engine process. A request's hinted
times are relative to its front-end arrival (unix s), mapped onto the monotonic clock once when the
request is added. Diagnostics (events, step log, plan) report unix seconds.

How the batch is enforced (vLLM 0.32, ``v1/core/sched/scheduler.py``): at each step
the policy's plan (recomputed every Δ decode steps and on arrivals/finishes) is applied
by (1) preempting the chosen victims through vLLM's own ``_preempt_request``
(recompute: KV freed), (2) showing the base scheduler, for this step only, the
chosen running requests in plan order and a waiting queue holding only the chosen
waiting requests, with the active cap set to B, (3) restoring the hidden requests
afterwards. Hidden running requests keep their KV (paused, not preempted). Under a policy that paces
prefill (GMAX's ``prefill_budget="slack"``), running prompts ranked below a waiting latency request are
hidden for the step too, and the step's token budget (``max_num_scheduled_tokens``) is cut to the slack
of the decoding latency requests (:meth:`JitflowScheduler._pace`, ``scheduler/prefill_budget.py``). The
scheduler internals this relies on are listed in ``engine/vllm_compat.py`` and checked at start-up.

Control calls from the jitflow server (:class:`~jitflow_server.engine.protocol.EngineCall`: push
refined hints, reject requests not admitted within their ``waiting_time`` (JITServe §5 admission
control), switch policy, read stats) arrive through one engine-core utility method,
:data:`CONTROL_METHOD`, installed on ``EngineCore`` when this module is imported in the engine
process (vLLM resolves ``scheduler_cls`` there), and run between engine steps. A stand-alone OpenAI
server has no such channel: for requests whose hints set ``engine_admission`` (a router front end) the
plug-in enforces the waiting time itself at the start of each step (``engine/plugin_admission.py``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any

import vllm
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request, RequestStatus

from jitflow_server.engine.plugin_admission import EngineAdmission
from jitflow_server.engine.plugin_state import RequestMeta, plan_dump, plugin_stats
from jitflow_server.engine.protocol import EngineCall
from jitflow_server.engine.vllm_compat import TESTED_VLLM, missing_vllm_internals, plugin_settings
from jitflow_server.scheduler import RequestView, SchedContext, make_policy
from jitflow_server.scheduler.hints import SIMULATOR_ONLY, HintsError, HintUpdate, SchedHints
from jitflow_server.scheduler.lifecycle import IllegalTransition, RequestState
from jitflow_server.scheduler.prefill_budget import PrefillPacer, Timeline
from jitflow_server.scheduler.types import Kind
from jitflow_server.tracker.service import AttainedService
from jitflow_server.tracker.steps import StepTimeTracker

logger = logging.getLogger("jitflow.plugin")

#: Policies for which the plug-in simply runs vLLM's own FCFS scheduler (capped at B).
PASSTHROUGH = {"fcfs", "vllm"}
#: vLLM finish statuses of a request that produced all its tokens (others end it ``ABORTED``).
_DONE_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION")


def _decoding(r: Request) -> bool:
    """True once the request's prompt (or its recomputation after a preemption) is in the KV cache."""
    return r.num_output_tokens > 0 and r.num_computed_tokens >= r.num_tokens - 1


#: The engine-core utility method that carries control calls (see the module docstring).
CONTROL_METHOD = "jitflow_control"


class JitflowScheduler(Scheduler):
    """vLLM ``Scheduler`` subclass driven by the jitflow policy core (GMAX or a baseline).

    Settings, the default policy (GMAX) and the refusal of async scheduling (GPU: run vLLM with
    ``--no-async-scheduling``): :func:`~jitflow_server.engine.vllm_compat.plugin_settings`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        missing = missing_vllm_internals(self)
        if missing:
            raise RuntimeError(f"vLLM {vllm.__version__} lacks scheduler internals the jitflow plug-in needs: "
                               f"{missing} (tested with vLLM {', '.join(TESTED_VLLM)})")
        if vllm.__version__ not in TESTED_VLLM:
            logger.warning("jitflow plug-in tested with vLLM %s, running on %s", TESTED_VLLM, vllm.__version__)
        policy, params, self.batch_size = plugin_settings(self.vllm_config, self.max_num_running_reqs)
        self._base_active_cap = self.max_num_active_reqs
        self._base_token_budget = self.max_num_scheduled_tokens
        #: per-step prefill pacing, for a policy that asks for it (``paces_prefill``)
        self.pacer: PrefillPacer[Request] = PrefillPacer(lambda r: r.request_id, _decoding, self._timeline)
        self.tracker = StepTimeTracker()
        self.meta: dict[str, RequestMeta] = {}
        self.by_front_id: dict[str, str] = {}
        self.task_attained = AttainedService()  # LAS: tokens per task, bounded (LRU)
        self.step_no = 0
        self.frame_no = 0
        self.frame_ms: deque[float] = deque(maxlen=4096)
        #: every preemption by reason: policy | slots | vllm (vLLM's own, KV shortage)
        self.preempted_by_reason: dict[str, int] = {}
        #: requests scheduled again after a preemption; tokens they had to restore and how many of
        #: those the prefix cache still held (the rest was recomputed)
        self.resumed = {"requests": 0, "tokens": 0, "cached_tokens": 0}
        self.n_rejected = self.n_policy_refusals = 0
        #: admission control for requests whose hints ask the engine to enforce it (a router front end)
        self.admission = EngineAdmission()
        self.n_bad_hints = 0
        self.n_illegal_transitions = 0
        self._dirty = True
        self._plan_batch: list[str] = []
        self._plan_preempt: list[str] = []
        self._last_plan: tuple[float, list[RequestView], Any] | None = None
        self._t_sched_end: float | None = None
        #: Engine step log for step-time model fits and fidelity (``EngineCall.STEPS``, bounded):
        #: one tuple per step with the columns of ``tracker.steps.STEP_FIELDS``; period = time since the
        #: previous step reached the same point (None after an idle engine).
        self.step_log: deque[tuple] = deque(maxlen=50_000)
        self._t_prev_update: float | None = None
        self._busy_after_update = False
        #: Recent request lifecycle events ``(unix s, event, request id, detail)``, newest last
        #: (``EngineCall.EVENTS``; diagnostics, bounded).
        self.events: deque[tuple[float, str, str, str]] = deque(maxlen=256)
        self._set_policy(policy, params)

    # ---------------------------------------------------------------- policy
    def _set_policy(self, name: str, params: dict) -> None:
        if name in SIMULATOR_ONLY:
            raise ValueError(f"policy {name!r} reads true output lengths, which exist only in the simulator")
        self.policy_name = name
        self.policy_params = params
        self.policy = None if name in PASSTHROUGH else make_policy(name, **params)
        self._last_plan = None
        self.max_num_active_reqs = min(self._base_active_cap, self.batch_size)
        self._dirty = True

    # ---------------------------------------------------------- bookkeeping
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        sp = request.sampling_params
        try:
            hints = SchedHints.from_extra_args(sp.extra_args if sp is not None else None)
        except HintsError as exc:
            self.n_bad_hints += 1
            logger.error("request %s has invalid jitflow hints (%s); scheduled as best-effort",
                         request.request_id, exc)
            hints = None
        m = RequestMeta(request, hints, time.monotonic(), time.time())
        self.meta[request.request_id] = m
        self.by_front_id[m.front_id] = request.request_id
        if hints is not None and hints.engine_admission and m.waiting_time is not None:
            self.admission.watch(request.request_id, m.arrival + m.waiting_time)
        self._event("add", request.request_id, f"{m.kind.value} max_tokens={request.max_tokens}")
        self._dirty = True

    def _event(self, kind: str, req_id: str, detail: str = "") -> None:
        self.events.append((time.time(), kind, req_id, detail))

    def _move(self, req_id: str, state: RequestState, now: float | None = None) -> None:
        """Move a request's :class:`Lifecycle`; an illegal move is logged and counted, never raised
        (the engine core must not die of a bookkeeping error)."""
        m = self.meta.get(req_id)
        if m is None:
            return
        try:
            m.life.to(state, time.monotonic() if now is None else now)
        except IllegalTransition as exc:
            self.n_illegal_transitions += 1
            logger.error("request %s: %s", req_id, exc)

    def _forget(self, req_id: str) -> None:
        m = self.meta.pop(req_id, None)
        if m is not None and self.by_front_id.get(m.front_id) == req_id:
            del self.by_front_id[m.front_id]

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False,
                         why: str = "vllm") -> None:  # type: ignore[override]
        super()._preempt_request(request, timestamp, drop_stale_output)
        self.preempted_by_reason[why] = self.preempted_by_reason.get(why, 0) + 1
        self._move(request.request_id, RequestState.PREEMPTED)
        self._event("preempt", request.request_id, why)

    def finish_requests(self, request_ids, finished_status):  # type: ignore[override]
        done = super().finish_requests(request_ids, finished_status)
        for r in done:
            self._event("finish", r.request_id, f"{finished_status.name} out={r.num_output_tokens}")
            m = self.meta.get(r.request_id)
            if m is not None and not m.life.done:
                self._move(r.request_id, RequestState.FINISHED if r.status.name in _DONE_OK else RequestState.ABORTED)
            self._forget(r.request_id)
        if done:
            self._dirty = True
        return done

    def update_from_output(self, scheduler_output, model_runner_output):  # type: ignore[override]
        now = time.time()  # the step log is in unix seconds (diagnostics)
        mono = time.monotonic()
        if self._t_sched_end is not None:
            n_dec = 0
            pre = 0
            ctx_dec = 0
            ctxs = []
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                r = self.requests.get(rid)
                if r is not None and n == 1 and r.num_computed_tokens >= r.num_prompt_tokens:
                    n_dec += 1
                    ctx_dec += r.num_computed_tokens
                else:
                    pre += n
                if r is not None:
                    ctxs.append(r.num_computed_tokens + n)
            fwd = now - self._t_sched_end
            period = (now - self._t_prev_update) if (self._t_prev_update is not None
                                                     and self._busy_after_update) else None
            self.tracker.record(fwd, n_dec, pre, period)
            mean = sum(ctxs) / len(ctxs) if ctxs else 0.0
            cv = (math.sqrt(sum((c - mean) ** 2 for c in ctxs) / len(ctxs)) / mean) if len(ctxs) > 1 and mean else 0.0
            self.step_log.append((now, period, fwd, n_dec, pre, ctx_dec, cv))
        self._t_prev_update = now
        before = {rid: self.requests[rid].num_output_tokens for rid in scheduler_output.num_scheduled_tokens
                  if rid in self.requests}
        out = super().update_from_output(scheduler_output, model_runner_output)
        for rid, n0 in before.items():
            r = self.requests.get(rid)
            m = self.meta.get(rid)
            if m is None:
                continue
            n1 = r.num_output_tokens if r is not None else n0
            if n1 > n0:
                m.life.tokens(mono)
                if m.task:
                    self.task_attained.add(m.task, n1 - n0)
            if r is None or r.is_finished():
                self._event("finish", rid, f"{r.status.name if r is not None else 'gone'} out={n1}")
                ok = r is not None and r.status.name in _DONE_OK
                self._move(rid, RequestState.FINISHED if ok else RequestState.ABORTED, mono)
                self._forget(rid)
                self._dirty = True
        self._busy_after_update = bool(self.running or self.waiting)
        return self.admission.report(out)

    # -------------------------------------------------------------- schedule
    def _views(self, reqs: list[Request]) -> list[RequestView]:
        views = []
        for r in reqs:
            m = self.meta.get(r.request_id)
            if m is None:
                continue
            mt = r.max_tokens
            bound = m.len_bound if m.len_bound is not None else mt
            views.append(RequestView(
                req_id=r.request_id, kind=m.kind, arrival=m.arrival, input_len=r.num_prompt_tokens,
                generated=r.num_output_tokens, len_bound=max(int(bound or 1), 1),
                running=r.status == RequestStatus.RUNNING, kv_tokens=int(r.num_computed_tokens),
                ttft=m.ttft, tbt=m.tbt, deadline=m.deadline, sub_deadline=m.sub_deadline, task_id=m.task,
                stage_index=m.stage, task_tokens_est=m.task_tokens_est, task_rem_gen_time=m.task_rem_gen_time,
                attained_service=float(self.task_attained.get(m.task) if m.task else r.num_output_tokens),
                max_tokens=mt, first_token_time=m.life.first_token, last_token_time=m.life.last_token,
                admit_by=m.life.admit_by(m.waiting_time),
            ))
        return views

    def _replan(self, now: float) -> None:
        cands = list(self.running) + [r for r in self.waiting]
        views = self._views(cands)
        ctx = SchedContext(
            now=now, batch_size=self.batch_size,
            token_time=self.tracker.token_time(min(self.batch_size, max(len(views), 1))),
            prefill_rate=self.tracker.prefill_rate(),
            kv_capacity_tokens=self._kv_capacity_tokens() or None,
            max_running=self.max_num_running_reqs,
            prefix_caching=bool(self.cache_config.enable_prefix_caching),
            kv_block_size=int(self.block_size) or None,
            token_time_model=self.tracker.token_time_model(),
        )
        t0 = time.perf_counter()
        decision = self.policy.schedule(views, ctx)
        self.frame_ms.append((time.perf_counter() - t0) * 1e3)
        self.frame_no += 1
        self._plan_batch = list(decision.batch)
        self._plan_preempt = list(decision.preempt)
        # Decision.reject: stays out of the batch until the front end's waiting_time admission answers 429
        self.n_policy_refusals += len(decision.reject)
        self._last_plan = (now, views, decision)

    def schedule(self, throttle_prefills: bool = False):  # type: ignore[override]
        now = time.monotonic()
        for rid in self.admission.due(now):  # engine admission: removed before the policy sees them
            r = self.requests.get(rid)
            if r is not None and self._reject(rid, "engine admission"):
                self.admission.refused(r)
        for r in self.running:  # admitted by the base scheduler in an earlier step
            m = self.meta.get(r.request_id)
            if m is not None and m.life.state is not RequestState.RUNNING:
                self._move(r.request_id, RequestState.RUNNING, now)
        if self.policy is None:
            out = super().schedule(throttle_prefills)
            self._mark_scheduled(out, now)
            self._t_sched_end = time.time()
            return out
        self.step_no += 1
        if self.policy.needs_recompute(self.step_no, self._dirty) or self._dirty:
            self._replan(now)
            self._dirty = False
        chosen = {rid: i for i, rid in enumerate(self._plan_batch)}
        # (1) cost-aware preemptions chosen by the policy, through vLLM's own path.
        preempt_ids = set(self._plan_preempt)
        victims = [r for r in self.running if r.request_id in preempt_ids]
        if victims:
            vs = set(victims)
            self.running = [r for r in self.running if r not in vs]
            for r in victims:
                self._preempt_request(r, now, why="policy")
            self._plan_preempt = []
        # Keep the model runner within its slot count: hidden (paused) running requests that the
        # plan does not run give way to chosen waiting requests.
        run_sel = sorted((r for r in self.running if r.request_id in chosen), key=lambda r: chosen[r.request_id])
        hidden = [r for r in self.running if r.request_id not in chosen]
        wait_sel = sorted((r for r in self.waiting if r.request_id in chosen or
                           self._is_blocked_waiting_status(r.status)),
                          key=lambda r: chosen.get(r.request_id, len(chosen)))
        overflow = len(run_sel) + len(hidden) + len(wait_sel) - self.max_num_running_reqs
        if overflow > 0 and hidden:
            for r in hidden[-overflow:]:
                self._preempt_request(r, now, why="slots")
            hidden = hidden[:-overflow] if overflow < len(hidden) else []
            self.running = run_sel + hidden
        saved_waiting = self.waiting
        sel_ids = {r.request_id for r in wait_sel}
        rest_waiting = [r for r in saved_waiting if r.request_id not in sel_ids]
        tmp = FCFSRequestQueue()
        for r in wait_sel:
            tmp.append(r)
        run_sel, hidden, budget = self._pace(run_sel, hidden, wait_sel, chosen, now)
        self.running = run_sel
        self.waiting = tmp
        self.max_num_scheduled_tokens = budget
        try:
            out = super().schedule(throttle_prefills)
        finally:
            self.max_num_scheduled_tokens = self._base_token_budget
            scheduled = self.running
            still_running = set(scheduled)
            self.running = scheduled + [r for r in hidden if r not in still_running
                                        and r.status == RequestStatus.RUNNING]
            leftover = list(self.waiting)  # chosen-but-not-admitted + anything base preempted
            q = FCFSRequestQueue()
            seen = set()
            for r in leftover + rest_waiting:
                if r.request_id not in seen and not r.is_finished() and r.status != RequestStatus.RUNNING:
                    seen.add(r.request_id)
                    q.append(r)
            self.waiting = q
        self._mark_scheduled(out, now)
        self._t_sched_end = time.time()
        return out

    def _pace(self, run_sel: list[Request], hidden: list[Request], wait_sel: list[Request], rank: dict[str, int],
              now: float) -> tuple[list[Request], list[Request], int]:
        """``(run_sel, hidden, token budget)`` of the step under a policy that paces its prefill
        (:class:`~jitflow_server.scheduler.prefill_budget.PrefillPacer`); unchanged, with the engine's budget,
        under any other policy."""
        if not getattr(self.policy, "paces_prefill", False):
            return run_sel, hidden, self._base_token_budget
        step = self.pacer.step(run_sel, wait_sel, rank, now, self.tracker.step_time, self._base_token_budget,
                               getattr(self.policy, "prefill_ttft_share", 0.0),
                               overloaded=len(self.running) + len(self.waiting) > self.batch_size)
        return step.run, hidden + step.deferred, step.budget

    def _timeline(self, r: Request) -> Timeline | None:
        m = self.meta.get(r.request_id)
        if m is None or m.kind is not Kind.LATENCY or m.ttft is None or m.tbt is None:
            return None
        return m.arrival, m.ttft, m.tbt, r.num_output_tokens

    def _mark_scheduled(self, out, now: float) -> None:
        for rid, n in out.num_scheduled_tokens.items():
            m = self.meta.get(rid)
            if m is None:
                continue
            if m.life.state is RequestState.PREEMPTED:  # resumed: how much did the prefix cache keep?
                r = self.requests.get(rid)
                if r is not None:
                    # vLLM has already advanced num_computed_tokens by this step's tokens
                    self.resumed["requests"] += 1
                    self.resumed["tokens"] += r.num_prompt_tokens + r.num_output_tokens
                    self.resumed["cached_tokens"] += max(int(r.num_computed_tokens) - int(n), 0)
            first = not m.life.ever_scheduled
            self._move(rid, RequestState.RUNNING, now)
            if first:
                self._event("first_sched", rid, f"running={len(self.running)}")

    def _kv_capacity_tokens(self) -> int:
        """KV cache size in tokens (0 before the engine has sized it)."""
        return int(self.cache_config.num_gpu_blocks or 0) * int(self.block_size)

    # --------------------------------------------------------------- control
    def control(self, call: str, payload: dict | None = None) -> Any:
        """Answer one :class:`~jitflow_server.engine.protocol.EngineCall` from the jitflow server (run
        between engine steps).

        ``stats``; ``events`` (recent request lifecycle events, oldest first: ``[[unix s, event, request id,
        detail], ...]``, events add/first_sched/preempt/finish/reject); ``plan`` (:func:`~jitflow_server.engine.plugin_state.plan_dump`);
        ``steps`` (``{"since": unix s}`` -> the step-log entries after ``since``); ``update`` (a
        :class:`~jitflow_server.scheduler.hints.HintUpdate` dict, keyed by hint request id);
        ``reject_waiting`` (``{"ids": [...]}`` -> ``{"rejected": ids never scheduled and now removed}``);
        ``set_policy`` (``{"name", "params", "batch_size"}``). Raises ``ValueError`` for an unknown call,
        a bad payload or a bad policy.
        """
        try:
            c = EngineCall(call)
        except ValueError:
            raise ValueError(f"unknown jitflow control call {call!r}") from None
        p = payload or {}
        if c is EngineCall.STATS:
            return self._stats()
        if c is EngineCall.EVENTS:
            return [list(e) for e in self.events]
        if c is EngineCall.PLAN:
            return plan_dump(self._last_plan)
        if c is EngineCall.STEPS:
            since = float(p.get("since") or 0.0)
            return [list(e) for e in self.step_log if e[0] > since]
        if c is EngineCall.UPDATE:
            self._apply_update(HintUpdate.from_dict(p))
            return {"ok": True}
        if c is EngineCall.REJECT_WAITING:
            return {"rejected": self._reject_waiting([str(x) for x in p.get("ids") or []])}
        if p.get("batch_size") is not None:  # EngineCall.SET_POLICY
            b = int(p["batch_size"])
            if not 1 <= b <= self.max_num_running_reqs:
                raise ValueError(f"batch_size must be in [1, {self.max_num_running_reqs}]")
            self.batch_size = b
        self._set_policy(str(p.get("name", self.policy_name)), dict(p.get("params") or {}))
        return self._stats()

    def _apply_update(self, u: HintUpdate) -> None:
        for fid, b in u.len_bound.items():
            rid = self.by_front_id.get(fid)
            if rid in self.meta:
                self.meta[rid].len_bound = int(b)
        for fid, t in u.sub_deadline.items():
            rid = self.by_front_id.get(fid)
            if rid in self.meta:
                m = self.meta[rid]
                m.sub_deadline = m.arrival + float(t)
        if self.policy is not None:
            for fid, g in u.finished:
                self.policy.on_finished(fid, g, time.monotonic())
        self._dirty = True

    def _reject_waiting(self, ids: list[str]) -> list[str]:
        return [fid for fid in ids if (rid := self.by_front_id.get(fid)) and self._reject(rid, "admission")]

    def _reject(self, rid: str, why: str) -> bool:
        """Remove engine request ``rid`` if it was never scheduled (admission control); True if removed."""
        m = self.meta.get(rid)
        r = self.requests.get(rid)
        if r is None or m is None or m.life.ever_scheduled or r.status == RequestStatus.RUNNING:
            return False
        self._event("reject", rid, why)
        self._move(rid, RequestState.REJECTED)
        self.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        self.n_rejected += 1
        return True

    def _stats(self) -> dict:
        return plugin_stats(self)


def _engine_core_control(self: EngineCore, call: str, payload: dict | None = None) -> Any:
    sched = self.scheduler
    if not isinstance(sched, JitflowScheduler):
        raise RuntimeError("the engine is not running the jitflow scheduler plug-in")
    return sched.control(call, payload)


# Installed in the engine-core process when vLLM resolves ``scheduler_cls``.
setattr(EngineCore, CONTROL_METHOD, _engine_core_control)
