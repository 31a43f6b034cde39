"""``jitflow demo`` end to end: length model, capacity, two phases under two schedulers, report.

1. The length model is trained once (or reused from its cache) while the first server starts; the
   capacity window opens only once training has ended.
2. The first server (the baseline) starts; the engine's capacity on the demo's mix is measured on it
   (or read from the per-machine cache) and sizes a *normal* phase (0.7× capacity) and a *burst* phase
   (1.5×). The SLOs scale with the measured step time too (:func:`slo_factor`): the load and the SLOs
   are then the same for the engine whatever the CPU.
3. Each side (baseline, then jitflow) gets its own server, fresh pattern history (``patterns/*.jsonl``)
   and the identical plans (same arrivals, prompts, tasks). The servers start one after the other and
   both stay up; the phases then run interleaved, the sides' order reversed from one phase to the next
   (normal: baseline, jitflow; burst: jitflow, baseline), so that the two runs of a phase are close in
   time. Between runs the engine drains.
4. The report compares the sides per phase (``report.py``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jitflow_server.bench.server_process import ServerProcess
from jitflow_server.demo.calibrate import (
    CAPACITY_WARMUP_S,
    DEFAULT_CACHE,
    CallShape,
    Capacity,
    is_stale,
    load_cached,
    machine_key,
    measure_capacity,
    mix_demand,
    mix_shapes,
    save_cached,
    speed_probe,
    task_calls,
)
from jitflow_server.demo.length_model import DEFAULT_DIR, LengthModelJob, start_length_model
from jitflow_server.demo.plan import (
    REPO_ROOT,
    DemoConfig,
    DemoError,
    Plan,
    build_plan,
    phase_config,
    scaled_slos,
)
from jitflow_server.demo.report import build_report, print_comparison, print_summary, write_markdown
from jitflow_server.demo.runner import _import_examples, run_load
from jitflow_server.demo.servers import (
    engine_state,
    generated_output_tokens,
    start_server,
    wait_healthy,
    wait_idle,
    wait_length_model,
)

#: Report format version (docs/quickstart.md describes the schema).
REPORT_VERSION = 2


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
        model: ``jitflow serve --model`` value.
        policy: jitflow's policy.
        baseline: ``vllm`` (stock vLLM scheduling, no plug-in), another policy name run in the plug-in,
            or ``none`` (jitflow only).
        phase_duration: seconds of arrivals per phase.
        normal_load, burst_load: phase loads as multiples of the measured capacity.
        capacity_scale: skip the measurement and use this capacity (load-scale units).
        recalibrate: measure even if the cache has this machine.
        calibration_window: seconds of the capacity measurement (after its warm-up,
            ``calibrate.CAPACITY_WARMUP_S``).
        slos: SLOs, token ranges and chat grace of every phase (rates and counts are set per phase).
        seed: seed of the plans (normal phase ``seed``, burst ``seed + 1``).
        out: report JSON path (``.md`` and ``.png`` next to it).
        patterns: pattern corpora (default ``patterns/*.jsonl``).
        batch_size: B of both engines.
        startup_timeout: seconds to wait for each server's ``/health``.
        capacity_cache, model_cache: cache locations.
        params: ``NAME=VALUE`` parameters of jitflow's policy (``jitflow serve --param``).
        scale_slos: multiply ``slos``' times by :func:`slo_factor` of the measured capacity.
    """

    data_dir: Path | None = None
    model: str = "demo"
    policy: str = "gmax"
    baseline: str = "vllm"
    phase_duration: float = 40.0
    normal_load: float = 0.7
    burst_load: float = 1.5
    capacity_scale: float | None = None
    recalibrate: bool = False
    calibration_window: float = 16.0
    slos: DemoConfig = field(default_factory=lambda: DemoConfig(grace=20.0))
    seed: int = 0
    out: Path = Path("demo-report.json")
    patterns: list[Path] | None = None
    batch_size: int = 32
    startup_timeout: float = 300.0
    capacity_cache: Path = DEFAULT_CACHE
    model_cache: Path = DEFAULT_DIR
    params: list[str] = field(default_factory=list)
    scale_slos: bool = True

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


