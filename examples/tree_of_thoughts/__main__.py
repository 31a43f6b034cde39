"""``python -m examples.tree_of_thoughts --numbers 4 9 10 13 --deadline 60 --server URL``.

Prints the best path found, whether it reaches 24, the per-stage timings (with the server's
sub-deadlines when it reports them) and the task outcome. Exit code: 0 succeeded, 3 deadline
missed, 1 failed, 2 bad arguments or server unreachable. (Whether the puzzle was *solved* does not
change the exit code: with the random-weight demo model it rarely is.)
"""

from __future__ import annotations

import argparse
import sys

import jitflow
from examples._common import (
    add_common_args,
    run_cli,
)
from examples.tree_of_thoughts.agent import ToTConfig, ToTResult, run_tot
from examples.tree_of_thoughts.game24 import initial_state


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(prog="python -m examples.tree_of_thoughts",
                                description="Tree-of-Thoughts Game of 24 (jitflow compound task).")
    p.add_argument("--numbers", type=int, nargs="+", default=[4, 9, 10, 13], help="the puzzle (default 4 9 10 13)")
    add_common_args(p, deadline=60.0)
    p.add_argument("--k", type=int, default=3, help="thoughts proposed per state (default 3)")
    p.add_argument("--b", type=int, default=2, help="states kept per level (default 2)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)

    def validate() -> None:
        initial_state(args.numbers)
        ToTConfig(k=args.k, b=args.b)

    async def run(client: jitflow.AsyncClient, model: str) -> ToTResult:
        return await run_tot(args.numbers, deadline=args.deadline, client=client, model=model,
                             config=ToTConfig(k=args.k, b=args.b))

    def render(result: ToTResult, con) -> None:
        con.rule(f"[bold]Game of 24: {' '.join(map(str, result.numbers))}")
        for line in result.best:
            con.print(f"  {line}")
        verdict = "[green]reaches 24[/green]" if result.solved else "[yellow]does not reach 24[/yellow]"
        con.print(f"best: {result.expression or '-'}  {verdict}  (puzzle solvable: {result.solvable})")
        con.print(f"levels: {result.levels}  invalid JSON outputs: {result.invalid_json}")

    return run_cli(args, validate=validate, run=run, render=render)


if __name__ == "__main__":
    sys.exit(main())
