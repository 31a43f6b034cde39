"""Unit tests of the example apps' pure parts (no server): Game-of-24 rules, schemas, BM25 search,
JSON fallback, error unwrapping and CLI argument checks; what the apps send, against the SDK's
``FakeServer`` transport."""

from __future__ import annotations

import json
import random
import re
import socket
from fractions import Fraction
from pathlib import Path

import anyio
import pytest
from examples._common import clamp_items, jitflow_error, parse_json_object
from examples.deep_research.agent import ResearchConfig, query_schema, reflection_schema, run_research
from examples.deep_research.search import SearchIndex, default_index, tokenize
from examples.tree_of_thoughts.agent import ToTConfig, propose_schema, run_tot, value_schema
from examples.tree_of_thoughts.game24 import TARGET, initial_state, legal_moves, solve

import jitflow
from conftest_sdk import FakeServer

REPO = Path(__file__).resolve().parents[1]


def _eval_expr(expr: str) -> Fraction:
    return eval(re.sub(r"(\d+)", r"F(\1)", expr), {"F": Fraction})


def test_game24_moves_are_consistent_with_their_expressions():
    rng = random.Random(3)
    for _ in range(100):
        nums = [rng.randint(1, 13) for _ in range(4)]
        st = initial_state(nums)
        while len(st.numbers) > 1:
            moves = legal_moves(st)
            assert moves, st
            assert len({m.line for m in moves}) == len(moves)
            m = rng.choice(moves)
            assert len(m.state.numbers) == len(st.numbers) - 1
            assert m.state.steps[-1] == m.line
            assert all(x >= 0 for x in m.state.numbers)
            st = m.state
        assert _eval_expr(st.expression) == st.numbers[0]
        assert st.solved == (st.numbers[0] == TARGET)


