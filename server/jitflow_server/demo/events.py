"""The servers' request lifecycle events during the demo's phases (``jitflow demo --events``).

A server keeps only its last 256 events (``GET /v1/jitflow/engine/events``: ``engine`` from the scheduler
plug-in, add / first_sched / preempt / finish / reject; ``server`` from the HTTP layer, arrive /
first_token / done / abort), so a phase's events are read while it runs, every
:data:`EVENT_POLL_S` seconds, and kept in order of arrival without repeats. Without them a lost run
cannot be traced after the fact: the demo's servers and their logs are gone when it ends.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio
import httpx

#: Seconds between two reads of a server's events (a burst phase adds about 20 events/s, far below the
#: 256 the server keeps between reads).
EVENT_POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class ServerEvent:
    """One lifecycle event: which demo ``side`` and ``phase``, ``source`` (``engine`` or ``server``),
    unix time ``t`` (s), ``event``, ``request_id`` and ``detail`` as the server reported them."""

    side: str
    phase: str
    source: str
    t: float
    event: str
    request_id: str
    detail: str


class EventRecorder:
    """Reads one server's events while a phase runs (:meth:`run`, until cancelled) and once more at the end
    (:meth:`final`); :attr:`events` holds each event once, in the order first read. Events before ``since``
    (unix s; default: when the recorder is made) belong to an earlier phase and are left out: the server
    still holds them at the first read."""

    def __init__(self, url: str, side: str, phase: str, since: float | None = None) -> None:
        self.url, self.side, self.phase = url.rstrip("/"), side, phase
        self.since = time.time() if since is None else since
        self.events: list[ServerEvent] = []
        self._seen: set[tuple] = set()
        self.failed_reads = 0

    async def poll(self, client: httpx.AsyncClient) -> None:
        """Read the server's events once and keep the new ones; a failed read is counted, not raised (a
        diagnostic must not stop the demo)."""
        try:
            r = await client.get(f"{self.url}/v1/jitflow/engine/events", timeout=5.0)
            r.raise_for_status()
            body = r.json()
        except (httpx.HTTPError, ValueError):
            self.failed_reads += 1
            return
        for source in ("engine", "server"):
            for row in body.get(source) or []:
                key = (source, *row)
                if key in self._seen or len(row) != 4 or float(row[0]) < self.since:
                    continue
                self._seen.add(key)
                t, event, rid, detail = row
                self.events.append(ServerEvent(self.side, self.phase, source, float(t), str(event), str(rid),
                                               str(detail)))

    async def run(self, period: float = EVENT_POLL_S) -> None:
        """Poll every ``period`` seconds until cancelled (its owner's task group cancels it)."""
        async with httpx.AsyncClient() as client:
            while True:
                await self.poll(client)
                await anyio.sleep(period)

    async def final(self) -> None:
        """One last read (after the phase's requests have left the server)."""
        async with httpx.AsyncClient() as client:
            await self.poll(client)


def events_path(report: Path) -> Path:
    """Where ``jitflow demo --events`` writes: next to the report JSON, ``<report>.events.jsonl``."""
    return report.with_suffix(".events.jsonl")


def write_events(recorders: list[EventRecorder], path: Path) -> int:
    """Append every recorder's events to the JSON-lines file ``path`` (one :class:`ServerEvent` per line);
    returns the number written. The folder is made if missing: the first phase's events are written before
    the report, which would otherwise make it."""
    n = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        for rec in recorders:
            for ev in rec.events:
                fh.write(json.dumps(asdict(ev)) + "\n")
                n += 1
    return n
