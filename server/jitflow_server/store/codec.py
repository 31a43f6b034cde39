"""The compact binary form of a pattern graph: the history store's BLOB (typically 60-130 bytes for a
deep-research task; JITServe reports < 0.2 KB per graph). ``PatternGraph.to_bytes``/``from_bytes``
call these functions.
"""

from __future__ import annotations

import struct

from jitflow_server.store.graph import CallNode, PatternFormatError, PatternGraph

__all__ = ["BIN_VERSION", "encode_graph", "decode_graph"]

BIN_VERSION = 1


def _varint(n: int) -> bytes:
    out = bytearray()
    n = int(n)
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = 0
    val = 0
    while True:
        if pos >= len(buf):
            raise PatternFormatError("truncated pattern blob (varint)")
        b = buf[pos]
        pos += 1
        val |= (b & 0x7F) << shift
        if not b & 0x80:
            return val, pos
        shift += 7
        if shift > 63:
            raise PatternFormatError("corrupt pattern blob (varint too long)")


def encode_graph(g: PatternGraph) -> bytes:
    """Compact binary form (the history store's BLOB; app/outcome/task are stored beside it).

    Layout: ``u8 version, u8 S, varint n_nodes``; string table ``u8 count`` then
    ``u8 len + utf-8`` each; ``S`` stage-name indices (u8); per node ``u8 stage, u8 flags,
    u8 name index, varint input_len, varint output_len`` then optionally ``f32 duration``,
    ``f32 start, f32 end`` (relative to the first start), ``u8 n + varint`` parent
    positions. flags: bit0 tool, bit1 duration, bit2 start/end, bit3 explicit parents,
    bit4 output unknown, bit5 start only.

    Raises:
        PatternFormatError: more than 255 stages or distinct strings, or a string > 255 bytes.
    """
    strings: list[str] = []
    sidx: dict[str, int] = {}

    def intern(x: str) -> int:
        if x not in sidx:
            sidx[x] = len(strings)
            strings.append(x)
        return sidx[x]

    name_idx = [intern(s) for s in g.stage_names]
    _, pos = g.canonical_ids()
    t0 = g.first_start()
    body = bytearray()
    for st in g.stages:
        default_p = sorted(g.default_parents(st.index))
        for nid in st.node_ids:
            n = g.node(nid)
            flags = 0
            if n.kind == "tool":
                flags |= 1
            if n.duration is not None:
                flags |= 2
            if n.start is not None and n.end is not None and t0 is not None:
                flags |= 4
            elif n.start is not None and t0 is not None:
                flags |= 32
            explicit = sorted(n.parents) != default_p
            if explicit:
                flags |= 8
            if n.output_len is None:
                flags |= 16
            body += bytes((n.stage, flags, intern(n.name)))
            body += _varint(n.input_len) + _varint(n.output_len or 0)
            if flags & 2:
                body += struct.pack("<f", n.duration)
            if flags & 4:
                body += struct.pack("<ff", n.start - t0, n.end - t0)
            if flags & 32:
                body += struct.pack("<f", n.start - t0)
            if explicit:
                body += bytes((len(n.parents),)) + b"".join(_varint(pos[p]) for p in n.parents)
    if g.n_stages > 255 or len(strings) > 255:
        raise PatternFormatError("binary form supports at most 255 stages and 255 distinct names")
    head = bytearray((BIN_VERSION, g.n_stages)) + _varint(len(g.nodes)) + bytes((len(strings),))
    for x in strings:
        b = x.encode()
        if len(b) > 255:
            raise PatternFormatError(f"name too long for binary form: {x[:40]!r}...")
        head += bytes((len(b),)) + b
    head += bytes(name_idx)
    return bytes(head + body)


def decode_graph(blob: bytes, app: str, *, outcome: str | None = None, task_id: str | None = None) -> PatternGraph:
    """Inverse of :func:`encode_graph` (times come back relative to the first call, float32).

    Raises:
        PatternFormatError: truncated or corrupt blob, unknown version.
    """
    try:
        if not blob or blob[0] != BIN_VERSION:
            raise PatternFormatError("unknown pattern blob version")
        n_stages = blob[1]
        n_nodes, p = _read_varint(blob, 2)
        n_str = blob[p]
        p += 1
        strings = []
        for _ in range(n_str):
            ln = blob[p]
            strings.append(blob[p + 1 : p + 1 + ln].decode())
            p += 1 + ln
        names = [strings[i] for i in blob[p : p + n_stages]]
        p += n_stages
        nodes: list[CallNode] = []
        stage_ids: list[list[str]] = [[] for _ in range(n_stages)]
        ids: list[str] = []
        for _ in range(n_nodes):
            stage, flags, ni = blob[p], blob[p + 1], blob[p + 2]
            p += 3
            i_len, p = _read_varint(blob, p)
            o_len, p = _read_varint(blob, p)
            dur = start = end = None
            if flags & 2:
                (dur,) = struct.unpack_from("<f", blob, p)
                p += 4
            if flags & 4:
                start, end = struct.unpack_from("<ff", blob, p)
                p += 8
            if flags & 32:
                (start,) = struct.unpack_from("<f", blob, p)
                p += 4
            if flags & 8:
                cnt = blob[p]
                p += 1
                parents = []
                for _ in range(cnt):
                    q, p = _read_varint(blob, p)
                    parents.append(ids[q])
            else:
                parents = list(stage_ids[stage - 1]) if stage > 0 else []
            nid = f"{stage}.{len(stage_ids[stage])}"
            stage_ids[stage].append(nid)
            ids.append(nid)
            nodes.append(
                CallNode(nid, "tool" if flags & 1 else "llm", strings[ni], i_len,
                         None if flags & 16 else o_len, start, end, dur, parents, stage)
            )
    except (IndexError, struct.error, UnicodeDecodeError) as e:
        raise PatternFormatError(f"corrupt pattern blob: {e!r}") from e
    return PatternGraph(app, nodes, names, outcome=outcome, task_id=task_id)
