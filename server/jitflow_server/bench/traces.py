"""Production request traces replayed in the simulator (``load_trace`` → ``trace_workload`` → SimEngine).

Two formats, told apart by content (the first non-empty line: a JSON object → Mooncake, else a CSV
header); a file starting with the gzip magic bytes is decompressed first:

- **Mooncake** (FAST'25, ``kvcache-ai/Mooncake`` traces) JSONL: one object per line with
  ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens) and optional ``hash_ids`` (ids of the
  prompt's 512-token blocks; equal ids at the same position mean a shared prefix);
- **Azure** LLM inference trace (2023/2024) CSV: header ``TIMESTAMP,ContextTokens,GeneratedTokens``
  (column names matched case-insensitively), ``TIMESTAMP`` a wall-clock datetime such as
  ``2023-11-16 18:15:46.6805900`` (fraction truncated to µs; a plain number is taken as seconds).

A :class:`Trace` holds the rows sorted by arrival (a stable sort: unsorted files are accepted), arrival
times in seconds from the first request. Lengths must be non-negative integers (an integral float such as
``12.0`` is accepted); timestamps must be finite. Any bad row raises
:class:`~jitflow_server.bench.workload.WorkloadError` naming the file, line and field. Files are read
line by line with the standard library (a 50,000-row Mooncake file loads in well under a second).

:func:`trace_workload` turns a trace into simulator jobs, one per row. Traces carry no task structure,
so the kind of each row is drawn with the ``latency:deadline:compound`` mix: latency and deadline jobs
replay the row's lengths (and ``hash_ids`` as :attr:`CallSpec.prefix_ids`, which the simulator's prefix
cache uses), while a compound job keeps only the row's arrival time and takes its stages from the same
sources as :func:`~jitflow_server.bench.workload.make_workload` (a deep-research trace record from
``data`` or the tree-of-thoughts generator, alternating), since a single trace row cannot say which
calls would have belonged to one agent task.
"""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from jitflow_server.bench.workload import (
    KINDS,
    DataSources,
    JobFactory,
    WorkloadError,
    check_job_params,
    kind_sequence,
)
from jitflow_server.engine.jobs import Job

MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")
AZURE_FIELDS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass
class Trace:
    """A request trace: one row per request, sorted by arrival.

    ``arrival_s`` float64 s from the first request (non-decreasing, ``arrival_s[0] == 0``);
    ``input_len`` / ``output_len`` int64 tokens; ``hash_ids`` per row a tuple of 512-token prefix-block ids
    (``()`` for a row without them), or ``None`` when no row has any; ``origin`` the source path;
    ``format`` ``"mooncake"`` or ``"azure"``.
    """

    arrival_s: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    hash_ids: list[tuple[int, ...]] | None = None
    origin: str = ""
    format: str = ""

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    @property
    def duration_s(self) -> float:
        """Seconds from the first to the last arrival (0 for fewer than two rows)."""
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0

    @property
    def mean_rps(self) -> float | None:
        """Mean arrival rate (requests/s) ``(n - 1) / duration``; ``None`` if the duration is 0."""
        d = self.duration_s
        return (len(self) - 1) / d if d > 0 else None

    def without_prefixes(self) -> Trace:
        """The same trace with ``hash_ids`` dropped (no cross-request prefix sharing)."""
        return replace(self, hash_ids=None)


# ------------------------------------------------------------------------------------------ parsing
def _where(path: object, line: int, field: str | None = None) -> str:
    return f"{path}:{line}" + (f": field {field!r}" if field else "")


def _length(v: object, path: object, line: int, field: str) -> int:
    """A token count: a non-negative integer (int, integral float, or such a string)."""
    if type(v) is int:
        n = v
    elif isinstance(v, bool) or v is None:
        raise WorkloadError(f"{_where(path, line, field)}: expected a non-negative integer, got {v!r}")
    else:
        try:
            n = int(v)  # type: ignore[call-overload]
            if isinstance(v, float) and v != n:
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            try:
                f = float(v)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                f = math.nan
            if not (math.isfinite(f) and f.is_integer()):
                raise WorkloadError(f"{_where(path, line, field)}: expected a non-negative integer, "
                                    f"got {v!r}") from None
            n = int(f)
    if n < 0:
        raise WorkloadError(f"{_where(path, line, field)}: negative length {n}")
    return n


def _number(v: object, path: object, line: int, field: str) -> float:
    """A finite number (int, float or numeric string)."""
    if isinstance(v, bool) or v is None:
        f = math.nan
    else:
        try:
            f = float(v)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            f = math.nan
    if not math.isfinite(f):
        raise WorkloadError(f"{_where(path, line, field)}: expected a finite number, got {v!r}")
    return f


