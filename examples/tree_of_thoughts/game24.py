"""Game of 24 rules for the Tree-of-Thoughts example (exact arithmetic with fractions).

A *state* is the multiset of numbers still to combine plus the steps taken; a *move* combines two
of them with ``+ - * /`` into one, written as in the Tree-of-Thoughts paper's propose prompt
(Yao et al. 2023): ``"4 + 9 = 13 (left: 10 13 13)"``. The LLM chooses among the legal move lines
through a JSON-schema ``enum``, so even a random-weight model only ever proposes legal moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from itertools import combinations

__all__ = ["TARGET", "State", "Move", "fmt", "initial_state", "legal_moves", "solve", "VALUE_OF"]

TARGET = Fraction(24)

#: Value of an evaluation verdict (the Tree-of-Thoughts paper's sure/likely/impossible weights).
VALUE_OF = {"sure": 20.0, "likely": 1.0, "impossible": 0.001}


def fmt(x: Fraction) -> str:
    """``13`` for integers, ``13/4`` otherwise, ``-2`` for negatives."""
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


@dataclass(frozen=True)
class State:
    """Numbers left (sorted), the expression that produced each, and the move lines so far."""

    numbers: tuple[Fraction, ...]
    exprs: tuple[str, ...]
    steps: tuple[str, ...] = ()

    @property
    def left(self) -> str:
        """The numbers left, space separated (``"10 13 13"``)."""
        return " ".join(fmt(x) for x in self.numbers)

    @property
    def solved(self) -> bool:
        """True when exactly one number is left and it equals 24."""
        return len(self.numbers) == 1 and self.numbers[0] == TARGET

    @property
    def expression(self) -> str:
        """The expression of the first remaining number (the full answer once one is left)."""
        return self.exprs[0] if self.exprs else ""


@dataclass(frozen=True)
class Move:
    """One legal step: its text line and the resulting state."""

    line: str
    state: State


def initial_state(numbers: list[int] | tuple[int, ...]) -> State:
    """The start state for ``numbers``.

    Raises:
        ValueError: fewer than 2 or more than 6 numbers, or a number outside 1..1000.
    """
    if not 2 <= len(numbers) <= 6:
        raise ValueError(f"give 2 to 6 numbers, got {len(numbers)}")
    if any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1000 for n in numbers):
        raise ValueError(f"numbers must be integers in 1..1000, got {list(numbers)}")
    pairs = sorted((Fraction(n), str(n)) for n in numbers)
    return State(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))


def legal_moves(state: State) -> list[Move]:
    """All distinct moves from ``state`` (non-negative results; division by non-zero only),
    in a deterministic order. Each combines two numbers; the rest are kept."""
    out: dict[str, Move] = {}
    nums, exprs = state.numbers, state.exprs
    for i, j in combinations(range(len(nums)), 2):
        a, b = nums[i], nums[j]
        ea, eb = exprs[i], exprs[j]
        hi, lo, ehi, elo = (a, b, ea, eb) if a >= b else (b, a, eb, ea)
        cands = [
            (hi + lo, f"{fmt(hi)} + {fmt(lo)}", f"({ehi} + {elo})"),
            (hi * lo, f"{fmt(hi)} * {fmt(lo)}", f"{_paren(ehi)} * {_paren(elo)}"),
            (hi - lo, f"{fmt(hi)} - {fmt(lo)}", f"({ehi} - {elo})"),
        ]
        if lo != 0:
            cands.append((hi / lo, f"{fmt(hi)} / {fmt(lo)}", f"{_paren(ehi)} / {_paren(elo)}"))
        if hi != 0 and lo != hi:
            cands.append((lo / hi, f"{fmt(lo)} / {fmt(hi)}", f"{_paren(elo)} / {_paren(ehi)}"))
        rest = [(nums[k], exprs[k]) for k in range(len(nums)) if k not in (i, j)]
        for val, text, expr in cands:
            items = sorted([*rest, (val, expr)], key=lambda p: p[0])
            new = State(tuple(p[0] for p in items), tuple(p[1] for p in items), ())
            line = f"{text} = {fmt(val)} (left: {new.left})"
            if line not in out:
                out[line] = Move(line, State(new.numbers, new.exprs, (*state.steps, line)))
    return list(out.values())


def _paren(e: str) -> str:
    """``e`` wrapped in parentheses unless it is a number or already fully wrapped."""
    if e.isdigit():
        return e
    if e.startswith("(") and e.endswith(")"):
        depth = 0
        for i, ch in enumerate(e):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0 and i < len(e) - 1:
                break
        else:
            return e
    return f"({e})"


def solve(numbers: list[int] | tuple[int, ...]) -> str | None:
    """An expression reaching 24 with all ``numbers`` (exhaustive search), or None.

    Raises:
        ValueError: as :func:`initial_state`.
    """
    start = initial_state(numbers)
    seen: set[tuple[Fraction, ...]] = set()

    def rec(st: State) -> str | None:
        if len(st.numbers) == 1:
            return st.expression if st.solved else None
        if st.numbers in seen:
            return None
        seen.add(st.numbers)
        for m in legal_moves(st):
            r = rec(m.state)
            if r is not None:
                return r
        return None

    return rec(start)
