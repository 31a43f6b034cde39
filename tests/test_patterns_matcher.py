"""Incremental matcher: prefix pruning, Gaussian-kernel scoring, clustered search, ensembles."""

from __future__ import annotations

import numpy as np
import pytest

from jitflow_server.analyzer.clustering import cluster_history
from jitflow_server.analyzer.matcher import KernelParams, Matcher, pack_graphs, pairwise_distances, similarity
from jitflow_server.store.graph import CallNode, PatternGraph
from jitflow_server.store.history import HistoryStore


def chain(app, stages, names=None, model="m"):
    return PatternGraph.from_stage_lengths(app, stages, model=model, stage_names=names)


def random_history(rng, n, app="app"):
    out = []
    for _ in range(n):
        s = int(rng.choice([4, 6]))
        names = ["q"] + ["r", "f"] * ((s - 2) // 2) + ["a"]
        stages = [[(int(rng.integers(10, 6000)), int(rng.integers(1, 1024)))
                   for _ in range(int(rng.integers(1, 4)))] for _ in range(s)]
        out.append(chain(app, stages, names))
    return out


def test_prefix_pruning_drops_divergent_candidates():
    base = [[(400, 50)], [(150, 600)], [(2000, 80)], [(3000, 900)]]
    same = chain("app", base, ["q", "r", "f", "a"])
    other_model = chain("app", base, ["q", "r", "f", "a"], model="other")
    other_name = chain("app", base, ["q", "x", "f", "a"])
    too_short = chain("app", base[:1], ["q"])
    other_app = chain("app2", base, ["q", "r", "f", "a"])
    m = Matcher.from_graphs([other_model, other_name, too_short, other_app, same])
    partial = same.prefix(2, open_next=True)
    res = m.match(partial, top_k=10)
    assert res is not None and res.graph_id == 4
    assert res.n_candidates == 1 and [gid for _, gid, _ in res.neighbours] == [4]
    # a tool call at a seen stage changes the identity: nothing matches
    calls = list(partial.nodes) + [CallNode("t", "tool", "search", duration=1.0, parents=["0.0"], stage=1)]
    assert m.match(PatternGraph.from_calls("app", calls, stage_names=partial.stage_names)) is None
    # more stages seen than any candidate has
    longer = chain("app", base + [[(1, 1)]], ["q", "r", "f", "a", "z"])
    assert Matcher.from_graphs([same]).match(longer) is None


def test_identical_graph_scores_highest():
    rng = np.random.default_rng(1)
    hist = random_history(rng, 60)
    m = Matcher.from_graphs(hist)
    for i in (0, 17, 42):
        g = hist[i]
        for k in range(1, g.n_stages + 1):
            res = m.match(g.prefix(k))
            assert res is not None
            assert res.score == pytest.approx(1.0)
            # any strictly better candidate is impossible; ties must be exact prefix copies
            assert similarity(g.prefix(k), res.graph) == pytest.approx(1.0)
        assert m.match(g).graph_id == i or m.match(g).graph.to_dict()["stages"] == g.to_dict()["stages"]


def test_score_decreases_with_attribute_distance():
    base = chain("app", [[(400, 50)], [(150, 600)]], ["q", "r"])
    near = chain("app", [[(420, 55)], [(150, 600)]], ["q", "r"])
    far = chain("app", [[(4000, 500)], [(150, 600)]], ["q", "r"])
    assert similarity(base, base) == pytest.approx(1.0)
    assert 1.0 > similarity(base, near) > similarity(base, far) > 0.0
    m = Matcher.from_graphs([far, near])
    assert m.match(base).graph_id == 1
    # the shorter graph is compared with the prefix of the longer one
    longer = chain("app", [[(400, 50)], [(150, 600)], [(9999, 9)]], ["q", "r", "z"])
    assert similarity(base, longer) == pytest.approx(1.0)


def test_open_stage_uses_inputs_only():
    a = chain("app", [[(400, 50)], [(150, 600)]], ["q", "r"])
    b = chain("app", [[(400, 50)], [(150, 30)]], ["q", "r"])  # same inputs, different stage-1 output
    c = chain("app", [[(400, 50)], [(1500, 600)]], ["q", "r"])  # different stage-1 input
    m = Matcher.from_graphs([c, a, b])
    res = m.match(a.prefix(1, open_next=True), top_k=3)
    ids = [gid for _, gid, _ in res.neighbours]
    assert ids[-1] == 0  # the input-divergent one ranks last
    assert res.neighbours[0][2] == pytest.approx(res.neighbours[1][2])  # outputs unknown: a and b tie


def test_ensemble_shares_are_monotone_and_end_at_one():
    rng = np.random.default_rng(5)
    hist = random_history(rng, 80)
    m = Matcher.from_graphs(hist, top_k=8)
    res = m.match(hist[3].prefix(1, open_next=True))
    assert len(res.neighbours) == 8
    scores = [s for _, _, s in res.neighbours]
    assert scores == sorted(scores, reverse=True)
    phi = res.shares()
    assert all(b >= a for a, b in zip(phi, phi[1:], strict=False)) and phi[-1] == 1.0
    assert len(phi) == max(g.n_stages for g, _, _ in res.neighbours)


def test_cluster_search_agrees_with_exhaustive_on_exact_copies(tmp_path):
    rng = np.random.default_rng(7)
    hist = random_history(rng, 150)
    with HistoryStore(tmp_path / "h.sqlite") as st:
        st.insert_many(hist)
        res = cluster_history(st, "app", k=8)
        assert res["app"].k == 8
        m = Matcher(st, strategy="cluster", bump=False)
        for i in (2, 50, 120):
            g = hist[i]
            got = m.match(g.prefix(3))
            exh = m.match(g.prefix(3), strategy="exhaustive")
            assert got.score == pytest.approx(1.0) and exh.score == pytest.approx(1.0)
            assert got.n_searched < len(hist)  # only some clusters were searched


def test_pairwise_distance_properties():
    rng = np.random.default_rng(3)
    hist = random_history(rng, 30)
    p = pack_graphs(hist, {})
    d = pairwise_distances(p, kp=KernelParams())
    assert d.shape == (30, 30)
    assert np.allclose(np.diag(d), 0.0, atol=1e-6)
    assert np.allclose(d, d.T, atol=1e-6)
    assert (d >= -1e-6).all() and (d <= 1 + 1e-6).all()


def test_bad_options_and_empty_partial_raise():
    with pytest.raises(ValueError):
        Matcher(strategy="random")
    with pytest.raises(ValueError):
        Matcher(top_k=0)
    with pytest.raises(ValueError):
        KernelParams(sigma_node=0)
    m = Matcher.from_graphs([chain("app", [[(1, 1)]])])
    with pytest.raises(ValueError):
        m.match(PatternGraph("app", []))
    assert m.match(chain("unknown-app", [[(1, 1)]])) is None