def _azure_time(v: str, path: object, line: int, field: str) -> float:
    """An Azure ``TIMESTAMP`` (naive local datetime, fraction truncated to µs) as Unix seconds; a plain
    number is taken as seconds."""
    ts = v.strip()
    try:
        if "." in ts:  # 7 fractional digits: trim to microseconds for datetime
            a, b = ts.split(".", 1)
            if not a.replace("-", "").isdigit():  # a datetime, not a decimal number
                ts = a + "." + b[:6]
        return datetime.fromisoformat(ts).timestamp()
    except ValueError:
        pass
    try:
        f = float(ts)
    except ValueError:
        f = math.nan
    if not math.isfinite(f):
        raise WorkloadError(f"{_where(path, line, field)}: expected a datetime such as "
                            f"2023-11-16 18:15:46.6805900, got {v!r}")
    return f


def _open_text(path: Path) -> io.TextIOBase:
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")  # type: ignore[return-value]
    return open(path, encoding="utf-8-sig", newline="")


class _Lines:
    """Iterate the lines of a text file, remembering the current line number (1-based)."""

    def __init__(self, fh: Iterable[str]) -> None:
        self.it, self.n = iter(fh), 0

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        s = next(self.it)
        self.n += 1
        return s


def _parse_mooncake(lines: Iterable[tuple[int, str]], path: object):
    times: list[float] = []
    ins: list[int] = []
    outs: list[int] = []
    hids: list[tuple[int, ...]] = []
    any_ids = False
    for ln, text in lines:
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except ValueError as e:
            raise WorkloadError(f"{_where(path, ln)}: invalid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise WorkloadError(f"{_where(path, ln)}: expected a JSON object, got {type(rec).__name__}")
        for f in MOONCAKE_FIELDS:
            if f not in rec:
                raise WorkloadError(f"{_where(path, ln, f)}: missing")
        times.append(_number(rec["timestamp"], path, ln, "timestamp"))
        ins.append(_length(rec["input_length"], path, ln, "input_length"))
        outs.append(_length(rec["output_length"], path, ln, "output_length"))
        ids = rec.get("hash_ids")
        if ids is None:
            hids.append(())
            continue
        if not isinstance(ids, list):
            raise WorkloadError(f"{_where(path, ln, 'hash_ids')}: expected a list of integers, "
                                f"got {type(ids).__name__}")
        for k, x in enumerate(ids):
            if type(x) is not int:
                raise WorkloadError(f"{_where(path, ln, 'hash_ids')}: item {k} is not an integer: {x!r}")
        hids.append(tuple(ids))
        any_ids = any_ids or bool(ids)
    return times, ins, outs, (hids if any_ids else None)


def _parse_azure(header: list[str], rows: Iterable[tuple[int, list[str]]], path: object, header_line: int):
    names = {h.strip().lower(): i for i, h in enumerate(header)}
    missing = [f for f in AZURE_FIELDS if f.lower() not in names]
    if missing:
        raise WorkloadError(f"{_where(path, header_line)}: unknown trace format: the first line is neither a "
                            f"JSON object (Mooncake JSONL) nor a CSV header with {', '.join(AZURE_FIELDS)} "
                            f"(missing {', '.join(missing)})")
    it, ic, ig = (names[f.lower()] for f in AZURE_FIELDS)
    need = max(it, ic, ig)
    times: list[float] = []
    ins: list[int] = []
    outs: list[int] = []
    for ln, row in rows:
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        if len(row) <= need:
            f = next(name for name, i in zip(AZURE_FIELDS, (it, ic, ig)) if i >= len(row))
            raise WorkloadError(f"{_where(path, ln, f)}: missing ({len(row)} columns)")
        times.append(_azure_time(row[it], path, ln, AZURE_FIELDS[0]))
        ins.append(_length(row[ic], path, ln, AZURE_FIELDS[1]))
        outs.append(_length(row[ig], path, ln, AZURE_FIELDS[2]))
    return times, ins, outs, None


def load_trace(path: str | Path) -> Trace:
    """Read a Mooncake JSONL or Azure CSV trace (format detected from content; see module docstring).

    Returns a :class:`Trace` sorted by arrival (stable), ``arrival_s`` in seconds from the earliest row.
    Raises :class:`WorkloadError` for an unreadable, empty or non-UTF-8 file, an unknown format, or a
    bad row (the message names the line and field: missing field, non-integer or negative length,
    non-finite timestamp, malformed ``hash_ids``).
    """
    p = Path(path)
    try:
        fh = _open_text(p)
    except OSError as e:
        raise WorkloadError(f"{p}: cannot read trace: {e}") from None
    lines = _Lines(fh)
    try:
        with fh:
            first = next((s for s in lines if s.strip()), None)
            if first is None:
                raise WorkloadError(f"{p}: empty trace file")
            first_ln = lines.n
            if first.lstrip().startswith("{"):
                fmt = "mooncake"
                numbered = itertools.chain([(first_ln, first)], ((lines.n, s) for s in lines))
                times, ins, outs, hids = _parse_mooncake(numbered, p)
            else:
                fmt = "azure"
                header = next(csv.reader([first]))
                reader = csv.reader(lines)
                times, ins, outs, hids = _parse_azure(header, ((lines.n, r) for r in reader), p, first_ln)
    except UnicodeDecodeError as e:
        # decoding runs ahead of the lines handed out: the bad byte is at or after this line
        raise WorkloadError(f"{p}: not UTF-8 text at or after line {lines.n + 1} ({e.reason})") from None
    except (OSError, EOFError, csv.Error) as e:  # truncated gzip, CSV quoting errors
        raise WorkloadError(f"{_where(p, lines.n)}: unreadable trace: {e}") from None
    if not times:
        raise WorkloadError(f"{p}: no rows")
    t = np.asarray(times, dtype=np.float64)
    i = np.asarray(ins, dtype=np.int64)
    o = np.asarray(outs, dtype=np.int64)
    if t.size > 1 and (np.diff(t) < 0).any():
        order = np.argsort(t, kind="stable")
        t, i, o = t[order], i[order], o[order]
        if hids is not None:
            hids = [hids[k] for k in order.tolist()]
    t = t - t[0]
    if fmt == "mooncake":
        t = t / 1000.0
    return Trace(t, i, o, hids, str(p), fmt)


# ------------------------------------------------------------------------------------------ workload
def trace_workload(
    trace: Trace,
    *,
    rps: float | None = None,
    mix: tuple[float, float, float] = (1.0, 1.0, 1.0),
    seed: int = 0,
    tightness: float = 1.0,
    data: DataSources | None = None,
    length_scale: float = 1.0,
    max_context: int | None = None,
    limit: int | None = None,
    compound_apps: tuple[str, ...] = ("deep-research", "tot"),
    tool_time: float = 0.5,
) -> list[Job]:
    """Jobs replaying ``trace`` (its first ``limit`` rows), one job per row, sorted by arrival.

    Arrivals are the trace's (s from its first row), multiplied by one factor so that the mean rate
    ``(n - 1) / span`` is ``rps`` requests/s when given (kept as recorded otherwise, and when all the
    rows arrive at once). Each row gets a kind from ``mix`` (latency:deadline:compound, exact up to
    rounding, shuffled with ``seed``) with :func:`~jitflow_server.bench.workload.make_workload`'s SLOs
    (TTFT 2 s, TBT 0.1 s, deadline 20 s, compound 20 s per stage, times ``tightness``). Latency and deadline
    jobs replay the row's input/output lengths (times ``length_scale``, ≥ 1 token, input + output capped
    at ``max_context`` tokens) and its ``hash_ids`` as ``prefix_ids``; a compound job keeps only the row's
    arrival and takes its stages from a deep-research record of ``data`` (built-in generator without
    one) or the tot generator, alternating in ``compound_apps`` (``tool_time`` s between stages): a trace
    row carries no task structure. ``data`` ``None``: built-in sources.

    Raises :class:`~jitflow_server.bench.workload.WorkloadError` for ``rps <= 0`` or non-finite, a bad
    ``mix``, ``tightness``, ``length_scale``, ``max_context`` (< 2) or compound app, or ``limit < 0``.
    """
    if rps is not None and not (rps > 0 and math.isfinite(rps)):
        raise WorkloadError(f"rps must be > 0, got {rps}")
    if limit is not None and limit < 0:
        raise WorkloadError(f"limit must be >= 0, got {limit}")
    check_job_params(tightness, length_scale, compound_apps, max_context)
    n = len(trace) if limit is None else min(int(limit), len(trace))
    data = data or DataSources.load(None)
    rng = np.random.default_rng(seed)
    kinds = kind_sequence(n, mix, rng)
    if n == 0:
        return []
    times = np.asarray(trace.arrival_s[:n], dtype=np.float64)
    times = times - times[0]
    span = float(times[-1])
    if rps is not None and n > 1 and span > 0:
        times = times * (((n - 1) / rps) / span)  # mean gap exactly 1/rps over the n rows
    fac = JobFactory(data, rng, tightness=tightness, length_scale=length_scale, max_context=max_context,
                     compound_apps=compound_apps, tool_time=tool_time)
    ins, outs = trace.input_len[:n].tolist(), trace.output_len[:n].tolist()
    hids = trace.hash_ids
    tl = times.tolist()
    jobs: list[Job] = []
    for j in range(n):
        k = KINDS[int(kinds[j])]
        if k == "compound":
            jobs.append(fac.compound(f"j{j}", tl[j]))
        else:
            call = fac.call(ins[j], outs[j], hids[j] if hids is not None else None)
            jobs.append(fac.single(f"j{j}", k, tl[j], call))
    return jobs
