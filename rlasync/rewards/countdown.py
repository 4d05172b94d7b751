"""`countdown_reward`: the Countdown task's checker (rows from `rlasync.data.countdown_dataset`).

A completion scores 1.0 when the last `<answer> ... </answer>` in it holds an arithmetic expression that uses
every one of the row's `numbers` exactly once (as written, no other numbers), only `+ - * /` and parentheses, and
equals `target` exactly (division is exact, over fractions); 0.0 otherwise (no answer tag, another number, a
number used twice, a wrong value, a division by zero, anything that is not such an expression). Nothing is
`eval`-ed: the expression is parsed with `ast` and only numbers, the four operators and parentheses are walked.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from rlasync.rewards.text import completion_text

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MAX_EXPRESSION_CHARS = 200
_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def countdown_reward(
    completions: Sequence[Any], numbers: Sequence[Sequence[int]], target: Sequence[int], **kwargs: Any
) -> list[float]:
    """1.0 per completion whose final `<answer>` expression reaches `target` using each of `numbers` exactly once,
    else 0.0 (module docstring for the rules). Needs the dataset's `numbers` and `target` columns."""
    return [
        _score(completion_text(completion), list(row_numbers), row_target)
        for completion, row_numbers, row_target in zip(completions, numbers, target, strict=True)
    ]


def _score(text: str, numbers: list[int], target: int) -> float:
    answers = _ANSWER.findall(text)
    if not answers:
        return 0.0
    expression = answers[-1].strip()
    if not expression or len(expression) > _MAX_EXPRESSION_CHARS:
        return 0.0
    try:
        tree = ast.parse(expression, mode="eval")
        used: list[int] = []
        value = _evaluate(tree.body, used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return 0.0
    if Counter(used) != Counter(int(n) for n in numbers):
        return 0.0
    return 1.0 if value == Fraction(int(target)) else 0.0


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Value of a tree of integer literals and + - * / (anything else raises ValueError); records the literals."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left = _evaluate(node.left, used)
        right = _evaluate(node.right, used)
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not allowed in a countdown answer: {ast.dump(node)[:60]}")
