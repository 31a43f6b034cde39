"""networkx views of a pattern graph (JITServe §4.1, Fig. 6; Tempo §4.1 super-nodes): the call graph and
the chain of super-nodes, for inspection and plots (the matcher scores :attr:`PatternGraph.arrays`)."""

from __future__ import annotations

from typing import Any

import networkx as nx

from jitflow_server.store.graph import CallNode, PatternGraph

__all__ = ["to_nx", "from_nx", "stage_nx"]


def to_nx(g: PatternGraph) -> nx.DiGraph:
    """The call graph as a :class:`networkx.DiGraph`.

    Node attributes: ``kind, name, input_len, output_len, start, end, duration, stage``;
    an edge ``p -> c`` for each parent ``p`` of ``c``; graph attributes ``app, outcome,
    task_id, stage_names``.
    """
    out = nx.DiGraph(app=g.app, outcome=g.outcome, task_id=g.task_id, stage_names=list(g.stage_names))
    for n in g.nodes:
        out.add_node(
            n.node_id, kind=n.kind, name=n.name, input_len=n.input_len, output_len=n.output_len,
            start=n.start, end=n.end, duration=n.duration, stage=n.stage,
        )
    for n in g.nodes:
        for p in n.parents:
            out.add_edge(p, n.node_id)
    return out


def from_nx(d: nx.DiGraph) -> PatternGraph:
    """Inverse of :func:`to_nx` (parents are the in-edges). Raises PatternFormatError."""
    nodes = []
    for nid, a in d.nodes(data=True):
        nodes.append(
            CallNode(
                str(nid), a.get("kind", "llm"), a.get("name", ""), a.get("input_len", 0),
                a.get("output_len", 0), a.get("start"), a.get("end"), a.get("duration"),
                [str(p) for p in d.predecessors(nid)], a.get("stage", 0),
            )
        )
    return PatternGraph.from_calls(
        d.graph.get("app", ""), nodes, stage_names=d.graph.get("stage_names"),
        outcome=d.graph.get("outcome"), task_id=d.graph.get("task_id"),
    )


def stage_nx(g: PatternGraph) -> nx.DiGraph:
    """Super-node chain (Tempo §4.1): nodes ``0..S-1`` with ``weight`` = aggregate output
    tokens and ``identity``; edges ``s-1 -> s`` (and ``"in" -> 0``) with ``weight`` = total
    input tokens of stage ``s``."""
    out = nx.DiGraph(app=g.app)
    out.add_node("in", weight=0, identity="")
    prev: Any = "in"
    for st in g.stages:
        out.add_node(st.index, weight=st.output_len, identity=st.identity, n_calls=st.n_calls, open=st.open)
        out.add_edge(prev, st.index, weight=st.input_len)
        prev = st.index
    return out
