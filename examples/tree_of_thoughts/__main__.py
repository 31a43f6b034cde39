"""``python -m examples.tree_of_thoughts --numbers 4 9 10 13 --deadline 60 --server URL``.

Prints the best path found, whether it reaches 24, the per-stage timings (with the server's
sub-deadlines when it reports them) and the task outcome. Exit code: 0 succeeded, 3 deadline
missed, 1 failed, 2 bad arguments or server unreachable. (Whether the puzzle was *solved* does not
change the exit code: with the random-weight demo model it rarely is.)
"""

from __future__ import annotations

import argparse
import json
import sys

import anyio

import jitflow
from examples._common import (
    EXIT_USAGE,
    add_common_args,
    check_server,
    die,
    exit_code,
    positive_float,
    print_task_report,
    quiet_telemetry_warnings,
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


async def _main(args: argparse.Namespace) -> ToTResult:
    async with jitflow.AsyncClient(base_url=args.server) as client:
        model = await check_server(client, args.model)
        return await run_tot(args.numbers, deadline=args.deadline, client=client, model=model,
                             config=ToTConfig(k=args.k, b=args.b))


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        positive_float("--deadline", args.deadline)
        initial_state(args.numbers)
        ToTConfig(k=args.k, b=args.b)
    except ValueError as e:
        die(str(e), EXIT_USAGE)
    quiet_telemetry_warnings()
    try:
        result = anyio.run(_main, args)
    except jitflow.APIConnectionError as e:
        die(f"cannot reach the jitflow server: {e}", EXIT_USAGE)
    except (ValueError, jitflow.APIError) as e:
        die(str(e), EXIT_USAGE)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        from rich.console import Console

        con = Console()
        con.rule(f"[bold]Game of 24: {' '.join(map(str, result.numbers))}")
        for line in result.best:
            con.print(f"  {line}")
        verdict = "[green]reaches 24[/green]" if result.solved else "[yellow]does not reach 24[/yellow]"
        con.print(f"best: {result.expression or '-'}  {verdict}  (puzzle solvable: {result.solvable})")
        con.print(f"levels: {result.levels}  invalid JSON outputs: {result.invalid_json}")
        assert result.report is not None
        print_task_report(result.report, console=con)
    return exit_code(result.outcome)


if __name__ == "__main__":
    sys.exit(main())
