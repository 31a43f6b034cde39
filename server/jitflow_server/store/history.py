"""Pattern-graph history store on SQLite (JITServe §4.1: reuse decay, eviction, K-medoids).

One row per finished compound task: app, task id, outcome, stage count, the compact
binary graph (:meth:`PatternGraph.to_bytes`), a *reuse weight*, and the K-medoids
cluster the graph belongs to. The database runs in WAL mode and survives restarts.

Reuse weight. A new graph starts at weight 1. The weight decays by ``decay_per_hour``
(default 0.9) per hour of the injected clock and is bumped by +1 each time the graph is
the best match: ``w(t) = w_b · 0.9^((t - t_b)/3600)`` where ``(w_b, t_b)`` is the last
bump/insert. Rows are kept ordered by the time-invariant key ``ln w_b + t_b·ln(1/0.9)/3600``
(the order of the effective weights at any instant), so eviction of the least-used rows
beyond ``capacity`` is an indexed ``ORDER BY`` (ties: oldest id first).

Clustering (offline): ``analyzer/clustering.py`` computes each app's K-medoids and stores them
with :meth:`HistoryStore.set_clusters`. Graphs inserted later have no cluster until the next
run (the matcher always scans them).

Default path: ``$JITFLOW_HISTORY_DB`` or ``~/.cache/jitflow/history.sqlite``.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jitflow_server.settings import env_settings
from jitflow_server.store.graph import PatternGraph

__all__ = ["HistoryStore", "StoredGraph", "default_db_path", "HistoryStoreError"]

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS graphs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    app TEXT NOT NULL,
    task_id TEXT,
    outcome TEXT,
    n_stages INTEGER NOT NULL,
    created REAL NOT NULL,
    weight REAL NOT NULL,
    weight_ts REAL NOT NULL,
    evict_key REAL NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    cluster INTEGER,
    is_medoid INTEGER NOT NULL DEFAULT 0,
    data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS graphs_app ON graphs(app);
CREATE INDEX IF NOT EXISTS graphs_evict ON graphs(evict_key, id);
CREATE INDEX IF NOT EXISTS graphs_app_evict ON graphs(app, evict_key, id);
"""


class HistoryStoreError(RuntimeError):
    """The history database cannot be opened or has an incompatible schema."""


def default_db_path() -> Path:
    """``$JITFLOW_HISTORY_DB`` if set, else ``<JITFLOW_CACHE>/history.sqlite`` (``~/.cache/jitflow/history.sqlite``)."""
    env = env_settings()
    if env.history_db is not None:
        return env.history_db.expanduser()
    return env.cache_dir() / "history.sqlite"


@dataclass
class StoredGraph:
    """A row of the store.

    Attributes:
        id: row id. app: application. graph: the decoded :class:`PatternGraph`.
        weight: effective reuse weight at read time. hits: number of bumps.
        cluster: K-medoids label (``None`` if not clustered). is_medoid: cluster representative.
        created: insert time (store clock, seconds).
    """

    id: int
    app: str
    graph: PatternGraph
    weight: float
    hits: int
    cluster: int | None
    is_medoid: bool
    created: float