def _warmup(url: str) -> None:
    """One plain and one JSON-schema request so start-up costs (grammar compiler) are not charged to the
    first requests of the load."""
    import httpx

    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    with contextlib.suppress(Exception):
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        httpx.post(url + "/v1/chat/completions", json={**body, "model": model}, timeout=120)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        httpx.post(url + "/v1/chat/completions", json={
            **body, "model": model, "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}, timeout=120)


def _mix(opts: DemoOptions, patterns: list[Path]) -> list[CallShape]:
    base = build_plan(phase_config(1.0, 300.0, opts.seed, opts.slos), opts.data_dir)
    chat = [(j.prompt or "", j.max_tokens) for j in base.jobs if j.kind == "chat"]
    dl = [(j.prompt or "", j.max_tokens) for j in base.jobs if j.kind == "deadline"]
    return mix_shapes(chat, dl, task_calls(patterns))


#: Seconds of closed-loop load every server gets right before its phases, so that neither side's first
#: requests pay for a cold engine (the first minute of a fresh engine ran ~25 % slower on this machine).
WARM_ENGINE_S = 6.0


def _warm_engine(url: str, opts: DemoOptions, shapes: list[CallShape], console: Any) -> None:
    """Warm the engine with the demo's mix (closed loop, :data:`WARM_ENGINE_S` seconds)."""
    with console.status(f"warming the engine ({WARM_ENGINE_S:.0f} s of the demo mix) ..."):
        with contextlib.suppress(RuntimeError):  # no token in the short window: still warmed
            measure_capacity(url, opts.model, shapes, key="warm-up", batch_size=opts.batch_size,
                             warmup=1.0, window=WARM_ENGINE_S - 1.0, seed=opts.seed + 7)
    wait_idle(url, 30)


def _capacity(opts: DemoOptions, url: str, dtype: str | None, shapes: list[CallShape], console: Any,
              ready: Callable[[], bool] | None = None, settle: Callable[[], None] | None = None) -> Capacity:
    """The engine's capacity on the demo mix: given (``--capacity``), cached, or measured on ``url``.

    A cached measurement is used only while the machine runs at its speed: a lone request's time between
    tokens is probed (after ``settle``, which waits until nothing else uses the CPU, i.e. the length
    model's training) and compared with the probe stored with it (:func:`is_stale`); a changed speed
    measures again. ``ready`` holds the measurement's window shut (see :func:`measure_capacity`).
    Raises :class:`DemoError` when the measurement fails."""
    key = machine_key(opts.model, dtype, opts.batch_size)
    if opts.capacity_scale is not None:
        d = mix_demand(shapes)
        return Capacity(key, opts.capacity_scale * d, float("nan"), d, opts.capacity_scale, 0, 0.0,
                        "given by --capacity", cached=True)
    cap = None if opts.recalibrate else load_cached(key, opts.capacity_cache)
    if cap is not None:
        if settle is not None:
            settle()
        probe = speed_probe(url, opts.model)
        if not is_stale(cap, probe):
            console.print(f"capacity: [bold]{cap.out_tok_s:.0f} output tok/s[/bold] on the demo mix "
                          f"(cached {cap.measured_at}; --recalibrate to measure again)")
            return cap
        console.print(f"[yellow]this machine's speed changed since its capacity was measured[/yellow] "
                      f"({cap.measured_at}): a lone request takes {probe * 1000:.0f} ms between tokens now, "
                      f"{cap.probe_tbt_s * 1000:.0f} ms then; measuring again")
    with console.status(f"measuring this machine's capacity: {2 * opts.batch_size} requests of the demo mix in "
                        f"flight for {opts.calibration_window + CAPACITY_WARMUP_S:.0f} s ..."):
        try:
            cap = measure_capacity(url, opts.model, shapes, key=key, batch_size=opts.batch_size,
                                   window=opts.calibration_window, seed=opts.seed, ready=ready)
        except RuntimeError as exc:
            raise DemoError(f"capacity measurement failed: {exc}") from None
    wait_idle(url, 30)
    cap.probe_tbt_s = speed_probe(url, opts.model)
    save_cached(cap, opts.capacity_cache)
    console.print(f"capacity: [bold]{cap.out_tok_s:.0f} output tok/s[/bold] on the demo mix "
                  f"({cap.requests} requests, {cap.step_s * 1000:.0f} ms between tokens at full batch); saved to "
                  f"{opts.capacity_cache}")
    return cap


#: The engine step time (s between tokens at a full batch of 32, the demo model) that the default SLOs
#: were set for: chat TBT 0.1 s is 0.8 of it. Measured machines: 0.12-0.13 s on a 2-core AVX-512 CPU with
#: bf16, 0.18 s on one without (float32), where the unscaled SLOs left stock vLLM 62 % of chat and 44 %
#: of deadline SLOs at 0.7× capacity, so that the demo said more about the CPU than about scheduling.
REFERENCE_STEP_S = 0.125


def slo_factor(opts: DemoOptions, cap: Capacity) -> float:
    """How much this machine's SLOs are stretched: ``cap.step_s / REFERENCE_STEP_S`` clipped to
    [0.25, 4]; 1 when ``opts.scale_slos`` is off or the step time is unknown (``--capacity`` given)."""
    if not opts.scale_slos or not (cap.step_s == cap.step_s and cap.step_s > 0):
        return 1.0
    return min(4.0, max(0.25, cap.step_s / REFERENCE_STEP_S))


def _phases(opts: DemoOptions, cap: Capacity) -> list[Phase]:
    out = []
    slos = scaled_slos(opts.slos, slo_factor(opts, cap))
    for i, (name, load) in enumerate((("normal", opts.normal_load), ("burst", opts.burst_load))):
        scale = load * cap.scale
        cfg = phase_config(scale, opts.phase_duration, opts.seed + i, slos)
        out.append(Phase(name, load, scale, cfg, build_plan(cfg, opts.data_dir)))
    return out


def run_demo(opts: DemoOptions, console: Any = None) -> dict[str, Any]:
    """Run the demo (see the module docstring) and return the report (also written to ``opts.out`` and
    next to it as ``.md`` and ``.png``).

    Raises:
        DemoError: a server failed to start or died, training the length model failed, or the capacity
            measurement failed.
        ValueError: invalid ``opts``.
    """
    import anyio
    from rich.console import Console

    import jitflow

    console = console or Console()
    opts.validate()
    patterns = opts.patterns if opts.patterns is not None else sorted((REPO_ROOT / "patterns").glob("*.jsonl"))
    if _import_examples()[0] is None:
        console.print("[yellow]warning:[/yellow] the examples/ package is not importable (run from a source "
                      "checkout); running without compound tasks")
    warnings.simplefilter("ignore", jitflow.TelemetryWarning)
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="jitflow-demo-"))
    length: LengthModelJob | None = None
    servers: dict[str, ServerProcess] = {}  # label -> its server, while it runs
    keep_logs = False
    try:
        length = start_length_model(opts.data_dir, tmp / "train-length.log", opts.model_cache)
        console.print(f"length model: {'training on' if length.trained else 'cached, trained on'} "
                      f"{len(length.sources)} {length.source_kind} file(s) -> {length.path}")
        sides = opts.sides()
        shapes = _mix(opts, patterns)  # the mix as call shapes: for the warm-ups and the capacity
        runs: list[Any] = []
        clocks: dict[str, _Stopwatch] = {}
        served: dict[str, Any] = {}
        speed: dict[str, dict[str, float | None]] = {}
        timings: dict[str, dict[str, float]] = {}
        cap: Capacity | None = None
        phases: list[Phase] = []

        def launch(side: Side) -> ServerProcess:
            return start_server(side.label, side.serve_args(), model=opts.model, batch_size=opts.batch_size,
                                startup_timeout=opts.startup_timeout, tmp=tmp, patterns=patterns,
                                length=length if side.scheduler != "vllm" else None)

        measured_on: str | None = None  # the side whose server just ran the capacity measurement
        for k, side in enumerate(sides):  # start-up: one server at a time (servers.py says why)
            t_srv = time.monotonic()
            # The length model trains while the first server starts; a server that serves with the model
            # waits for it.
            if side.scheduler != "vllm" or k > 0:
                wait_length_model(length, console)
            srv = servers[side.label] = launch(side)
            wait_healthy(srv, side.label, opts.startup_timeout, console)
            startup = time.monotonic() - t_srv
            clock = clocks[side.label] = _Stopwatch(startup)
            state = engine_state(srv.base_url)
            console.print(f"[bold]{side.label}[/bold] server ready in {startup:.0f} s "
                          f"({'stock vLLM scheduler, no plug-in' if side.scheduler == 'vllm' else 'jitflow plug-in'})")
            _warmup(srv.base_url)
            clock.lap("warmup_s")
            if cap is None:
                cap = _capacity(opts, srv.base_url, state.get("dtype"), shapes, console,
                                ready=length.done, settle=functools.partial(wait_length_model, length, console))
                measured_on = None if cap.cached else side.label
                phases = _phases(opts, cap)
                f, s = slo_factor(opts, cap), phases[0].cfg
                console.print(f"SLOs ×{f:.2f} for this machine's speed ({cap.step_s * 1000:.0f} ms between tokens at "
                              f"full batch, set for {REFERENCE_STEP_S * 1000:.0f} ms): chat TTFT {s.ttft:.2f} s, TBT "
                              f"{s.tbt:.3f} s; deadline {s.deadline:.1f} s; tasks {s.research_deadline:.0f} / "
                              f"{s.tot_deadline:.0f} s")
                for ph in phases:
                    c = ph.cfg
                    console.print(f"phase [bold]{ph.name}[/bold]: {ph.load:.1f}× capacity = chat {c.chat_rate:.2f}/s, "
                                  f"deadline {c.deadline_rate:.2f}/s, {c.research_tasks} deep-research and "
                                  f"{c.tot_tasks} tree-of-thoughts tasks in {c.duration:.0f} s "
                                  f"({ph.plan.prompt_source} prompts, {ph.plan.arrival_source} arrivals)")
            wait_length_model(length, console)  # nothing else may share the CPU from here on
            clock.lap("capacity_s")
        # The phases run interleaved on the live servers, the sides' order reversed from one phase to the
        # next (normal: baseline then jitflow; burst: jitflow then baseline), so that the two runs of a
        # phase are about a minute apart: this machine's speed wandered by up to 20 % over minutes.
        for i, ph in enumerate(phases):
            for side in (sides if i % 2 == 0 else sides[::-1]):
                srv, clock = servers[side.label], clocks[side.label]
                clock.restart()
                if side.label not in speed:
                    # Every side runs the demo mix closed-loop right before its first phase: the warm-up,
                    # or on a machine's first run the capacity measurement that ran the same mix for longer
                    # (a warm-up after it would add 7 s to a first run that must stay within 6 minutes).
                    if side.label != measured_on:
                        _warm_engine(srv.base_url, opts, shapes, console)
                    clock.lap("warm_engine_s")
                    speed[side.label] = {"before": speed_probe(srv.base_url, opts.model)}
                    clock.lap("probes_s")
                    served[side.label] = (engine_state(srv.base_url).get("length_predictor")
                                          if side.scheduler == "jitflow" else None)
                wait_idle(srv.base_url)
                out_before = generated_output_tokens(srv.base_url)
                run = anyio.run(functools.partial(run_load, srv.base_url, ph.plan, ph.cfg, side.label, console,
                                                  phase=ph.name))
                if not srv.alive():
                    raise DemoError(f"the {side.label} server died during the {ph.name} phase; log tail:\n"
                                    f"{srv.log_tail()}")
                wait_idle(srv.base_url)  # abandoned calls are counted once the server has closed them
                out_after = generated_output_tokens(srv.base_url)
                if out_before is not None and out_after is not None:
                    run.generated_output_tokens = out_after - out_before
                print_summary(run, console)
                runs.append(run)
                clock.lap("phases_s")
                if i == len(phases) - 1:
                    speed[side.label]["after"] = speed_probe(srv.base_url, opts.model)
                    clock.lap("probes_s")
        for side in sides:
            clocks[side.label].restart()
            servers.pop(side.label).stop()
            timings[side.label] = clocks[side.label].lap("stop_s")
            console.print(f"{side.label}: " + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.0f} s"
                                                        for k, v in timings[side.label].items()))
        assert cap is not None
        report = build_report(opts, cap, phases, sides, runs, length, served, REPORT_VERSION)
        report["speed_probe_tbt_s"] = speed
        report["slo_factor"] = slo_factor(opts, cap)
        report["slo_reference_step_s"] = REFERENCE_STEP_S
        report["speed_warning"] = speed_warning(speed)
        report["wall_s"] = time.monotonic() - t_start
        report["timings_s"] = timings
        print_comparison(report, console)
        _write(report, opts.out, console)
        keep_logs = report["failed_tasks"] > 0
        return report
    except BaseException:
        keep_logs = True
        raise
    finally:
        for srv in servers.values():
            srv.stop()
        if length is not None:
            length.cancel()
        if keep_logs:
            logs = opts.out.with_suffix(".logs")
            with contextlib.suppress(OSError):
                logs.mkdir(parents=True, exist_ok=True)
                for f in tmp.glob("*.log"):
                    (logs / f.name).write_text(f.read_text(errors="replace"))
                console.print(f"[yellow]server logs kept in {logs}[/yellow]")
        shutil.rmtree(tmp, ignore_errors=True)


