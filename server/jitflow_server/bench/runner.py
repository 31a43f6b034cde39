"""Simulated benchmark runs: policy × load, ablations and sweeps.

``run_sim_one`` runs one workload through one *variant* and returns its metrics. Variants:

- every policy of :data:`jitflow_server.scheduler.POLICY_NAMES` (``gmax``, ``gmax-paper``, ``fcfs``,
  ``sarathi``, ``edf``, ``sjf``, ``las``, ``oracle``) with the run's analyzer and length-bound modes;
  ``oracle`` always gets true lengths and the task's own graph (JITServe*);
- ``gmax-noanalyzer``: GMAX with ``--analyzer none`` and average length bounds (Fig. 17 "w/o analyzer");
- ``sjf-analyzer``: the Fig. 17 "w/o GMAX" variant (SJF on the analyzer's estimates; identical to
  ``sjf`` with the default analyzer, listed separately for the ablation table);
- ``gmax-age`` / ``gmax-served``: GMAX with δ's frames counted from arrival (the core's default) or
  since the request was last served (the earlier rule, which thrashes under overload);
- ``gmax-noadmit`` / ``fcfs-noadmit``: GMAX / FCFS without admission control, and clients that never
  give up (``give_up_after`` is ignored). Both serve exactly the same work, so the ratio of their
  makespan throughputs is the scheduler's cost in serving capacity
  (the throughput target of the benchmark; JITServe Fig. 14 compares against Sarathi-Serve the same way).

Baselines run frames of ``baseline_delta`` decode steps (default Δ = 50, like GMAX) plus a new
frame on every arrival/finish: they re-rank exactly when their order can change through an
arrival or finish; with Δ = 1, ``las`` would preempt at every token (Autellix uses time quanta).

Admission control (``waiting_time``, JITServe §5: a call never scheduled within ``waiting_time`` s
is rejected) is set by ``RunSettings.admission``:

- ``shared`` (the default): every policy gets the same admission control (a fair comparison);
  policies with an admission control of their own (SLOs-Serve, QLM) apply theirs on top
  (``Decision.reject``), since ``waiting_time`` is the client's parameter that the front end honours
  whatever the scheduler;
- ``jitserve``: only the GMAX variants get it, as in the JITServe paper's evaluation (the baselines
  it compares with have none);
- ``off``: no policy gets it.

The ``-noadmit`` variants never get it. A variant ``<policy>+truth`` runs ``<policy>`` with the true output
lengths and the task's own graph (what the ``oracle`` gets), used to make the oracle an upper bound
over every policy, not only GMAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from jitflow_server.bench.estimates import CompoundAnalyzer, LengthBounder
from jitflow_server.bench.metrics import summarize
from jitflow_server.bench.workload import DataSources
from jitflow_server.engine.jobs import GIVE_UP_AFTER_S, Job
from jitflow_server.engine.sim import SimConfig, SimEngine
from jitflow_server.engine.step_model import StepModel
from jitflow_server.scheduler import POLICY_NAMES, make_policy
from jitflow_server.scheduler.admission import DEFAULT_WAITING_TIME_S

EXTRA_VARIANTS = ("gmax-noanalyzer", "sjf-analyzer", "gmax-age", "gmax-served", "gmax-noadmit", "fcfs-noadmit")
VARIANTS = (*POLICY_NAMES, *EXTRA_VARIANTS)


@dataclass
class RunSettings:
    """Shared settings of a set of simulated runs (see ``jitflow bench sim --help``)."""

    analyzer: str = "pattern"
    length_bound: str = "noisy"
    sigma: float = 0.5
    quantile: float = 0.9
    batch_size: int | None = None
    waiting_time: float | None = DEFAULT_WAITING_TIME_S
    admission: str = "shared"
    baseline_delta: int = 50
    age_boost: bool = False
    gmax_params: dict = field(default_factory=dict)
    length_scale: float = 1.0
    seed: int = 0
    #: Time model of the analyzer (sub-deadlines, admission estimates); ``None`` = the simulated
    #: engine's preset. ``bench fidelity --real-from`` sets it to the model the real run's analyzer
    #: used, so both sides give the policy the same inputs.
    analyzer_model: StepModel | None = None
    #: AlpacaEval directory of ``length_bound="predictor"`` (``None``: ``<shared data>/alpaca_eval``).
    alpaca_dir: Path | None = None
    #: Seconds past its deadline that a deadline request's or compound task's client gives up (``None``: never).
    give_up_after: float | None = GIVE_UP_AFTER_S
    #: How long a compound call may wait for its start (``scheduler.admission.COMPOUND_WAITING``).
    compound_waiting: str = "waiting_time"


def is_gmax_family(variant: str) -> bool:
    """True for the JITServe variants (GMAX, its ablations and the oracle)."""
    return variant.startswith("gmax") or variant == "oracle"


ADMISSION_MODES = ("shared", "jitserve", "off")
TRUTH = "+truth"


def base_variant(variant: str) -> str:
    """``variant`` without the ``+truth`` suffix."""
    return variant[: -len(TRUTH)] if variant.endswith(TRUTH) else variant


def is_other_policy(variant: str) -> bool:
    """True for the policies GMAX is compared with (not a GMAX variant, an ablation or a truth run)."""
    return not is_gmax_family(variant) and variant not in EXTRA_VARIANTS and not variant.endswith(TRUTH)


def check_variants(names: list[str]) -> None:
    """Raise ``ValueError`` naming the valid variants if one is unknown."""
    bad = [n for n in names if base_variant(n) not in VARIANTS]
    if bad or not names:
        raise ValueError(f"unknown policies {bad}; valid: {', '.join(VARIANTS)}")


def _gmax_with_clock(name: str, clock: str, **params):
    """GMAX-family policy with an explicit δ clock (``GMAXParams.starvation_clock``)."""
    params.setdefault("starvation_clock", clock)
    return make_policy(name, **params)


def build_policy(variant: str, st: RunSettings):
    """The policy object of ``variant`` (GMAX family with ``st.gmax_params``; baselines with Δ)."""
    if variant == "gmax-age":  # δ counted from arrival (the core's default since the thrashing fix)
        return _gmax_with_clock("gmax", "arrival", **dict(st.gmax_params))
    if variant == "gmax-served":  # the earlier rule: δ counted since last served (recompute thrashing)
        return _gmax_with_clock("gmax", "served", **dict(st.gmax_params))
    base = {"sjf-analyzer": "sjf", "gmax-noanalyzer": "gmax", "gmax-noadmit": "gmax",
            "fcfs-noadmit": "fcfs"}.get(variant, variant)
    if base in ("gmax", "gmax-paper", "oracle"):
        if st.age_boost:  # δ from arrival for every GMAX-family variant (now the core's default)
            return _gmax_with_clock(base, "arrival", **dict(st.gmax_params))
        return make_policy(base, **dict(st.gmax_params))
    return make_policy(base, delta_steps=st.baseline_delta)


@dataclass
class SimSetup:
    """A simulated engine ready to run one variant (:func:`build_sim`): the ``engine``, the ``jobs`` it runs
    (with held-out prompts attached under the real predictor), and what the result reports."""

    engine: SimEngine
    jobs: list[Job]
    variant: str
    analyzer: str
    waiting_time: float | None
    length_bound: str


def build_sim(jobs: list[Job], model: StepModel, variant: str, st: RunSettings, data: DataSources,
              analyzers: dict | None = None, refine_bounds: bool = True) -> SimSetup:
    """The simulated engine of ``variant`` on ``model`` (its policy, length bounds, analyzer, admission control
    and clients' give-up) for ``jobs``; :func:`run_sim_one` runs it. Arguments and errors as there."""
    check_variants([variant])
    if st.admission not in ADMISSION_MODES:
        raise ValueError(f"admission must be one of {ADMISSION_MODES}, got {st.admission!r}")
    truth = variant.endswith(TRUTH)
    variant = base_variant(variant)
    an_mode, len_mode = st.analyzer, st.length_bound
    if variant == "oracle" or truth:
        an_mode, len_mode = "oracle", "oracle"
    elif variant == "gmax-noanalyzer":
        an_mode, len_mode = "none", "average"
    analyzers = analyzers if analyzers is not None else {}
    B = st.batch_size or model.batch_size
    tm = st.analyzer_model or model
    refine_every = 50 if refine_bounds else 10**9
    if an_mode not in analyzers:
        analyzers[an_mode] = CompoundAnalyzer(an_mode, data, decode_s=tm.decode_token_time(B),
                                              prefill_s=tm.per_prefill_token_s, length_scale=st.length_scale)
    an = analyzers[an_mode]
    an.match_ms.clear()
    sim_an = an
    if st.length_bound == "predictor":
        from jitflow_server.bench.predictor_bounds import prepare_predictor_run

        prep = prepare_predictor_run(jobs, data, seed=st.seed, decode_s=tm.decode_token_time(B),
                                     prefill_s=tm.per_prefill_token_s, quantile=st.quantile,
                                     length_scale=st.length_scale, alpaca=st.alpaca_dir)
        jobs = prep.jobs
    if len_mode == "predictor":
        bounder = prep.bounder(refine_every=refine_every)
        sim_an = bounder.wrap_advisor(an)
    else:
        bounder = LengthBounder(len_mode, sigma=st.sigma, quantile=st.quantile, refine_every=refine_every)
    if len_mode == "average":
        bounder.fit_averages(jobs)
    pol = build_policy(variant, st)
    admit = not variant.endswith("-noadmit") and (st.admission == "shared"
                                           or (st.admission == "jitserve" and is_gmax_family(variant)))
    wt = st.waiting_time if admit else None
    give_up = None if variant.endswith("-noadmit") else st.give_up_after  # -noadmit: serve every job
    eng = SimEngine(model, pol, bounder, sim_an, SimConfig(batch_size=B, waiting_time=wt, seed=st.seed,
                                                      give_up_after=give_up,
                                                      compound_waiting=st.compound_waiting))
    return SimSetup(eng, jobs, variant + (TRUTH if truth else ""), an_mode, wt, len_mode)


def sim_result(setup: SimSetup, out: dict, keep_records: bool = False) -> dict:
    """:func:`summarize` metrics of a finished run ``out`` (``SimEngine.run``'s record) of ``setup``, plus run
    info (see :func:`run_sim_one`)."""
    jobs = setup.jobs
    span = (jobs[-1].arrival - jobs[0].arrival) if len(jobs) > 1 else 1.0
    res = summarize(out["jobs"], span, out["makespan"] - (jobs[0].arrival if jobs else 0.0), out["frame_ms"])
    res.update(variant=setup.variant, analyzer=setup.analyzer, waiting_time=setup.waiting_time,
               length_bound=setup.length_bound, steps=out["steps"],
               sim_preemptions=out["preemptions"], sim_preemptions_by_reason=out["preemptions_by_reason"],
               abandoned=out["abandoned"],
               sim_resumed=out["resumed"],
               kv_peak_frac=out["kv_peak_blocks"] / out["kv_capacity_blocks"],
               wall_s=out["wall_s"], p_final=getattr(setup.engine.policy, "p", None))
    if keep_records:
        res.update(records=out["jobs"], makespan_at=out["makespan"], frame_ms_all=list(out["frame_ms"]))
    if out["match_ms"]:
        import numpy as np

        res["match_ms_p50"] = float(np.percentile(out["match_ms"], 50))
    return res


def run_sim_one(jobs: list[Job], model: StepModel, variant: str, st: RunSettings, data: DataSources,
                analyzers: dict | None = None, refine_bounds: bool = True, keep_records: bool = False) -> dict:
    """Simulate ``jobs`` under ``variant``; returns :func:`summarize` metrics plus run info.

    ``analyzers`` caches :class:`CompoundAnalyzer` objects per mode across calls (building one loads
    and indexes the history). ``refine_bounds=False`` keeps each call's first length bound (as the
    HTTP replay of the fidelity run, which cannot refine). ``keep_records`` adds the raw per-job records
    (``records``), the absolute makespan (``makespan_at``) and the frame times (``frame_ms_all``), for
    summaries over several runs (replicas). Raises ``ValueError`` for an unknown variant.

    With ``st.length_bound == "predictor"`` every variant (the oracle and the ablations too) runs ``jobs``
    with held-out AlpacaEval prompts attached to the single calls, seeded by ``st.seed`` and cached, so all
    policies see the same attached workload (:func:`~jitflow_server.bench.predictor_bounds.prepare_predictor_run`;
    its ``FileNotFoundError`` names a missing AlpacaEval path).
    """
    setup = build_sim(jobs, model, variant, st, data, analyzers, refine_bounds)
    return sim_result(setup, setup.engine.run(setup.jobs), keep_records)
