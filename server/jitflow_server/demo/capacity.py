"""The demo's engine capacity on its mix (given, cached while the machine keeps its speed, or measured) and
the warm-up every engine gets before its phases. The measurement itself is
:func:`~jitflow_server.demo.calibrate.measure_capacity`; this module decides when to measure and how to tell
the user."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import Any

from jitflow_server.demo.calibrate import (
    CAPACITY_ROUNDS,
    CAPACITY_WARMUP_S,
    CallShape,
    Capacity,
    fmt_ms,
    is_stale,
    load_cached,
    machine_key,
    measure_capacity,
    mix_demand,
    save_cached,
    speed_probe,
)
from jitflow_server.demo.options import DemoOptions
from jitflow_server.demo.plan import DemoError
from jitflow_server.demo.servers import wait_idle

#: Seconds of closed-loop load every server gets right before its phases, so that neither side's first
#: requests pay for a cold engine (the first minute of a fresh engine ran ~25 % slower on this machine).
WARM_ENGINE_S = 6.0


def warm_engine(url: str, opts: DemoOptions, shapes: list[CallShape], console: Any | None) -> None:
    """Warm the engine with the demo's mix (closed loop, :data:`WARM_ENGINE_S` seconds); a status line on
    ``console`` unless it is None (engines warmed at once share their caller's)."""
    status = console.status(f"warming the engine ({WARM_ENGINE_S:.0f} s of the demo mix) ...") if console else None
    with status or contextlib.nullcontext():
        with contextlib.suppress(RuntimeError):  # no token in the short window: still warmed
            measure_capacity(url, opts.model, shapes, key="warm-up", batch_size=opts.batch_size,
                             warmup=1.0, window=WARM_ENGINE_S - 1.0, seed=opts.seed + 7, rounds=1)
    wait_idle(url, 30)


def resolve_capacity(opts: DemoOptions, url: str, dtype: str | None, shapes: list[CallShape], console: Any,
                     ready: Callable[[], bool] | None = None, settle: Callable[[], None] | None = None,
                     cores: str | None = None, also: list[str] | None = None) -> Capacity:
    """The engine's capacity on the demo mix: given (``--capacity``), cached, or measured on ``url``.

    A cached measurement is used only while the machine runs at its speed: a lone request's time between
    tokens is probed (after ``settle``, which waits until nothing else uses the CPU, i.e. the length
    model's training, and after :func:`warm_engine`, since the stored probe was taken on a warm engine)
    and compared with the probe stored with it (:func:`is_stale`); a changed speed measures again.
    ``ready`` holds the measurement's window shut (see :func:`measure_capacity`).
    ``cores``: the cores the engine's compute threads are bound to (None: unbound, on every core), part of
    the cache key. ``also``: more servers loaded the same way at the same time, so that ``url``'s engine
    is measured while theirs are as busy as in the phases; their own readings are not used (under a
    jitflow policy a reading measures the policy's admission and batch sizing as much as the engine).
    Raises :class:`DemoError` when the measurement fails."""
    key = machine_key(opts.model, dtype, opts.batch_size, cores, mix=shapes)
    if opts.capacity_scale is not None:
        d = mix_demand(shapes)
        return Capacity(key, opts.capacity_scale * d, float("nan"), d, opts.capacity_scale, 0, 0.0,
                        "given by --capacity", cached=True)
    cap = None if opts.recalibrate else load_cached(key, opts.capacity_cache)
    if cap is not None:
        if settle is not None:
            settle()
        # the stored probe was taken on an engine the measurement had just warmed; a just-started engine
        # runs slower for its first requests, which once hid a capacity measured while the host was slow
        # (stored probe 30 ms; a cold probe read 23 ms, the warm engine 17-20 ms)
        warm_engine(url, opts, shapes, console)
        probe = speed_probe(url, opts.model)
        if not is_stale(cap, probe):
            console.print(f"capacity: [bold]{cap.out_tok_s:.0f} output tok/s[/bold] on the demo mix (cached "
                          f"{cap.measured_at}; speed probe {fmt_ms(probe)} now, {fmt_ms(cap.probe_tbt_s)} then; "
                          "--recalibrate to measure again)")
            return cap
        console.print(f"[yellow]this machine's speed changed since its capacity was measured[/yellow] "
                      f"({cap.measured_at}): a lone request takes {fmt_ms(probe)} between tokens now, "
                      f"{fmt_ms(cap.probe_tbt_s)} then; measuring again")
    urls = [url, *(also or [])]
    each = f" on each of {len(urls)} engines" if len(urls) > 1 else ""
    with console.status(f"measuring this machine's capacity: {2 * opts.batch_size} requests of the demo mix in "
                        f"flight{each} until its speed settles (at most "
                        f"{CAPACITY_ROUNDS * opts.calibration_window + CAPACITY_WARMUP_S:.0f} s) ..."):
        def measure(u: str) -> Capacity:
            return measure_capacity(u, opts.model, shapes, key=key, batch_size=opts.batch_size,
                                    window=opts.calibration_window, seed=opts.seed, ready=ready)

        def load(u: str) -> None:  # the other engines' readings are not used, nor their failures
            with contextlib.suppress(RuntimeError):
                measure(u)

        with concurrent.futures.ThreadPoolExecutor(max(1, len(urls) - 1)) as pool:
            others = [pool.submit(load, u) for u in urls[1:]]
            try:
                cap = measure(url)
            except RuntimeError as exc:
                raise DemoError(f"capacity measurement failed: {exc}") from None
            finally:
                concurrent.futures.wait(others)
    for u in urls:
        wait_idle(u, 30)
    cap.probe_tbt_s = speed_probe(url, opts.model)
    save_cached(cap, opts.capacity_cache)
    console.print(f"capacity: [bold]{cap.out_tok_s:.0f} output tok/s[/bold] on the demo mix "
                  f"({cap.requests} requests, {cap.step_s * 1000:.0f} ms between tokens at full batch; windows of "
                  f"{opts.calibration_window:.0f} s read {', '.join(f'{r:.0f}' for r in cap.window_rates)}); saved to "
                  f"{opts.capacity_cache}")
    return cap