class _Stopwatch:
    """Seconds spent per step of one side (``lap(name)`` adds the time since the last lap to ``name``)."""

    def __init__(self, server_start_s: float) -> None:
        self.laps: dict[str, float] = {"server_start_s": server_start_s}
        self._t = time.monotonic()

    def restart(self) -> None:
        """Start timing from now (the time since the last lap went to the other side)."""
        self._t = time.monotonic()

    def lap(self, name: str) -> dict[str, float]:
        now = time.monotonic()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._t
        self._t = now
        return self.laps


#: Largest spread of the speed probes across the sides before the report warns that the machine's speed
#: changed during the run (another process on the CPU, or the host: on a 2-core VM with nothing else
#: running, lone-request probes of fresh servers one after another read 36-44 ms): the comparison is
#: then not on equal terms.
SPEED_SPREAD = 1.25


def speed_warning(speed: dict[str, dict[str, float | None]]) -> str | None:
    """A warning when the slowest and fastest speed probes of the run differ by more than
    :data:`SPEED_SPREAD` times, else None."""
    vals = [v for probe in speed.values() for v in probe.values() if v]
    if len(vals) < 2 or max(vals) <= SPEED_SPREAD * min(vals):
        return None
    return (f"the engine's speed changed during the run (time between tokens of a lone request "
            f"{min(vals) * 1000:.0f}-{max(vals) * 1000:.0f} ms): another process used the CPU, or the host "
            "ran this machine slower for a while, so the schedulers did not run on equal terms; run the demo "
            "again on a quiet machine")


def _write(report: dict[str, Any], out: Path, console: Any) -> None:
    from jitflow_server.demo.report_plot import plot_report

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    md = out.with_suffix(".md")
    write_markdown(report, md)
    png = out.with_suffix(".png")
    plot_report(report, png)
    console.print(f"wrote {out}, {md} and {png} (total {report['wall_s']:.0f} s)")

