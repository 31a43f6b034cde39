"""The example apps against the real server (tiny model, GMAX; session fixture ``server_url``):
they complete, the server records their pattern graphs, and a too-short deadline gives a clean
``deadline_missed`` outcome."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from examples.deep_research import ResearchConfig, run_research
from examples.tree_of_thoughts import ToTConfig, run_tot
from examples.tree_of_thoughts.game24 import initial_state, legal_moves

import jitflow

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.engine


def _stored_graph(db: Path, app: str, task_id: str):
    from jitflow_server.store.history import HistoryStore

    store = HistoryStore(db)
    try:
        return next((r.graph for r in store.candidates(app) if r.graph.task_id == task_id), None)
    finally:
        store.close()


def _run(fn, *args, **kwargs):
    async def main():
        async with jitflow.AsyncClient(base_url=kwargs.pop("url")) as client:
            return await fn(*args, client=client, **kwargs)

    return anyio.run(main)


def test_deep_research_completes_and_records_its_pattern_graph(server_url, server_files):
    cfg = ResearchConfig(search_latency=0.05, answer_tokens=64, research_tokens=48)
    res = _run(run_research, "Why is the sky blue?", deadline=120, config=cfg, url=server_url)
    rep = res.report
    assert rep.outcome == "succeeded", rep.error
    names = [s.name for s in rep.stages]
    assert names[:3] == ["generate_query", "web_research", "reflection"] and names[-1] == "finalize_answer"
    assert len(names) in (4, 6)
    for s in rep.stages:
        if s.name == "web_research":
            assert s.tool_calls == s.llm_calls >= 1
        else:
            assert (s.llm_calls, s.tool_calls) == (1, 0)
    assert res.answer and "sky-blue" in res.sources
    assert [len(r) for r in res.rounds] == [s.llm_calls for s in rep.stages if s.name == "web_research"]
    view = rep.server_view
    assert view is not None and view["outcome"] == "succeeded"
    assert [s["name"] for s in view["stages"]] == names
    g = _stored_graph(server_files["db"], "deep-research", rep.task_id)
    assert g is not None and g.stage_names == names
    kinds = [sorted(n.kind for n in g.stage_nodes(i)) for i in range(g.n_stages)]
    assert kinds[1] == sorted(["llm", "tool"] * rep.stages[1].llm_calls)


def test_tree_of_thoughts_completes_and_records_its_pattern_graph(server_url, server_files):
    res = _run(run_tot, [4, 9, 10, 13], deadline=120, config=ToTConfig(k=3, b=2), url=server_url)
    rep = res.report
    assert rep.outcome == "succeeded", rep.error
    assert [s.name for s in rep.stages] == ["propose", "evaluate"] * 3 + ["answer"]
    assert [s.llm_calls for s in rep.stages[::2][:3]] == [1, 2, 2]
    assert [lv["proposed"] for lv in res.levels] == [s.llm_calls for s in rep.stages[1:6:2]]
    # Every step of the best path is a legal move of the state before it.
    st = initial_state([4, 9, 10, 13])
    for line in res.best:
        nxt = {m.line: m.state for m in legal_moves(st)}
        assert line in nxt
        st = nxt[line]
    assert len(st.numbers) == 1 and res.solved == (st.numbers[0] == 24)
    g = _stored_graph(server_files["db"], "tree-of-thoughts", rep.task_id)
    assert g is not None and g.n_stages == 7 and g.outcome == "succeeded"


def test_too_short_deadline_is_a_clean_deadline_missed_outcome(server_url):
    res = _run(run_research, "Why is the sky blue?", deadline=0.3, url=server_url)
    rep = res.report
    assert rep.outcome == "deadline_missed"
    assert "DeadlineExceededError" in (rep.error or "")
    assert rep.elapsed > rep.deadline
    assert res.answer == ""
    if rep.server_view is not None:
        assert rep.server_view["outcome"] == "deadline_missed"
    tot = _run(run_tot, [1, 2, 3, 4], deadline=0.2, url=server_url)
    assert tot.outcome == "deadline_missed" and tot.best == []


def test_tot_cli_runs_against_the_server(server_url):
    p = subprocess.run([sys.executable, "-m", "examples.tree_of_thoughts", "--numbers", "3", "3", "8", "8",
                        "--deadline", "120", "--server", server_url, "--json", "--k", "2", "--b", "1"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["outcome"] == "succeeded" and out["numbers"] == [3, 3, 8, 8]
    assert len(out["task"]["stages"]) == 7


def test_a_task_its_caller_cancels_still_reports_the_stages_it_ran(server_url, monkeypatch):
    # The demo gives up on a task at its deadline + 5 s by cancelling it; the report of what ran (here:
    # generate_query done, web_research open) must reach the caller instead of being lost.
    import examples.deep_research.agent as agent
    from examples.deep_research.search import web_search

    searching = anyio.Event()

    async def slow_search(query, k=3, latency=0.0):
        searching.set()
        return await web_search(query, k, 3600.0)

    monkeypatch.setattr(agent, "web_search", slow_search)
    kept = []

    async def main():
        async with jitflow.AsyncClient(base_url=server_url) as client, anyio.create_task_group() as tg:
            async def research():
                await run_research("Why is the sky blue?", deadline=120, client=client, on_cancel=kept.append,
                                   config=ResearchConfig(answer_tokens=16, research_tokens=16))
                raise AssertionError("the search should still be running")

            tg.start_soon(research)
            await searching.wait()
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert len(kept) == 1
    rep = kept[0]
    assert rep.task_id and rep.outcome == "failed" and "Cancel" in (rep.error or "")
    assert [s.name for s in rep.stages][:2] == ["generate_query", "web_research"]
    assert rep.stages[0].end is not None and rep.stages[0].llm_calls == 1 and rep.stages[1].end is not None
