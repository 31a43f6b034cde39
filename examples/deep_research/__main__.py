"""``python -m examples.deep_research "question" --deadline 60 --server URL [--model NAME]``.

Prints the answer, the per-stage timings (with the server's sub-deadlines when it reports them)
and the task outcome. Exit code: 0 succeeded, 3 deadline missed, 1 failed, 2 bad arguments or
server unreachable.
"""

from __future__ import annotations

import argparse
import sys

import jitflow
from examples._common import (
    add_common_args,
    run_cli,
)
from examples.deep_research.agent import ResearchConfig, ResearchResult, run_research


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(prog="python -m examples.deep_research",
                                description="Deep-research agent (jitflow compound task).")
    p.add_argument("question", help="the research question")
    add_common_args(p, deadline=60.0)
    p.add_argument("--max-loops", type=int, default=2, help="research rounds (default 2)")
    p.add_argument("--queries", type=int, default=3, help="max initial queries (default 3)")
    p.add_argument("--search-latency", type=float, default=0.3, help="simulated search latency, s (default 0.3)")
    p.add_argument("--answer-tokens", type=int, default=192, help="max tokens of the answer (default 192)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)

    def config() -> ResearchConfig:
        return ResearchConfig(initial_queries=args.queries, max_loops=args.max_loops,
                              search_latency=args.search_latency, answer_tokens=args.answer_tokens)

    def validate() -> None:
        config()
        if not args.question.strip():
            raise ValueError("the question must not be empty")

    async def run(client: jitflow.AsyncClient, model: str) -> ResearchResult:
        return await run_research(args.question, deadline=args.deadline, client=client, model=model, config=config())

    def render(result: ResearchResult, con) -> None:
        con.rule(f"[bold]{result.question}")
        con.print(result.answer or "(no answer)", markup=False)
        con.print(f"rounds: {len(result.rounds)}  queries per round: {[len(r) for r in result.rounds]}  "
                  f"sources: {', '.join(result.sources) or '-'}  invalid JSON outputs: {result.invalid_json}")

    return run_cli(args, validate=validate, run=run, render=render)


if __name__ == "__main__":
    sys.exit(main())
