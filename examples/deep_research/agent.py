"""The deep-research agent, in the shape of public deep-research agents (e.g. Gemini's LangGraph
quickstart): ``generate_query -> web_research (parallel, one branch per query) -> reflection ->
[web_research -> reflection]* (up to max_loops rounds) -> finalize_answer``.

Every call runs inside a jitflow compound task (``@jitflow.agent``) with one end-to-end deadline;
each step is a ``jitflow.stage`` so the server can match the task against its pattern-graph
history and give every stage a sub-deadline (JITServe §4.1). Control flow depends only on
structured output (JSON schemas: the list of queries, ``is_sufficient`` and
``follow_up_queries``) and on bounded loops, never on free text: the demo model's text is noise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

import jitflow
from examples._common import (
    AgentResult,
    TaskReport,
    chat_json,
    chat_text,
    clamp_items,
    run_agent_task,
)
from examples.deep_research.search import SearchHit, web_search

__all__ = ["APP", "ResearchConfig", "ResearchResult", "run_research", "query_schema", "reflection_schema"]

APP = "deep-research"


@dataclass(frozen=True)
class ResearchConfig:
    """Knobs of the agent (token caps in tokens, times in seconds).

    Attributes:
        initial_queries: at most this many queries from ``generate_query`` (fan-out of round 1).
        max_loops: research rounds before the answer is written regardless of ``is_sufficient``
            (1 = no follow-up round). The task has ``2 + 2*rounds`` stages.
        max_follow_up: at most this many follow-up queries per reflection.
        results_per_query: documents returned by each search.
        search_latency: simulated latency of one web search (s).
        query_tokens, research_tokens, reflection_tokens, answer_tokens: ``max_tokens`` of the
            generate_query / each web_research summary / reflection / finalize_answer calls.
        query_chars: ``maxLength`` of each generated query string (characters).
    """

    initial_queries: int = 3
    max_loops: int = 2
    max_follow_up: int = 3
    results_per_query: int = 3
    search_latency: float = 0.3
    query_tokens: int = 160
    research_tokens: int = 96
    reflection_tokens: int = 160
    answer_tokens: int = 192
    query_chars: int = 48

    def __post_init__(self) -> None:
        for name in ("initial_queries", "max_loops", "max_follow_up", "results_per_query", "query_tokens",
                     "research_tokens", "reflection_tokens", "answer_tokens", "query_chars"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.search_latency < 0:
            raise ValueError("search_latency must be >= 0")


@dataclass
class ResearchResult(AgentResult):
    """Result of one deep-research run.

    Attributes:
        question: the user's question.
        answer: the final answer text ("" if the task did not get that far).
        rounds: the queries researched in each round.
        sources: ids of the documents the search returned (first-seen order).
        invalid_json: structured-output calls whose output was not valid JSON (defaults used).
        report: the task's :class:`~examples._common.TaskReport` (outcome, stages, timings).
    """

    question: str
    answer: str
    rounds: list[list[str]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    invalid_json: int = 0
    report: TaskReport | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {"app": APP, "question": self.question, "answer": self.answer, "rounds": self.rounds,
                "sources": self.sources, "invalid_json": self.invalid_json, "outcome": self.outcome,
                "task": self.task_dict()}


def query_schema(n: int, chars: int) -> dict[str, Any]:
    """JSON schema of ``generate_query``: ``{"rationale": str, "query": [1..n strings]}``."""
    return {
        "type": "object",
        "properties": {
            "rationale": {"type": "string", "maxLength": 80},
            "query": {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": chars},
                      "minItems": 1, "maxItems": n},
        },
        "required": ["rationale", "query"],
        "additionalProperties": False,
    }


def reflection_schema(n: int, chars: int) -> dict[str, Any]:
    """JSON schema of ``reflection``: ``{"is_sufficient": bool, "knowledge_gap": str,
    "follow_up_queries": [1..n strings]}``."""
    return {
        "type": "object",
        "properties": {
            "is_sufficient": {"type": "boolean"},
            "knowledge_gap": {"type": "string", "maxLength": 80},
            "follow_up_queries": {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": chars},
                                  "minItems": 1, "maxItems": n},
        },
        "required": ["is_sufficient", "knowledge_gap", "follow_up_queries"],
        "additionalProperties": False,
    }


def _sources_text(hits: list[SearchHit]) -> str:
    return "\n".join(f"[{h.doc.id}] {h.doc.title}: {h.doc.text}" for h in hits) or "(no results)"


class _Run:
    """State of one research run (notes collected so far)."""

    def __init__(self, question: str, cfg: ResearchConfig) -> None:
        self.question = question
        self.cfg = cfg
        self.notes: list[str] = []
        self.rounds: list[list[str]] = []
        self.sources: list[str] = []
        self.invalid_json = 0
        self.answer = ""

    async def generate_query(self) -> list[str]:
        cfg = self.cfg
        async with jitflow.stage("generate_query") as st:
            res = await chat_json(
                st,
                [{"role": "system", "content": "You are a research assistant. Today is "
                  f"{time.strftime('%Y-%m-%d')}."},
                 {"role": "user", "content": f"Write up to {cfg.initial_queries} diverse web search queries "
                  f"that together answer the research topic below. Return JSON with a short rationale and "
                  f"the list of queries.\nTopic: {self.question}"}],
                query_schema(cfg.initial_queries, cfg.query_chars),
                name="search_queries", max_tokens=cfg.query_tokens,
                default={"rationale": "", "query": [self.question]},
            )
        self.invalid_json += not res.valid
        return clamp_items(res.data.get("query") or [], cfg.initial_queries) or [self.question]

    async def web_research(self, queries: list[str]) -> None:
        """One stage: per query, in parallel, a ``web_search`` tool call then a summary LLM call."""
        cfg = self.cfg
        self.rounds.append(list(queries))
        notes: list[str | None] = [None] * len(queries)
        async with jitflow.stage("web_research") as st:

            async def one(i: int, q: str) -> None:
                # The question is part of the search text so results stay on topic even when the
                # generated query is noise (random-weight demo model).
                hits = await web_search(f"{self.question} {q}", cfg.results_per_query, cfg.search_latency)
                for h in hits:
                    if h.doc.id not in self.sources:
                        self.sources.append(h.doc.id)
                summary = await chat_text(
                    st,
                    [{"role": "user", "content": f"Summarise what these sources say about '{q}' for the "
                      f"research topic '{self.question}'. Cite source ids in brackets.\n\n"
                      f"{_sources_text(hits)}"}],
                    max_tokens=cfg.research_tokens,
                )
                notes[i] = f"Query: {q}\nSources: {', '.join(h.doc.id for h in hits)}\nSummary: {summary}"

            async with anyio.create_task_group() as tg:
                for i, q in enumerate(queries):
                    tg.start_soon(one, i, q)
        self.notes.extend(n for n in notes if n is not None)

    async def reflection(self) -> tuple[bool, list[str]]:
        cfg = self.cfg
        async with jitflow.stage("reflection") as st:
            res = await chat_json(
                st,
                [{"role": "user", "content": "You are an expert research assistant analysing summaries about "
                  f"'{self.question}'. Decide whether they are sufficient to answer it; if not, name the "
                  f"knowledge gap and up to {cfg.max_follow_up} follow-up queries. Return JSON.\n\nSummaries:\n"
                  + "\n---\n".join(self.notes)}],
                reflection_schema(cfg.max_follow_up, cfg.query_chars),
                name="reflection", max_tokens=cfg.reflection_tokens,
                default={"is_sufficient": True, "knowledge_gap": "", "follow_up_queries": []},
            )
        self.invalid_json += not res.valid
        sufficient = res.data.get("is_sufficient")
        follow = clamp_items(res.data.get("follow_up_queries") or [], cfg.max_follow_up)
        return (sufficient is True or not follow), follow

    async def finalize_answer(self) -> None:
        cfg = self.cfg
        async with jitflow.stage("finalize_answer") as st:
            self.answer = await chat_text(
                st,
                [{"role": "user", "content": f"Write a concise, well-sourced answer to '{self.question}' from "
                  "the summaries below. Cite source ids in brackets.\n\n" + "\n---\n".join(self.notes)}],
                max_tokens=cfg.answer_tokens,
            )

    async def run(self) -> str:
        queries = await self.generate_query()
        await self.web_research(queries)
        for loop in range(1, self.cfg.max_loops + 1):
            sufficient, follow = await self.reflection()
            if sufficient or loop >= self.cfg.max_loops:
                break
            await self.web_research(follow)
        await self.finalize_answer()
        return self.answer


async def run_research(
    question: str,
    *,
    deadline: float,
    client: jitflow.AsyncClient | None = None,
    model: str | None = None,
    config: ResearchConfig | None = None,
    fetch_view: bool = True,
    on_cancel: Callable[[TaskReport], None] | None = None,
    waiting_time: float | None = None,
) -> ResearchResult:
    """Run the deep-research agent as one compound task with end-to-end deadline ``deadline``.

    Args:
        question: the research question.
        deadline: task deadline D (seconds from start; positive).
        client: the :class:`jitflow.AsyncClient` (default: :func:`jitflow.get_client`).
        model: model id (default: the client's / server's first model).
        config: :class:`ResearchConfig`.
        fetch_view: read ``GET /v1/tasks/{id}`` afterwards for the server's sub-deadlines.
        on_cancel: called with the report of what ran when the caller cancels the task (its stages so
            far), before the cancellation propagates.
        waiting_time: admission bound (s) of each LLM call of the task (default: the server's).

    Returns:
        :class:`ResearchResult`; ``result.report.outcome`` is ``succeeded``, ``deadline_missed``
        (a stage would start after the deadline, or the answer came late) or ``failed`` (a call
        failed, e.g. admission rejected or server unreachable; ``report.error`` says why).

    Raises:
        ValueError / TypeError: invalid ``deadline`` or ``config``.
        Exception: programming errors are not swallowed (only jitflow errors become outcomes).
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError("question must be a non-empty string")
    cfg = config or ResearchConfig()
    run = _Run(question.strip(), cfg)
    _, report = await run_agent_task(run.run, app=APP, deadline=deadline, client=client, model=model,
                                     metadata={"example": "deep_research", "max_loops": cfg.max_loops},
                                     fetch_view=fetch_view, on_cancel=on_cancel, waiting_time=waiting_time)
    return ResearchResult(run.question, run.answer, run.rounds, run.sources, run.invalid_json, report)
