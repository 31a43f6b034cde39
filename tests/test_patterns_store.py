"""History store: WAL SQLite persistence, reuse-weight decay and bumps, eviction, clustering."""

from __future__ import annotations

import sqlite3

import pytest

from jitflow_server.analyzer.clustering import cluster_history
from jitflow_server.analyzer.matcher import Matcher
from jitflow_server.store.graph import PatternGraph
from jitflow_server.store.history import HistoryStore, HistoryStoreError, default_db_path


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def g(i: int, app: str = "app") -> PatternGraph:
    return PatternGraph.from_stage_lengths(app, [[(100 + i, 10 + i)], [(200 + 3 * i, 50 + i), (7, 9)]],
                                           stage_names=["a", "b"], task_id=str(i), outcome="ok")


def test_store_survives_reopen_in_wal_mode(tmp_path):
    path = tmp_path / "sub" / "h.sqlite"
    clock = Clock()
    with HistoryStore(path, clock=clock) as st:
        ids = st.insert_many([g(i) for i in range(5)])
        st.bump(ids[2])
        cluster_history(st, "app", k=2)
    mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    with HistoryStore(path, clock=clock) as st:
        assert st.count("app") == 5
        back = st.get(ids[3])
        assert back.graph.to_dict()["stages"] == g(3).to_dict()["stages"]
        assert back.graph.task_id == "3" and back.graph.outcome == "ok"
        assert st.weight(ids[2]) == pytest.approx(2.0)
        rows = st.candidates("app")
        assert sum(r.is_medoid for r in rows) == 2 and all(r.cluster is not None for r in rows)


def test_reuse_weight_decays_by_0_9_per_hour_and_bumps_add_one():
    clock = Clock()
    st = HistoryStore(":memory:", clock=clock)
    gid = st.insert(g(0))
    assert st.weight(gid) == pytest.approx(1.0)
    clock.t += 3600
    assert st.weight(gid) == pytest.approx(0.9)
    clock.t += 2 * 3600
    assert st.weight(gid) == pytest.approx(0.9**3)
    assert st.bump(gid) == pytest.approx(0.9**3 + 1)
    clock.t += 1800
    assert st.weight(gid) == pytest.approx((0.9**3 + 1) * 0.9**0.5)
    st.decay()  # materialising does not change the effective weight
    assert st.weight(gid) == pytest.approx((0.9**3 + 1) * 0.9**0.5)
    assert st.get(gid).hits == 1


def test_eviction_removes_the_least_used_beyond_capacity():
    clock = Clock()
    st = HistoryStore(":memory:", capacity=3, clock=clock)
    a = st.insert(g(1))
    clock.t += 3600
    st.insert(g(2))  # "b": evicted first below
    c = st.insert(g(3))
    st.bump(a)  # a: 0.9 + 1 = 1.9 > b, c = 1.0
    clock.t += 3600  # a 1.71, b 0.9, c 0.9 (b older id)
    d = st.insert(g(4))
    assert st.count() == 3
    assert st.ids() == [a, c, d]  # b evicted: lowest weight, oldest on the tie
    clock.t += 10 * 3600  # a: 1.9*0.9^11 ~ 0.60; c: 0.9^11 ~ 0.31; d: 0.9^10 ~ 0.35
    e = st.insert(g(5))
    assert st.ids() == [a, d, e]
    assert st.evict(capacity=1) == 2 and st.ids() == [e]


def test_one_application_cannot_take_more_than_its_share_of_the_store():
    clock = Clock()
    st = HistoryStore(":memory:", capacity=100, app_capacity=5, clock=clock)
    other = [st.insert(g(i, app="alice/chat")) for i in range(3)]
    st.bump(other[0])
    kept = st.insert(g(0, app="mallory/chat"))
    st.bump(kept)
    st.bump(kept)
    for i in range(1, 50):  # one tenant's application floods the store
        clock.t += 1
        st.insert(g(i, app="mallory/chat"))
    assert st.count("mallory/chat") == 5 and kept in st.ids("mallory/chat")  # its own least-used went
    assert st.ids("alice/chat") == other  # the other application's history is untouched
    with pytest.raises(ValueError):
        HistoryStore(":memory:", app_capacity=0)


