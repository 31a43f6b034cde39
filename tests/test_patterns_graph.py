"""Pattern-graph model: validation, stages/super-nodes, JSON/binary/networkx round trips, trace loading."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from jitflow_server.analyzer.patterns import deepresearch_stage_names, load_deepresearch
from jitflow_server.store.graph import CallNode, PatternFormatError, PatternGraph
from jitflow_server.store.graph_nx import from_nx, stage_nx, to_nx
from jitflow_server.store.jsonl import read_jsonl, write_jsonl

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
DEEPRESEARCH = DATA / "deepresearch" / "deepresearch_training.json"


def mixed_graph() -> PatternGraph:
    """Stage 0: one LLM call; stage 1: two parallel LLM calls and a search tool that depends on
    one of them (a within-stage chain); stage 2: a final LLM call. Real start/end times."""
    t = 1000.0
    calls = [
        CallNode("q", "llm", "m-small", 400, 50, start=t, end=t + 1.5, stage=0),
        CallNode("a", "llm", "m-big", 150, 600, start=t + 1.6, end=t + 20.0, parents=["q"], stage=1),
        CallNode("b", "llm", "m-big", 160, 300, start=t + 1.6, end=t + 11.0, parents=["q"], stage=1),
        CallNode("s", "tool", "search", 0, 0, start=t + 11.0, end=t + 12.0, duration=1.0, parents=["b"], stage=1),
        CallNode("f", "llm", "m-big", 3000, 800, start=t + 20.5, end=t + 45.0, parents=["a", "s"], stage=2),
    ]
    return PatternGraph.from_calls("app", calls, stage_names=["plan", "research", "answer"], outcome="ok",
                                   task_id="t1", meta={"deadline": 60.0})


def test_stages_are_super_nodes_with_aggregate_weights():
    g = mixed_graph()
    assert g.n_stages == 3
    st = g.stages[1]
    assert st.output_len == 600 + 300  # tools contribute no tokens
    assert st.input_len == 150 + 160
    assert st.n_calls == 3
    assert st.identity == "research|llm:m-big,tool:search"
    sg = stage_nx(g)
    assert sg.nodes[1]["weight"] == 900
    assert sg.edges[0, 1]["weight"] == 310
    assert list(g.arrays.out) == [50.0, 900.0, 800.0]


def test_json_binary_and_networkx_round_trips_preserve_the_graph():
    g = mixed_graph()
    g_json = PatternGraph.from_json(g.to_json())
    assert g_json == g
    blob = g.to_bytes()
    g_bin = PatternGraph.from_bytes(blob, g.app, outcome=g.outcome, task_id=g.task_id)
    assert g_bin.to_dict()["stages"] == g.to_dict()["stages"]
    assert [n.parents for n in g_bin.nodes] == [n.parents for n in g_json.nodes]
    assert len(blob) < len(g.to_json())
    g_nx = from_nx(to_nx(g))
    assert g_nx.to_dict()["stages"] == g.to_dict()["stages"]
    assert to_nx(g).has_edge("b", "s") and not to_nx(g).has_edge("a", "s")


def test_explicit_parents_survive_serialisation():
    g = mixed_graph()
    d = g.to_dict()
    tool = d["stages"][1]["c"][2]
    assert tool["k"] == "tool" and tool["p"] == ["1.1"]  # depends on "b" only
    assert "p" not in d["stages"][1]["c"][0]  # default: all calls of the previous stage


@pytest.mark.parametrize(
    "calls, msg",
    [
        ([CallNode("a", "llm", "m", 1, 1, stage=1)], "contiguous"),
        ([CallNode("a", "llm", "m", 1, 1), CallNode("a", "llm", "m", 1, 1)], "duplicate"),
        ([CallNode("a", "llm", "m", 1, 1, parents=["zz"])], "unknown parent"),
        ([CallNode("a", "llm", "m", 1, 1, parents=["b"]), CallNode("b", "llm", "m", 1, 1, stage=1)], "later stage"),
        ([CallNode("a", "llm", "m", 1, 1, parents=["b"]), CallNode("b", "llm", "m", 1, 1, parents=["a"])], "cycle"),
    ],
)
def test_structural_errors_raise_typed_exceptions(calls, msg):
    with pytest.raises(PatternFormatError, match=msg):
        PatternGraph("app", calls)


def test_bad_nodes_and_records_raise():
    with pytest.raises(PatternFormatError):
        CallNode("a", "gpu", "m")
    with pytest.raises(PatternFormatError):
        CallNode("a", "llm", "m", input_len=-1)
    with pytest.raises(PatternFormatError):
        CallNode("a", "llm", "m", start=5.0, end=4.0)
    with pytest.raises(PatternFormatError):
        PatternGraph.from_json("{not json")
    with pytest.raises(PatternFormatError):
        PatternGraph.from_json(json.dumps({"v": 1, "app": "x", "stages": [{"n": "s", "c": []}]}))
    with pytest.raises(PatternFormatError):
        PatternGraph.from_bytes(b"\x07\x01", "x")
    with pytest.raises(PatternFormatError):
        PatternGraph.from_bytes(mixed_graph().to_bytes()[:-3], "x")


def test_prefix_hides_outputs_of_the_open_stage():
    g = mixed_graph()
    p = g.prefix(1, open_next=True)
    assert p.n_stages == 2 and not p.is_complete
    assert p.stages[1].open and not p.stages[0].open
    assert p.arrays.n_closed == 1
    assert p.stages[1].input_len == g.stages[1].input_len
    assert all(n.output_len is None for n in p.stage_nodes(1) if n.kind == "llm")
    closed = g.prefix(2)
    assert closed.n_stages == 2 and closed.is_complete
    with pytest.raises(ValueError):
        g.prefix(4)


def test_jsonl_file_round_trip(tmp_path):
    gs = [mixed_graph(), PatternGraph.from_stage_lengths("other", [[(10, 5)], [(7, 3), (8, 2)]])]
    buf = io.StringIO()
    assert write_jsonl(gs, buf) == 2
    f = tmp_path / "g.jsonl"
    f.write_text("# comment\n\n" + buf.getvalue())
    back = list(read_jsonl(f))
    assert back == gs
    f.write_text(buf.getvalue() + "{broken\n")
    with pytest.raises(PatternFormatError, match=":3:"):
        list(read_jsonl(f))


def test_deepresearch_stage_names_follow_the_readme_reading():
    assert deepresearch_stage_names(4) == ["generate_query", "web_research", "reflection", "final_answer"]
    assert deepresearch_stage_names(6)[3:] == ["web_research", "reflection", "final_answer"]
    with pytest.raises(ValueError):
        deepresearch_stage_names(0)


@pytest.mark.data
def test_deepresearch_trace_loads_compactly():
    if not DEEPRESEARCH.is_file():
        pytest.skip("../shared/data not available")
    gs = load_deepresearch(DEEPRESEARCH)
    raw = json.loads(DEEPRESEARCH.read_text())
    assert len(gs) == len(raw)
    assert sum(len(g.nodes) for g in gs) == sum(len(s["requests"]) for r in raw for s in r["stages"])
    sizes = [len(g.to_bytes()) for g in gs]
    assert max(sizes) < 200  # the paper: < 0.2 KB per graph
    assert {g.n_stages for g in gs} <= {4, 6}
    assert all(g.stage_names[-1] == "final_answer" for g in gs)
