"""Tree of Thoughts (Yao et al., 2023) for the Game of 24 as a jitflow compound task.

Breadth-first ToT: for each of ``depth`` levels,

* stage ``propose``: one LLM call per frontier state (in parallel) proposes ``k`` next steps;
  the JSON schema's ``enum`` lists exactly the legal move lines, so every proposal is legal;
* stage ``evaluate``: one LLM call per proposed state (in parallel) rates it
  ``sure | likely | impossible`` (JSON enum), valued 20 / 1 / 0.001 as in the paper;
* the best ``b`` states (by value, ties in proposal order) form the next frontier.

A final ``answer`` stage writes the answer for the best state. Control flow depends only on
structured output and on the fixed depth; whether the best leaf really equals 24 is checked
exactly with fractions.
"""

from __future__ import annotations

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
    run_agent_task,
)
from examples.tree_of_thoughts.game24 import VALUE_OF, State, initial_state, legal_moves, solve

__all__ = ["APP", "ToTConfig", "ToTResult", "run_tot", "propose_schema", "value_schema"]

APP = "tree-of-thoughts"


@dataclass(frozen=True)
class ToTConfig:
    """Knobs of the search (token caps in tokens).

    Attributes:
        k: thoughts proposed per state (``propose`` fan-out per state).
        b: states kept per level (beam / breadth).
        depth: levels (default: one per combination step, ``len(numbers) - 1``; 3 for 4 numbers).
        propose_tokens, value_tokens, answer_tokens: ``max_tokens`` of those calls.
        reason_chars: ``maxLength`` of the evaluation's short reasoning string.
    """

    k: int = 3
    b: int = 2
    depth: int | None = None
    propose_tokens: int = 160
    value_tokens: int = 100
    answer_tokens: int = 48
    reason_chars: int = 60

    def __post_init__(self) -> None:
        for name in ("k", "b", "propose_tokens", "value_tokens", "answer_tokens", "reason_chars"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.depth is not None and self.depth < 1:
            raise ValueError("depth must be >= 1")


@dataclass
class ToTResult(AgentResult):
    """Result of one ToT run.

    Attributes:
        numbers: the puzzle.
        best: steps of the best final state (move lines).
        expression: the expression of the best final state.
        solved: True if the best final state equals 24 (checked exactly).
        solvable: whether any solution exists (exhaustive check; informative only).
        levels: per level, the number of proposed and kept states.
        invalid_json: structured-output calls whose output was not valid JSON (defaults used).
        answer: the model's answer text (free text; noise with the demo model).
        report: the task's :class:`~examples._common.TaskReport`.
    """

    numbers: list[int]
    best: list[str] = field(default_factory=list)
    expression: str = ""
    solved: bool = False
    solvable: bool = False
    levels: list[dict[str, int]] = field(default_factory=list)
    invalid_json: int = 0
    answer: str = ""
    report: TaskReport | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {"app": APP, "numbers": self.numbers, "best": self.best, "expression": self.expression,
                "solved": self.solved, "solvable": self.solvable, "levels": self.levels,
                "invalid_json": self.invalid_json, "answer": self.answer, "outcome": self.outcome,
                "task": self.task_dict()}


def propose_schema(lines: list[str], k: int) -> dict[str, Any]:
    """JSON schema of ``propose``: ``{"steps": [k items from lines]}`` (``k`` capped by ``len(lines)``)."""
    n = max(1, min(k, len(lines)))
    return {
        "type": "object",
        "properties": {"steps": {"type": "array", "items": {"type": "string", "enum": list(lines)},
                                 "minItems": n, "maxItems": n}},
        "required": ["steps"],
        "additionalProperties": False,
    }


def value_schema(reason_chars: int) -> dict[str, Any]:
    """JSON schema of ``evaluate``: ``{"reason": str, "verdict": "sure"|"likely"|"impossible"}``."""
    return {
        "type": "object",
        "properties": {"reason": {"type": "string", "maxLength": reason_chars},
                       "verdict": {"type": "string", "enum": list(VALUE_OF)}},
        "required": ["reason", "verdict"],
        "additionalProperties": False,
    }


PROPOSE_PROMPT = (
    "Use numbers and basic arithmetic operations (+ - * /) to obtain 24. Each step, you are only allowed to "
    "choose two of the remaining numbers to obtain a new number.\nInput: {left}\nSteps so far:\n{steps}\n"
    "Propose {k} possible next steps."
)
VALUE_PROMPT = (
    "Evaluate if given numbers can reach 24 (sure/likely/impossible).\n10 14: 10 + 14 = 24. sure\n"
    "1 3 3: 1 * 3 * 3 = 9, (1 + 3) * 3 = 12. impossible\nSteps: {steps}\nRemaining: {left}"
)


class _Search:
    def __init__(self, numbers: list[int], cfg: ToTConfig) -> None:
        self.numbers = numbers
        self.cfg = cfg
        self.start = initial_state(numbers)
        self.depth = cfg.depth or (len(numbers) - 1)
        self.frontier: list[State] = [self.start]
        self.values: dict[State, float] = {}
        self.levels: list[dict[str, int]] = []
        self.invalid_json = 0
        self.answer = ""

    async def propose(self) -> list[State]:
        cfg = self.cfg
        proposals: list[list[State]] = [[] for _ in self.frontier]
        async with jitflow.stage("propose") as st:

            async def one(i: int, state: State) -> None:
                moves = legal_moves(state)
                if not moves:
                    return
                by_line = {m.line: m for m in moves}
                lines = list(by_line)
                res = await chat_json(
                    st,
                    [{"role": "user", "content": PROPOSE_PROMPT.format(
                        left=state.left, steps="\n".join(state.steps) or "(none)", k=cfg.k)}],
                    propose_schema(lines, cfg.k), name="propose", max_tokens=cfg.propose_tokens,
                    default={"steps": lines[: cfg.k]},
                )
                self.invalid_json += not res.valid
                chosen = [s for s in res.data.get("steps") or [] if s in by_line] or lines[: cfg.k]
                seen: set[str] = set()
                for line in chosen:
                    if line not in seen:
                        seen.add(line)
                        proposals[i].append(by_line[line].state)

            async with anyio.create_task_group() as tg:
                for i, s in enumerate(self.frontier):
                    tg.start_soon(one, i, s)
        out: list[State] = []
        for group in proposals:
            out.extend(s for s in group if s not in out)
        return out

    async def evaluate(self, states: list[State]) -> None:
        cfg = self.cfg
        async with jitflow.stage("evaluate") as st:

            async def one(state: State) -> None:
                res = await chat_json(
                    st,
                    [{"role": "user", "content": VALUE_PROMPT.format(steps="; ".join(state.steps), left=state.left)}],
                    value_schema(cfg.reason_chars), name="value", max_tokens=cfg.value_tokens,
                    default={"reason": "", "verdict": "likely"},
                )
                self.invalid_json += not res.valid
                self.values[state] = VALUE_OF.get(res.data.get("verdict"), VALUE_OF["likely"])

            async with anyio.create_task_group() as tg:
                for s in states:
                    tg.start_soon(one, s)

    async def run(self) -> State:
        for _ in range(self.depth):
            candidates = await self.propose()
            if not candidates:
                break
            await self.evaluate(candidates)
            ranked = sorted(range(len(candidates)), key=lambda i: (-self.values.get(candidates[i], 0.0), i))
            self.frontier = [candidates[i] for i in ranked[: self.cfg.b]]
            self.levels.append({"proposed": len(candidates), "kept": len(self.frontier)})
        best = self.frontier[0]
        async with jitflow.stage("answer") as st:
            self.answer = await chat_text(
                st,
                [{"role": "user", "content": f"Input: {self.start.left}\nSteps:\n" + "\n".join(best.steps)
                  + "\nWrite the answer as one expression equal to 24."}],
                max_tokens=self.cfg.answer_tokens,
            )
        return best


async def run_tot(
    numbers: list[int],
    *,
    deadline: float,
    client: jitflow.AsyncClient | None = None,
    model: str | None = None,
    config: ToTConfig | None = None,
    fetch_view: bool = True,
    on_cancel: Callable[[TaskReport], None] | None = None,
    waiting_time: float | None = None,
) -> ToTResult:
    """Run Tree-of-Thoughts on a Game-of-24 puzzle as one compound task with deadline ``deadline``.

    Args:
        numbers: the puzzle (2..6 integers in 1..1000; 4 in the classic game).
        deadline: task deadline D (seconds from start; positive).
        client: the :class:`jitflow.AsyncClient` (default: :func:`jitflow.get_client`).
        model: model id (default: the client's / server's first model).
        config: :class:`ToTConfig`.
        fetch_view: read ``GET /v1/tasks/{id}`` afterwards for the server's sub-deadlines.
        on_cancel: called with the report of what ran when the caller cancels the task (its stages so
            far), before the cancellation propagates.
        waiting_time: admission bound (s) of each LLM call of the task (default: the server's).

    Returns:
        :class:`ToTResult` (``report.outcome``: ``succeeded`` | ``deadline_missed`` | ``failed``).

    Raises:
        ValueError / TypeError: invalid numbers, deadline or config.
    """
    cfg = config or ToTConfig()
    search = _Search(list(numbers), cfg)
    best, report = await run_agent_task(search.run, app=APP, deadline=deadline, client=client, model=model,
                                        metadata={"example": "tree_of_thoughts", "k": cfg.k, "b": cfg.b},
                                        fetch_view=fetch_view, on_cancel=on_cancel, waiting_time=waiting_time)
    res = ToTResult(list(numbers), levels=search.levels, invalid_json=search.invalid_json,
                    answer=search.answer, solvable=solve(list(numbers)) is not None, report=report)
    if best is not None:
        res.best = list(best.steps)
        res.expression = best.expression
        res.solved = best.solved
    return res