def test_game24_solve_and_validation():
    for nums in ([4, 9, 10, 13], [3, 3, 8, 8], [1, 2, 3, 4]):
        expr = solve(nums)
        assert expr is not None and _eval_expr(expr) == 24
        assert sorted(int(x) for x in re.findall(r"\d+", expr)) == sorted(nums)
    assert solve([1, 1, 1, 1]) is None
    for bad in ([1], [0, 1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [1.5, 2, 3, 4]):
        with pytest.raises(ValueError):
            initial_state(bad)


def test_propose_schema_lists_exactly_the_legal_moves():
    st = initial_state([4, 9, 10, 13])
    lines = [m.line for m in legal_moves(st)]
    assert "13 - 9 = 4 (left: 4 4 10)" in lines
    sch = propose_schema(lines, 3)["properties"]["steps"]
    assert sch["items"]["enum"] == lines and sch["minItems"] == sch["maxItems"] == 3
    assert propose_schema(lines[:2], 5)["properties"]["steps"]["maxItems"] == 2
    assert value_schema(40)["properties"]["verdict"]["enum"] == ["sure", "likely", "impossible"]
    q = query_schema(3, 50)["properties"]["query"]
    assert q["maxItems"] == 3 and q["items"]["maxLength"] == 50
    r = reflection_schema(2, 40)
    assert set(r["required"]) == {"is_sufficient", "knowledge_gap", "follow_up_queries"}


def test_configs_reject_bad_values():
    with pytest.raises(ValueError):
        ResearchConfig(max_loops=0)
    with pytest.raises(ValueError):
        ResearchConfig(search_latency=-1)
    with pytest.raises(ValueError):
        ToTConfig(k=0)


def test_bm25_search_ranks_the_relevant_document_first(tmp_path):
    idx = default_index()
    assert len(idx) >= 30
    assert idx.search("Why is the sky blue? Rayleigh scattering")[0].doc.id == "sky-blue"
    assert idx.search("Game of 24 arithmetic puzzle", k=1)[0].doc.id == "game-of-24"
    hits = idx.search("KV cache memory paged attention", k=3)
    assert hits[0].doc.id == "kv-cache" and [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert idx.search("the of and") == []
    with pytest.raises(ValueError):
        idx.search("x", k=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "title": "t"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        SearchIndex(bad)
    assert tokenize("What is the KV-cache?") == ["kv", "cache"]


def test_json_fallback_and_helpers():
    assert parse_json_object('{"a": 1}', {"a": 0}) == ({"a": 1}, True)
    default = {"q": ["x"]}
    for text in ('{"a": ', "[1, 2]", "", None):
        data, ok = parse_json_object(text, default)
        assert data == default and not ok and data is not default
    assert clamp_items(["a", "", "a", "b", 3, "c"], 2) == ["a", "b"]


def _group_from_task_group(*excs: BaseException) -> BaseException:
    """The exception an anyio task group raises when its children raise ``excs``."""
    import anyio

    async def fail(e: BaseException) -> None:
        raise e

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for e in excs:
                tg.start_soon(fail, e)

    try:
        anyio.run(main)
    except BaseException as got:  # noqa: BLE001 - returned for inspection
        return got
    raise AssertionError("task group did not raise")


def test_jitflow_error_unwraps_exception_groups():
    e = jitflow.DeadlineExceededError("t", "app", 1.0, 2.0, "s")
    assert jitflow_error(e) is e
    conn = jitflow.APIConnectionError("down")
    assert jitflow_error(_group_from_task_group(conn, e)) is e
    assert jitflow_error(_group_from_task_group(conn)) is conn
    assert jitflow_error(_group_from_task_group(conn, KeyError("bug"))) is None
    assert jitflow_error(KeyError("bug")) is None


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_cli_bad_arguments_and_unreachable_server(capsys):
    from examples.deep_research.__main__ import main as dr_main
    from examples.tree_of_thoughts.__main__ import main as tot_main

    for argv in (["--numbers", "1", "--deadline", "5"], ["--deadline", "-1"], ["--k", "0"]):
        with pytest.raises(SystemExit) as ei:
            tot_main(argv)
        assert ei.value.code == 2
    with pytest.raises(SystemExit) as ei:
        dr_main(["q", "--deadline", "0"])
    assert ei.value.code == 2
    with pytest.raises(SystemExit) as ei:
        dr_main(["why?", "--server", _dead_url()])
    assert ei.value.code == 2
    assert "cannot reach" in capsys.readouterr().err


def test_corpus_file_is_valid_jsonl():
    path = REPO / "examples" / "deep_research" / "corpus.jsonl"
    ids = [json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()]
    assert len(ids) == len(set(ids))


def test_pattern_corpora_load_and_use_the_apps_stage_names():
    from jitflow_server.store.jsonl import read_jsonl

    dr = list(read_jsonl(REPO / "patterns" / "deep-research.jsonl"))
    tot = list(read_jsonl(REPO / "patterns" / "tree-of-thoughts.jsonl"))
    assert len(dr) >= 20 and len(tot) >= 20
    for g in dr:
        assert g.app == "deep-research" and g.n_stages in (4, 6)
        assert g.stage_names[0] == "generate_query" and g.stage_names[-1] == "finalize_answer"
        assert set(g.stage_names[1:-1]) == {"web_research", "reflection"}
        assert {n.name for n in g.nodes if n.kind == "tool"} == {"web_search"}
    for g in tot:
        assert g.app == "tree-of-thoughts" and g.stage_names == ["propose", "evaluate"] * 3 + ["answer"]
    for g in dr + tot:
        assert g.is_complete and all(n.exec_time() is not None for n in g.nodes)


def test_the_apps_send_their_tasks_waiting_time_with_every_call():
    """``waiting_time`` of ``run_research`` / ``run_tot`` is the admission bound of each of their LLM calls
    (the demo stretches it with its SLOs); without it the calls leave the server's default."""
    server = FakeServer()

    async def main(waiting_time):
        async with jitflow.AsyncClient("http://test:8123", transport=server.async_transport(), model="demo") as c:
            await run_tot([4, 9, 10, 13], deadline=30, client=c, config=ToTConfig(k=2, b=1), fetch_view=False,
                          waiting_time=waiting_time)
            await run_research("Why?", deadline=30, client=c, config=ResearchConfig(search_latency=0.0),
                               fetch_view=False, waiting_time=waiting_time)

    anyio.run(main, 9.0)
    n = len(server.calls)
    assert n >= 4 and {c["slo"]["kind"] for c in server.calls} == {"compound"}
    assert [c["slo"]["waiting_time"] for c in server.calls] == [9.0] * n
    anyio.run(main, None)
    assert len(server.calls) > n and all("waiting_time" not in c["slo"] for c in server.calls[n:])