def test_matcher_bumps_the_match_and_sees_new_inserts():
    clock = Clock()
    st = HistoryStore(":memory:", clock=clock)
    ids = st.insert_many([g(i) for i in range(10)])
    m = Matcher(st)
    res = m.match(g(4).prefix(1, open_next=True))
    assert res.graph_id == ids[4]
    assert st.weight(ids[4]) == pytest.approx(2.0)
    assert st.get(ids[4]).hits == 1
    new = st.insert(g(40))
    assert m.match(g(40)).graph_id == new  # the in-memory index was rebuilt


def test_matcher_sees_writes_from_another_connection(tmp_path):
    path = tmp_path / "h.sqlite"
    st1 = HistoryStore(path)
    st1.insert(g(1))
    m = Matcher(st1, bump=False)
    assert m.match(g(30)).graph.task_id == "1"
    with HistoryStore(path) as st2:
        st2.insert(g(30))
    assert m.match(g(30)).graph.task_id == "30"
    st1.close()


def test_incomplete_graphs_and_bad_arguments_are_rejected(tmp_path):
    st = HistoryStore(":memory:")
    with pytest.raises(ValueError):
        st.insert(g(1).prefix(1, open_next=True))
    with pytest.raises(KeyError):
        st.bump(12345)
    with pytest.raises(ValueError):
        HistoryStore(":memory:", capacity=0)
    with pytest.raises(ValueError):
        HistoryStore(":memory:", decay_per_hour=1.5)
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(HistoryStoreError):
        HistoryStore(bad)
    st.close()
    with pytest.raises(HistoryStoreError):
        st.count()


def test_stats_and_typical_stages():
    st = HistoryStore(":memory:")
    st.insert_many([g(i) for i in range(4)] + [g(9, app="other")])
    s = st.stats()
    assert s["total_graphs"] == 5 and set(s["apps"]) == {"app", "other"}
    assert s["apps"]["app"]["stages_hist"] == {"2": 4}
    assert 0 < s["apps"]["app"]["blob_bytes_mean"] < s["apps"]["app"]["json_bytes_mean"]
    assert st.typical_stages("app") == 2 and st.typical_stages("none") is None


def test_default_path_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JITFLOW_HISTORY_DB", str(tmp_path / "x.sqlite"))
    assert default_db_path() == tmp_path / "x.sqlite"
    monkeypatch.delenv("JITFLOW_HISTORY_DB")
    assert default_db_path().name == "history.sqlite" and ".cache" in str(default_db_path())


def test_every_cache_follows_jitflow_cache(monkeypatch, tmp_path):
    """JITFLOW_CACHE moves every per-user file: the history, the length models, the demo's capacity
    measurement and the simulator's trained predictors (a run with an empty cache must not read ~/.cache)."""
    from jitflow_server.analyzer.length_io import default_model_path
    from jitflow_server.bench.predictor_bounds import predictor_cache_path
    from jitflow_server.demo.options import DemoOptions
    from jitflow_server.engine.demo_model import default_cache_dir

    for var in ("JITFLOW_HISTORY_DB", "JITFLOW_LENGTH_MODEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("JITFLOW_CACHE", str(tmp_path))
    opts = DemoOptions()
    paths = [default_db_path(), default_model_path(), opts.capacity_cache, opts.model_cache, default_cache_dir(),
             predictor_cache_path([], 0.9, _Counter(), {})]
    for p in paths:
        assert p.is_relative_to(tmp_path), p
    monkeypatch.delenv("JITFLOW_CACHE")
    assert not DemoOptions().capacity_cache.is_relative_to(tmp_path)


class _Counter:
    name = "words"
