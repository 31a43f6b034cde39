"""Pattern graphs of compound requests (JITServe §4.1, Fig. 6; Tempo §4.1 super-nodes): the data model
the history store keeps and the analyzer matches.

A *pattern graph* records one compound task without any prompt text: every node is
an LLM call (model id, input length, output length, start/end or duration) or a
tool call (tool id, execution time); edges are dependencies; calls are grouped into
*stages* (Tempo's super-nodes). A stage's weight is its aggregate output length and
the edge into it is weighted by the stage's total input length.

This module holds the model: :class:`PatternGraph` (nodes + stages, validated on creation),
its :class:`Stage` super-nodes and :attr:`PatternGraph.arrays`, the compact numpy form used for
fast scoring (:class:`StageArrays`, one entry per stage). Its other forms live beside it:

* ``store/jsonl.py`` -- the JSON line format of jitflow's pattern files (``patterns/*.jsonl``,
  ``jitflow patterns import/export``; :meth:`PatternGraph.to_json`, ``read_jsonl``, ``write_jsonl``);
* ``store/codec.py`` -- the compact binary form kept by the history store (:meth:`PatternGraph.to_bytes`);
* ``store/graph_nx.py`` -- networkx views (the call graph and the chain of super-nodes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "CallNode",
    "Stage",
    "StageArrays",
    "PatternGraph",
    "PatternFormatError",
]

KINDS = ("llm", "tool")
#: Model label of token-only traces (the deep-research trace records no model per call).
DEEPRESEARCH_MODEL = "llama3-8b"


class PatternFormatError(ValueError):
    """A pattern graph (object, JSON line, binary blob or trace record) is malformed."""


@dataclass
class CallNode:
    """One LLM or tool call of a compound task.

    Attributes:
        node_id: unique id inside the task (any string; canonicalised to ``"<stage>.<j>"``
            on serialisation).
        kind: ``"llm"`` or ``"tool"``.
        name: model id (LLM) or tool id (tool).
        input_len: prompt length in tokens (0 for tools).
        output_len: generated tokens; ``None`` while the call is still running (a
            *partial* graph's open stage).
        start, end: absolute or task-relative wall-clock times in seconds, or ``None``.
        duration: execution time in seconds, or ``None`` (then ``end - start`` if both known).
        parents: ids of the calls this call depends on.
        stage: 0-based stage index (calls in one stage run in parallel).

    Raises:
        PatternFormatError: unknown kind, negative lengths/times, ``end < start``, ``stage < 0``.
    """

    node_id: str
    kind: str
    name: str
    input_len: int = 0
    output_len: int | None = 0
    start: float | None = None
    end: float | None = None
    duration: float | None = None
    parents: list[str] = field(default_factory=list)
    stage: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PatternFormatError(f"node {self.node_id!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.name, str) or not self.name:
            raise PatternFormatError(f"node {self.node_id!r}: name (model/tool id) must be a non-empty string")
        if int(self.stage) < 0:
            raise PatternFormatError(f"node {self.node_id!r}: stage must be >= 0, got {self.stage}")
        self.stage = int(self.stage)
        if self.input_len is None or int(self.input_len) < 0:
            raise PatternFormatError(f"node {self.node_id!r}: input_len must be >= 0")
        self.input_len = int(self.input_len)
        if self.output_len is not None:
            if int(self.output_len) < 0:
                raise PatternFormatError(f"node {self.node_id!r}: output_len must be >= 0")
            self.output_len = int(self.output_len)
        if self.duration is not None and (not math.isfinite(self.duration) or self.duration < 0):
            raise PatternFormatError(f"node {self.node_id!r}: duration must be a finite value >= 0")
        if self.start is not None and self.end is not None and self.end < self.start:
            raise PatternFormatError(f"node {self.node_id!r}: end ({self.end}) < start ({self.start})")
        self.parents = [str(p) for p in self.parents]

    @property
    def finished(self) -> bool:
        """True when the call's result is known (tools are always considered finished)."""
        return self.kind == "tool" or self.output_len is not None

    def exec_time(self) -> float | None:
        """Recorded execution time in seconds: ``duration``, else ``end - start``, else ``None``."""
        if self.duration is not None:
            return float(self.duration)
        if self.start is not None and self.end is not None:
            return float(self.end - self.start)
        return None


@dataclass(frozen=True)
class Stage:
    """A super-node: the calls of one stage (Tempo §4.1).

    Attributes:
        index: 0-based stage index.
        name: stage name given by the application (``""`` if unnamed).
        node_ids: ids of the calls in this stage, in order.
        identity: ``"<name>|<kind>:<id>,..."`` -- stage name plus the sorted *set* of
            model/tool ids; two graphs' prefixes agree iff their identities agree stage by stage.
        output_len: super-node weight, aggregate output tokens of the LLM calls (finished ones).
        input_len: weight of the edge into the stage, total input tokens of its LLM calls.
        n_calls: number of calls (fan-out).
        open: True if some LLM call of the stage has not finished (output unknown).
    """

    index: int
    name: str
    node_ids: tuple[str, ...]
    identity: str
    output_len: int
    input_len: int
    n_calls: int
    open: bool


@dataclass(frozen=True)
class StageArrays:
    """Compact per-stage numpy form of a pattern graph, used for scoring.

    All arrays have shape ``(S,)`` with ``S`` the number of stages.

    Attributes:
        identity: tuple of stage identity strings (see :class:`Stage`).
        out: aggregate output tokens per stage (float64; ``nan`` for an open stage).
        inp: aggregate input tokens per stage (float64).
        n_calls: fan-out per stage (int32).
        open: bool per stage.
    """

    identity: tuple[str, ...]
    out: np.ndarray
    inp: np.ndarray
    n_calls: np.ndarray
    open: np.ndarray

    @property
    def n_stages(self) -> int:
        """Number of stages ``S``."""
        return len(self.identity)

    @property
    def n_closed(self) -> int:
        """Number of leading stages whose outputs are all known."""
        k = 0
        for o in self.open:
            if o:
                break
            k += 1
        return k


class PatternGraph:
    """One compound task's pattern graph (JITServe §4.1, Fig. 6).

    Args:
        app: application name (matching is restricted to graphs of the same app).
        nodes: the calls (:class:`CallNode`); stages must be contiguous ``0..S-1``, each
            non-empty; parents must exist and the dependency graph must be acyclic with
            no edge going to an earlier stage.
        stage_names: optional name per stage (length ``S``); default ``""`` for each.
        outcome: optional outcome label (e.g. ``"ok"``, ``"missed"``, ``"error"``).
        task_id: optional id of the task.
        meta: optional small JSON-able dict (e.g. ``{"deadline": 120.0}``).

    Raises:
        PatternFormatError: on any structural error above.
    """

    __slots__ = ("app", "nodes", "stage_names", "outcome", "task_id", "meta", "_stages", "_arrays", "_by_id")

    def __init__(
        self,
        app: str,
        nodes: Sequence[CallNode],
        stage_names: Sequence[str] | None = None,
        outcome: str | None = None,
        task_id: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(app, str) or not app:
            raise PatternFormatError("app must be a non-empty string")
        self.app = app
        self.nodes: list[CallNode] = list(nodes)
        self.outcome = outcome
        self.task_id = None if task_id is None else str(task_id)
        self.meta = dict(meta or {})
        self._by_id: dict[str, CallNode] = {}
        for n in self.nodes:
            if not isinstance(n, CallNode):
                raise PatternFormatError(f"nodes must be CallNode instances, got {type(n).__name__}")
            if n.node_id in self._by_id:
                raise PatternFormatError(f"duplicate node id {n.node_id!r}")
            self._by_id[n.node_id] = n
        n_stages = 1 + max((n.stage for n in self.nodes), default=-1)
        present = {n.stage for n in self.nodes}
        missing = [s for s in range(n_stages) if s not in present]
        if missing:
            raise PatternFormatError(f"stages must be contiguous from 0; empty stage(s) {missing}")
        if stage_names is None:
            stage_names = [""] * n_stages
        stage_names = [str(s) for s in stage_names]
        if len(stage_names) != n_stages:
            raise PatternFormatError(f"{len(stage_names)} stage names for {n_stages} stages")
        self.stage_names: list[str] = stage_names
        for n in self.nodes:
            for p in n.parents:
                if p not in self._by_id:
                    raise PatternFormatError(f"node {n.node_id!r}: unknown parent {p!r}")
                if self._by_id[p].stage > n.stage:
                    raise PatternFormatError(f"node {n.node_id!r} (stage {n.stage}) depends on later stage node {p!r}")
        self._check_acyclic()
        self._stages: list[Stage] | None = None
        self._arrays: StageArrays | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_calls(
        cls,
        app: str,
        calls: Iterable[CallNode],
        *,
        stage_names: Sequence[str] | None = None,
        outcome: str | None = None,
        task_id: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> PatternGraph:
        """Build a (possibly partial) graph from the calls seen so far.

        Calls are ordered by ``(stage, start or +inf, input order)``. ``stage_names`` may be
        longer than the number of stages seen (it is truncated). Calls of the last stage may
        have ``output_len=None`` (still running): the stage is then *open* and the matcher
        uses only its identity and input lengths.

        Raises:
            PatternFormatError: see :class:`PatternGraph`.
        """
        calls = list(calls)
        order = sorted(
            range(len(calls)),
            key=lambda i: (calls[i].stage, calls[i].start if calls[i].start is not None else math.inf, i),
        )
        nodes = [calls[i] for i in order]
        n_stages = 1 + max((n.stage for n in nodes), default=-1)
        names = None if stage_names is None else list(stage_names)[:n_stages]
        if names is not None and len(names) < n_stages:
            names = names + [""] * (n_stages - len(names))
        return cls(app, nodes, names, outcome=outcome, task_id=task_id, meta=meta)

    @classmethod
    def from_stage_lengths(
        cls,
        app: str,
        stages: Sequence[Sequence[tuple[int, int]]],
        *,
        model: str = DEEPRESEARCH_MODEL,
        stage_names: Sequence[str] | None = None,
        outcome: str | None = None,
        task_id: str | None = None,
    ) -> PatternGraph:
        """Build a token-only graph: ``stages[s]`` is a list of ``(input_len, output_len)`` LLM calls.

        Every call of stage ``s`` depends on all calls of stage ``s-1`` (sequential stages,
        parallel fan-out inside a stage), no times are recorded.

        Raises:
            PatternFormatError: empty stage or negative lengths.
        """
        nodes: list[CallNode] = []
        prev: list[str] = []
        for s, calls in enumerate(stages):
            if len(calls) == 0:
                raise PatternFormatError(f"stage {s} has no calls")
            cur = []
            for j, (i_len, o_len) in enumerate(calls):
                nid = f"{s}.{j}"
                nodes.append(CallNode(nid, "llm", model, int(i_len), int(o_len), parents=list(prev), stage=s))
                cur.append(nid)
            prev = cur
        return cls(app, nodes, stage_names, outcome=outcome, task_id=task_id)

    def _check_acyclic(self) -> None:
        # Kahn's algorithm on the (small) call graph.
        indeg = {n.node_id: len(set(n.parents)) for n in self.nodes}
        children: dict[str, list[str]] = {n.node_id: [] for n in self.nodes}
        for n in self.nodes:
            for p in set(n.parents):
                children[p].append(n.node_id)
        ready = [k for k, d in indeg.items() if d == 0]
        seen = 0
        while ready:
            k = ready.pop()
            seen += 1
            for c in children[k]:
                indeg[c] -= 1
                if indeg[c] == 0:
                    ready.append(c)
        if seen != len(self.nodes):
            raise PatternFormatError("dependency cycle among calls")

    # ------------------------------------------------------------------ views
    @property
    def n_stages(self) -> int:
        """Number of stages ``S`` (including an open last stage)."""
        return len(self.stage_names)

    def node(self, node_id: str) -> CallNode:
        """The call with id ``node_id``. Raises KeyError if absent."""
        return self._by_id[node_id]

    @property
    def stages(self) -> list[Stage]:
        """The super-nodes, one :class:`Stage` per stage index."""
        if self._stages is None:
            groups: list[list[CallNode]] = [[] for _ in range(self.n_stages)]
            for n in self.nodes:
                groups[n.stage].append(n)
            out = []
            for s, g in enumerate(groups):
                ids = sorted({f"{n.kind}:{n.name}" for n in g})
                llm = [n for n in g if n.kind == "llm"]
                out.append(
                    Stage(
                        index=s,
                        name=self.stage_names[s],
                        node_ids=tuple(n.node_id for n in g),
                        identity=self.stage_names[s] + "|" + ",".join(ids),
                        output_len=sum(int(n.output_len or 0) for n in llm),
                        input_len=sum(n.input_len for n in llm),
                        n_calls=len(g),
                        open=any(not n.finished for n in g),
                    )
                )
            self._stages = out
        return self._stages

    def stage_nodes(self, s: int) -> list[CallNode]:
        """The calls of stage ``s`` (IndexError if out of range)."""
        return [self._by_id[i] for i in self.stages[s].node_ids]

    @property
    def arrays(self) -> StageArrays:
        """Compact numpy form (:class:`StageArrays`), cached."""
        if self._arrays is None:
            st = self.stages
            out = np.array([np.nan if x.open else float(x.output_len) for x in st], dtype=np.float64)
            self._arrays = StageArrays(
                identity=tuple(x.identity for x in st),
                out=out,
                inp=np.array([float(x.input_len) for x in st], dtype=np.float64),
                n_calls=np.array([x.n_calls for x in st], dtype=np.int32),
                open=np.array([x.open for x in st], dtype=bool),
            )
        return self._arrays

    @property
    def is_complete(self) -> bool:
        """True if no call is still running."""
        return all(n.finished for n in self.nodes)

    def total_tokens(self) -> tuple[int, int]:
        """``(total input tokens, total output tokens)`` over the LLM calls (finished outputs only)."""
        return (
            sum(n.input_len for n in self.nodes if n.kind == "llm"),
            sum(int(n.output_len or 0) for n in self.nodes if n.kind == "llm"),
        )

    def prefix(self, k: int, *, open_next: bool = False) -> PatternGraph:
        """The partial graph a server would see after ``k`` finished stages.

        Args:
            k: number of complete stages to keep (``0 <= k <= S``).
            open_next: also include stage ``k`` (if it exists) with its calls' identities and
                input lengths but outputs and times hidden (the calls have just been issued).

        Raises:
            ValueError: ``k`` out of range.
        """
        if not 0 <= k <= self.n_stages:
            raise ValueError(f"prefix length {k} outside [0, {self.n_stages}]")
        keep = k + (1 if open_next and k < self.n_stages else 0)
        nodes = []
        for n in self.nodes:
            if n.stage < k:
                nodes.append(CallNode(**{**n.__dict__, "parents": list(n.parents)}))
            elif n.stage < keep:
                # just issued: identity and input known; LLM output and all times unknown
                nodes.append(
                    CallNode(
                        n.node_id, n.kind, n.name, n.input_len, None if n.kind == "llm" else n.output_len,
                        start=n.start, end=None, duration=None, parents=list(n.parents), stage=n.stage,
                    )
                )
        return PatternGraph(self.app, nodes, self.stage_names[:keep], outcome=None, task_id=self.task_id)

    # ------------------------------------------------------------------ serialisation helpers
    def canonical_ids(self) -> tuple[dict[str, str], dict[str, int]]:
        """Map node id -> canonical id ``"<stage>.<j>"`` (j = position in the stage) and node id ->
        position in stage order (the ids the JSON and binary forms use)."""
        canon: dict[str, str] = {}
        pos: dict[str, int] = {}
        i = 0
        for st in self.stages:
            for j, nid in enumerate(st.node_ids):
                canon[nid] = f"{st.index}.{j}"
                pos[nid] = i
                i += 1
        return canon, pos

    def first_start(self) -> float | None:
        """Earliest recorded call start (seconds), the origin of serialised times; ``None`` if no call has one."""
        starts = [n.start for n in self.nodes if n.start is not None]
        return min(starts) if starts else None

    def default_parents(self, s: int) -> list[str]:
        """Parents a call of stage ``s`` has unless given explicitly: every call of stage ``s - 1``."""
        return [] if s == 0 else list(self.stages[s - 1].node_ids)

    def to_dict(self) -> dict[str, Any]:
        """The JSON line record: see :func:`jitflow_server.store.jsonl.graph_to_dict`."""
        from jitflow_server.store.jsonl import graph_to_dict

        return graph_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PatternGraph:
        """Inverse of :meth:`to_dict`: see :func:`jitflow_server.store.jsonl.graph_from_dict`."""
        from jitflow_server.store.jsonl import graph_from_dict

        return graph_from_dict(d)

    def to_json(self) -> str:
        """One compact JSON line (no newline) in the format of ``store/jsonl.py``."""
        from jitflow_server.store.jsonl import graph_to_json

        return graph_to_json(self)

    @classmethod
    def from_json(cls, line: str) -> PatternGraph:
        """Parse one JSON line. Raises PatternFormatError on invalid JSON or schema."""
        from jitflow_server.store.jsonl import graph_from_json

        return graph_from_json(line)

    def to_bytes(self) -> bytes:
        """Compact binary form (the history store's BLOB): see :func:`jitflow_server.store.codec.encode_graph`."""
        from jitflow_server.store.codec import encode_graph

        return encode_graph(self)

    @classmethod
    def from_bytes(
        cls, blob: bytes, app: str, *, outcome: str | None = None, task_id: str | None = None
    ) -> PatternGraph:
        """Inverse of :meth:`to_bytes`: see :func:`jitflow_server.store.codec.decode_graph`."""
        from jitflow_server.store.codec import decode_graph

        return decode_graph(blob, app, outcome=outcome, task_id=task_id)

    def __repr__(self) -> str:
        return (f"PatternGraph(app={self.app!r}, task={self.task_id!r}, stages={self.n_stages}, "
                f"calls={len(self.nodes)}, outcome={self.outcome!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PatternGraph):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]
