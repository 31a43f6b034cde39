"""The JSON line form of a pattern graph: the format of jitflow's pattern files (``patterns/*.jsonl``,
``jitflow patterns import/export``), documented in ``docs/analyzer.md``.

JSONL line format (version 1)::

    {"v": 1, "app": "deep-research", "task": "17", "outcome": "ok",
     "stages": [
       {"n": "generate_query", "c": [{"k": "llm", "m": "llama3", "i": 436, "o": 99}]},
       {"n": "web_research",   "c": [{"k": "llm", "m": "llama3", "i": 177, "o": 1024, "d": 31.2},
                                     {"k": "tool", "m": "search", "d": 0.8, "p": ["0.0"]}]}
     ]}

Keys of a call: ``k`` kind (``llm`` | ``tool``), ``m`` model or tool id, ``i``/``o`` input and
output length in tokens (LLM calls; ``o`` is ``null`` while a call is still running),
``d`` duration in seconds (optional), ``t`` ``[start, end]`` in seconds relative to the task's
first call (optional), ``p`` parent ids (optional; default: every call of the previous stage).
Node ids are canonical ``"<stage>.<j>"`` (j = position in the stage). ``task``, ``outcome``
and ``meta`` are optional.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from jitflow_server.store.graph import CallNode, PatternFormatError, PatternGraph

__all__ = ["JSON_VERSION", "graph_to_dict", "graph_from_dict", "graph_to_json", "graph_from_json",
           "read_jsonl", "write_jsonl"]

JSON_VERSION = 1


def graph_to_dict(g: PatternGraph) -> dict[str, Any]:
    """The JSON line record of ``g`` (see the module docstring), node ids canonicalised, times rounded
    to 0.1 ms and made relative to the first call's start."""
    canon, _ = g.canonical_ids()
    t0 = g.first_start()
    stages = []
    for st in g.stages:
        calls = []
        default_p = sorted(g.default_parents(st.index))
        for nid in st.node_ids:
            n = g.node(nid)
            c: dict[str, Any] = {"k": n.kind, "m": n.name}
            if n.kind == "llm" or n.input_len:
                c["i"] = n.input_len
            if n.kind == "llm" or n.output_len:
                c["o"] = n.output_len
            if n.duration is not None:
                c["d"] = round(float(n.duration), 4)
            if n.start is not None and n.end is not None and t0 is not None:
                c["t"] = [round(n.start - t0, 4), round(n.end - t0, 4)]
            elif n.start is not None and t0 is not None:
                c["t"] = [round(n.start - t0, 4), None]
            if sorted(n.parents) != default_p:
                c["p"] = [canon[p] for p in n.parents]
            calls.append(c)
        stages.append({"n": st.name, "c": calls})
    d: dict[str, Any] = {"v": JSON_VERSION, "app": g.app}
    if g.task_id is not None:
        d["task"] = g.task_id
    if g.outcome is not None:
        d["outcome"] = g.outcome
    if g.meta:
        d["meta"] = g.meta
    d["stages"] = stages
    return d


def graph_from_dict(d: dict[str, Any]) -> PatternGraph:
    """Parse a JSON line record (inverse of :func:`graph_to_dict`).

    Raises:
        PatternFormatError: not an object, unknown version, missing ``app``/``stages``, an empty stage or
            a malformed call.
    """
    if not isinstance(d, dict):
        raise PatternFormatError("pattern record must be a JSON object")
    v = d.get("v", JSON_VERSION)
    if v != JSON_VERSION:
        raise PatternFormatError(f"unsupported pattern record version {v!r}")
    app = d.get("app")
    stages = d.get("stages")
    if not isinstance(app, str) or not isinstance(stages, list):
        raise PatternFormatError("pattern record needs 'app' (string) and 'stages' (list)")
    nodes: list[CallNode] = []
    names: list[str] = []
    prev: list[str] = []
    try:
        for s, st in enumerate(stages):
            names.append(str(st.get("n", "")))
            calls = st["c"]
            if not isinstance(calls, list) or not calls:
                raise PatternFormatError(f"stage {s}: 'c' must be a non-empty list of calls")
            cur = []
            for j, c in enumerate(calls):
                nid = f"{s}.{j}"
                t = c.get("t")
                start, end = (t[0], t[1]) if isinstance(t, list) and len(t) == 2 else (None, None)
                nodes.append(
                    CallNode(
                        nid, c.get("k", "llm"), c["m"], int(c.get("i", 0) or 0), c.get("o", 0),
                        start=start, end=end, duration=c.get("d"),
                        parents=list(c["p"]) if "p" in c else list(prev), stage=s,
                    )
                )
                cur.append(nid)
            prev = cur
    except (KeyError, TypeError, AttributeError) as e:
        raise PatternFormatError(f"malformed pattern record: {e!r}") from e
    meta = d.get("meta")
    return PatternGraph(app, nodes, names, outcome=d.get("outcome"), task_id=d.get("task"),
                        meta=meta if isinstance(meta, dict) else None)


def graph_to_json(g: PatternGraph) -> str:
    """One compact JSON line (no newline)."""
    return json.dumps(graph_to_dict(g), separators=(",", ":"))


def graph_from_json(line: str) -> PatternGraph:
    """Parse one JSON line. Raises PatternFormatError on invalid JSON or schema."""
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise PatternFormatError(f"invalid JSON: {e}") from e
    return graph_from_dict(d)


def read_jsonl(path: str | Path) -> Iterator[PatternGraph]:
    """Yield the graphs of a jitflow JSONL pattern file (blank lines and ``#`` lines skipped).

    Raises:
        FileNotFoundError: missing file.
        PatternFormatError: bad line (message includes the line number).
    """
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                yield graph_from_json(line)
            except PatternFormatError as e:
                raise PatternFormatError(f"{path}:{lineno}: {e}") from e


def write_jsonl(graphs: Iterable[PatternGraph], fh: Any) -> int:
    """Write graphs one per line to the text file object ``fh``; returns the count."""
    n = 0
    for g in graphs:
        fh.write(graph_to_json(g) + "\n")
        n += 1
    return n
