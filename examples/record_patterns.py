"""Run both example apps many times against a server so that it records their pattern graphs.

``python -m examples.record_patterns --server URL [--tasks 30] [--concurrency 4] [--deadline 120]``

Each finished task is stored by the server in its history DB (``jitflow serve --history-db``);
export the corpora afterwards with::

    jitflow patterns export --app deep-research    --db HISTORY.sqlite --out patterns/deep-research.jsonl
    jitflow patterns export --app tree-of-thoughts --db HISTORY.sqlite --out patterns/tree-of-thoughts.jsonl

(see ``patterns/README.md``). Inputs are deterministic for a given ``--seed``: research questions
are drawn from the titles of the search collection, puzzles are random solvable Game-of-24 hands.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter

import anyio

import jitflow
from examples._common import EXIT_USAGE, check_server, die, quiet_telemetry_warnings
from examples.deep_research import default_index, run_research
from examples.tree_of_thoughts import run_tot, solve


def inputs(n: int, seed: int) -> tuple[list[str], list[list[int]]]:
    """``n`` research questions and ``n`` solvable Game-of-24 puzzles (deterministic)."""
    rng = random.Random(seed)
    titles = [d.title for d in default_index().docs]
    forms = ["What is {}?", "Explain {} in simple terms.", "Why does {} matter?", "Summarise the key facts about {}."]
    questions = [rng.choice(forms).format(rng.choice(titles).lower()) for _ in range(n)]
    puzzles: list[list[int]] = []
    while len(puzzles) < n:
        p = sorted(rng.randint(1, 13) for _ in range(4))
        if solve(p) is not None:
            puzzles.append(p)
    return questions, puzzles


async def _main(args: argparse.Namespace) -> Counter:
    questions, puzzles = inputs(args.tasks, args.seed)
    jobs = [("research", q) for q in questions] + [("tot", p) for p in puzzles]
    random.Random(args.seed).shuffle(jobs)
    outcomes: Counter = Counter()
    sem = anyio.Semaphore(args.concurrency)
    async with jitflow.AsyncClient(base_url=args.server) as client:
        model = await check_server(client, args.model)

        async def one(i: int, kind: str, x) -> None:
            async with sem:
                if kind == "research":
                    r = await run_research(x, deadline=args.deadline, client=client, model=model, fetch_view=False)
                else:
                    r = await run_tot(x, deadline=args.deadline, client=client, model=model, fetch_view=False)
                outcomes[(kind, r.outcome)] += 1
                print(f"[{sum(outcomes.values())}/{len(jobs)}] {kind} {r.outcome} "
                      f"{len(r.report.stages) if r.report else 0} stages", flush=True)

        async with anyio.create_task_group() as tg:
            for i, (kind, x) in enumerate(jobs):
                tg.start_soon(one, i, kind, x)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 when every task was recorded)."""
    p = argparse.ArgumentParser(prog="python -m examples.record_patterns", description=__doc__.split("\n")[0])
    p.add_argument("--server", default=None, help="jitflow server URL")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--tasks", type=int, default=30, help="tasks per app (default 30)")
    p.add_argument("--concurrency", type=int, default=4, help="tasks in flight (default 4)")
    p.add_argument("--deadline", type=float, default=120.0, help="task deadline, s (default 120)")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    if args.tasks < 1 or args.concurrency < 1 or args.deadline <= 0:
        die("--tasks, --concurrency and --deadline must be positive", EXIT_USAGE)
    quiet_telemetry_warnings()
    t0 = time.time()
    try:
        outcomes = anyio.run(_main, args)
    except jitflow.APIConnectionError as e:
        die(f"cannot reach the jitflow server: {e}", EXIT_USAGE)
    print(f"done in {time.time() - t0:.0f}s: {dict(outcomes)}")
    return 0 if all(k[1] != "failed" for k in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