class HistoryStore:
    """SQLite (WAL) store of finished pattern graphs with reuse weights (JITServe §4.1).

    Args:
        path: database file (parents created), ``":memory:"``, or ``None`` for
            :func:`default_db_path`.
        capacity: maximum number of graphs kept (all apps); the least-used are evicted
            after inserts beyond it.
        app_capacity: maximum number of graphs kept per application (default 5 000); the app's
            least-used are evicted after inserts beyond it. It bounds how much of the store one
            application (with tenancy: one tenant's application) can take, and how many graphs the
            matcher scans for one call.
        clock: time source in seconds (injectable for tests; default :func:`time.time`).
        decay_per_hour: reuse-weight decay factor per hour, in (0, 1].

    Raises:
        ValueError: bad capacity/decay. HistoryStoreError: unreadable DB or newer schema.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        capacity: int = 50_000,
        app_capacity: int = 5_000,
        clock: Callable[[], float] = time.time,
        decay_per_hour: float = 0.9,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if app_capacity < 1:
            raise ValueError(f"app_capacity must be >= 1, got {app_capacity}")
        self.app_capacity = int(app_capacity)
        if not 0 < decay_per_hour <= 1:
            raise ValueError(f"decay_per_hour must be in (0, 1], got {decay_per_hour}")
        self.capacity = int(capacity)
        self.clock = clock
        self.decay_per_hour = float(decay_per_hour)
        self._rate = -math.log(self.decay_per_hour) / 3600.0  # per second, >= 0
        if path is None:
            path = default_db_path()
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).expanduser().parent.mkdir(parents=True, exist_ok=True)
            self.path = str(Path(self.path).expanduser())
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) > SCHEMA_VERSION:
                raise HistoryStoreError(f"{self.path}: schema {row[0]} is newer than supported {SCHEMA_VERSION}")
        except sqlite3.DatabaseError as e:
            raise HistoryStoreError(f"cannot open history database {self.path}: {e}") from e
        self._lock = threading.RLock()
        self._gen = 0  # bumped on every change of the candidate set (insert/evict/cluster)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the database (idempotent)."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None  # type: ignore[assignment]

    def __enter__(self) -> HistoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise HistoryStoreError("history store is closed")
        return self._db

    @property
    def generation(self) -> tuple[int, int]:
        """Changes whenever the candidate set may have changed: inserts, evictions and clustering
        through this object, or any commit by another connection (SQLite ``data_version``)."""
        with self._lock:
            return self._gen, int(self._conn().execute("PRAGMA data_version").fetchone()[0])

    # ------------------------------------------------------------------ weights
    def _key(self, weight: float, ts: float) -> float:
        return math.log(max(weight, 1e-300)) + self._rate * ts

    def _effective(self, weight: float, ts: float, now: float) -> float:
        return weight * math.exp(-self._rate * max(0.0, now - ts))

    # ------------------------------------------------------------------ writes
    def insert(self, graph: PatternGraph, *, weight: float = 1.0) -> int:
        """Store a finished graph; returns its id. Evicts the least-used beyond capacity.

        Raises:
            ValueError: the graph has running calls (open stage) or ``weight <= 0``.
        """
        return self.insert_many([graph], weight=weight)[0]

    def insert_many(self, graphs: Iterable[PatternGraph], *, weight: float = 1.0) -> list[int]:
        """Store many graphs in one transaction; returns their ids (evicted ones may be among them).

        Raises:
            ValueError: an incomplete graph, or ``weight <= 0``.
        """
        if weight <= 0:
            raise ValueError("weight must be > 0")
        now = float(self.clock())
        rows = []
        for g in graphs:
            if not g.is_complete:
                raise ValueError(f"cannot store an incomplete graph ({g!r}): some calls are still running")
            rows.append((g.app, g.task_id, g.outcome, g.n_stages, now, weight, now, self._key(weight, now),
                         g.to_bytes()))
        ids = []
        with self._lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                for r in rows:
                    cur = db.execute(
                        "INSERT INTO graphs (app, task_id, outcome, n_stages, created, weight, weight_ts,"
                        " evict_key, data) VALUES (?,?,?,?,?,?,?,?,?)", r)
                    ids.append(int(cur.lastrowid))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            self._gen += 1
            for app in {r[0] for r in rows}:
                self._evict_beyond(self.app_capacity, app)
            self.evict()
        return ids

    def _evict_beyond(self, cap: int, app: str | None = None) -> int:
        """Delete the least-used graphs (lowest effective weight, oldest first) beyond ``cap``, of ``app``
        only or (``None``) of the whole store; returns the number deleted."""
        where, args = ("WHERE app=?", (app,)) if app is not None else ("", ())
        with self._lock:
            db = self._conn()
            extra = db.execute(f"SELECT COUNT(*) FROM graphs {where}", args).fetchone()[0] - cap
            if extra <= 0:
                return 0
            db.execute(f"DELETE FROM graphs WHERE id IN (SELECT id FROM graphs {where} ORDER BY evict_key, id "
                       "LIMIT ?)", (*args, extra))
            self._gen += 1
            return extra

    def bump(self, graph_id: int, amount: float = 1.0) -> float:
        """Add ``amount`` to the (decayed) reuse weight of a matched graph; returns the new weight.

        Raises:
            KeyError: unknown id (e.g. evicted).
        """
        now = float(self.clock())
        with self._lock:
            db = self._conn()
            row = db.execute("SELECT weight, weight_ts FROM graphs WHERE id=?", (graph_id,)).fetchone()
            if row is None:
                raise KeyError(f"no graph with id {graph_id}")
            w = self._effective(row[0], row[1], now) + amount
            db.execute(
                "UPDATE graphs SET weight=?, weight_ts=?, evict_key=?, hits=hits+1 WHERE id=?",
                (w, now, self._key(w, now), graph_id),
            )
        return w

    def decay(self) -> int:
        """Materialise the decayed weights at the current clock (weights are also decayed lazily
        on read, so this only rewrites stored values); returns the number of rows."""
        now = float(self.clock())
        with self._lock:
            db = self._conn()
            rows = db.execute("SELECT id, weight, weight_ts FROM graphs").fetchall()
            db.execute("BEGIN")
            for gid, w, ts in rows:
                ew = self._effective(w, ts, now)
                db.execute("UPDATE graphs SET weight=?, weight_ts=?, evict_key=? WHERE id=?",
                           (ew, now, self._key(ew, now), gid))
            db.execute("COMMIT")
        return len(rows)

    def evict(self, capacity: int | None = None) -> int:
        """Delete the least-used graphs (lowest effective weight, oldest first) beyond ``capacity``
        (default: the store's). Returns the number deleted."""
        return self._evict_beyond(self.capacity if capacity is None else int(capacity))

    def delete_app(self, app: str) -> int:
        """Delete every graph of ``app``; returns the count."""
        with self._lock:
            cur = self._conn().execute("DELETE FROM graphs WHERE app=?", (app,))
            self._gen += 1
            return cur.rowcount

    # ------------------------------------------------------------------ reads
    def _decode(self, row: tuple[Any, ...], now: float) -> StoredGraph:
        gid, app, task, outcome, w, ts, hits, cluster, med, created, data = row
        return StoredGraph(
            id=gid, app=app, graph=PatternGraph.from_bytes(data, app, outcome=outcome, task_id=task),
            weight=self._effective(w, ts, now), hits=hits, cluster=cluster, is_medoid=bool(med), created=created,
        )

    _COLS = "id, app, task_id, outcome, weight, weight_ts, hits, cluster, is_medoid, created, data"

    def get(self, graph_id: int) -> StoredGraph:
        """One stored graph. Raises KeyError if absent."""
        with self._lock:
            row = self._conn().execute(f"SELECT {self._COLS} FROM graphs WHERE id=?", (graph_id,)).fetchone()
        if row is None:
            raise KeyError(f"no graph with id {graph_id}")
        return self._decode(row, float(self.clock()))

    def candidates(self, app: str) -> list[StoredGraph]:
        """All stored graphs of ``app`` (id order), decoded, with effective weights."""
        with self._lock:
            rows = self._conn().execute(f"SELECT {self._COLS} FROM graphs WHERE app=? ORDER BY id", (app,)).fetchall()
        now = float(self.clock())
        return [self._decode(r, now) for r in rows]

    def weight(self, graph_id: int) -> float:
        """Effective reuse weight now. Raises KeyError if absent."""
        with self._lock:
            row = self._conn().execute("SELECT weight, weight_ts FROM graphs WHERE id=?", (graph_id,)).fetchone()
        if row is None:
            raise KeyError(f"no graph with id {graph_id}")
        return self._effective(row[0], row[1], float(self.clock()))

    def ids(self, app: str | None = None) -> list[int]:
        """Stored ids (optionally of one app), ascending."""
        with self._lock:
            if app is None:
                rows = self._conn().execute("SELECT id FROM graphs ORDER BY id").fetchall()
            else:
                rows = self._conn().execute("SELECT id FROM graphs WHERE app=? ORDER BY id", (app,)).fetchall()
        return [r[0] for r in rows]

    def apps(self) -> list[str]:
        """Apps with at least one graph, sorted."""
        with self._lock:
            return [r[0] for r in self._conn().execute("SELECT DISTINCT app FROM graphs ORDER BY app")]

    def count(self, app: str | None = None) -> int:
        """Number of stored graphs (optionally of one app)."""
        with self._lock:
            if app is None:
                return self._conn().execute("SELECT COUNT(*) FROM graphs").fetchone()[0]
            return self._conn().execute("SELECT COUNT(*) FROM graphs WHERE app=?", (app,)).fetchone()[0]

    def typical_stages(self, app: str) -> int | None:
        """Median stage count of ``app`` (rounded up), the fallback ``expected_stages``; None if empty."""
        with self._lock:
            rows = [r[0] for r in self._conn().execute("SELECT n_stages FROM graphs WHERE app=?", (app,))]
        if not rows:
            return None
        return int(math.ceil(float(np.median(rows))))

    def stats(self) -> dict[str, Any]:
        """Per-app summary: count, stage-count histogram, bytes per graph (blob and JSON line),
        weights, clusters; plus totals and the DB file size."""
        now = float(self.clock())
        out: dict[str, Any] = {"path": self.path, "capacity": self.capacity, "apps": {}}
        with self._lock:
            db = self._conn()
            for app in self.apps():
                rows = db.execute(
                    "SELECT n_stages, weight, weight_ts, hits, cluster, is_medoid, length(data) FROM graphs "
                    "WHERE app=?", (app,)).fetchall()
                sample = db.execute(
                    "SELECT task_id, outcome, data FROM graphs WHERE app=? ORDER BY id LIMIT 200", (app,)).fetchall()
                json_bytes = [len(PatternGraph.from_bytes(d, app, outcome=o, task_id=t).to_json().encode())
                              for t, o, d in sample]
                ns = [r[0] for r in rows]
                ws = [self._effective(r[1], r[2], now) for r in rows]
                blob = [r[6] for r in rows]
                hist: dict[str, int] = {}
                for s in ns:
                    hist[str(s)] = hist.get(str(s), 0) + 1
                out["apps"][app] = {
                    "graphs": len(rows),
                    "stages_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
                    "blob_bytes_mean": float(np.mean(blob)),
                    "blob_bytes_max": int(max(blob)),
                    "json_bytes_mean": float(np.mean(json_bytes)) if json_bytes else None,
                    "weight_mean": float(np.mean(ws)),
                    "weight_min": float(min(ws)),
                    "hits_total": int(sum(r[3] for r in rows)),
                    "clusters": len({r[4] for r in rows if r[4] is not None}),
                    "medoids": int(sum(r[5] for r in rows)),
                    "unclustered": int(sum(1 for r in rows if r[4] is None)),
                }
        out["total_graphs"] = sum(a["graphs"] for a in out["apps"].values())
        if self.path != ":memory:":
            size = 0
            for suffix in ("", "-wal", "-shm"):
                p = Path(self.path + suffix)
                if p.exists():
                    size += p.stat().st_size
            out["file_bytes"] = size
        return out

    # ------------------------------------------------------------------ clustering
    def set_clusters(self, app: str, assignment: dict[int, int], medoid_ids: list[int]) -> None:
        """Store one app's clustering in one transaction: ``assignment`` maps graph id -> cluster index;
        ``medoid_ids`` are the medoid graphs (``analyzer/clustering.py`` computes them)."""
        with self._lock:
            db = self._conn()
            db.execute("BEGIN")
            db.execute("UPDATE graphs SET cluster=NULL, is_medoid=0 WHERE app=?", (app,))
            db.executemany("UPDATE graphs SET cluster=? WHERE id=?", [(c, gid) for gid, c in assignment.items()])
            db.executemany("UPDATE graphs SET is_medoid=1 WHERE id=?", [(gid,) for gid in medoid_ids])
            db.execute("COMMIT")
            self._gen += 1
