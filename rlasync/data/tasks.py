"""Procedurally generated tasks with checkable answers, for quickstarts, tests and held-out evaluation.

Each task comes two ways: `*_rows(...)` returns plain dict rows (no dependency), `*_dataset(...)` the same
rows as a `datasets.Dataset`. The same arguments (seed included) always give the same rows.

arithmetic  "What is 3 + 4? Answer with just the number."
            columns: prompt (conversational), answer (the integer as a string, e.g. "7" or "-2"),
                     solution (the same integer as a string: a gold answer math-verify parses)
            rewards: `last_number_reward` reads `answer`; `accuracy_reward` reads `solution` (and needs the
                     completion to state the answer in LaTeX, e.g. \\boxed{7})
countdown   "Using the numbers [3, 5, 2], create an equation that equals 16. ..."
            columns: prompt (conversational), numbers (list of ints, each to be used exactly once),
                     target (int), solution (one expression that reaches the target; others may exist)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

ARITHMETIC_OPS = ("+", "-", "*", "/")
COUNTDOWN_OPS = ("+", "-", "*", "/")

_ARITHMETIC_QUESTION = "What is {a} {op} {b}? Answer with just the number."
_COUNTDOWN_QUESTION = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number must be used exactly once. Show your work in <think> </think> tags "
    "and return the final equation in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)
_MAX_COUNTDOWN_TRIES = 1000


def arithmetic_rows(
    n: int,
    seed: int,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    *,
    min_operand: int = 0,
    allow_negative: bool = False,
    system_prompt: str | None = None,
) -> list[dict[str, Any]]:
    """`n` two-operand problems with operands in `[min_operand, max_operand]` and operators drawn from `ops`.

    `-` orders its operands so the result is non-negative unless `allow_negative`; `/` is exact integer
    division (`a = b * q` with `b >= 1` and `q` in range, so `a` may exceed `max_operand`).
    """
    _check_count(n)
    ops = tuple(ops)
    unknown = [op for op in ops if op not in ARITHMETIC_OPS]
    if not ops or unknown:
        raise ValueError(f"ops={ops!r}: choose a non-empty subset of {ARITHMETIC_OPS}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"operands range [{min_operand}, {max_operand}]: need 0 <= min_operand <= max_operand")
    if "/" in ops and max_operand < 1:
        raise ValueError("'/' needs max_operand >= 1 (a non-zero divisor)")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        op = rng.choice(ops)
        a, b, result = _arithmetic_problem(rng, op, min_operand, max_operand, allow_negative)
        question = _ARITHMETIC_QUESTION.format(a=a, op=op, b=b)
        rows.append({"prompt": _messages(question, system_prompt), "answer": str(result), "solution": str(result)})
    return rows


def arithmetic_dataset(
    n: int,
    seed: int,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    **kwargs: Any,
) -> Any:
    """`arithmetic_rows(...)` as a `datasets.Dataset`."""
    return _to_dataset(arithmetic_rows(n, seed, max_operand, ops, **kwargs))


def countdown_rows(
    n: int,
    seed: int,
    *,
    num_numbers: tuple[int, int] = (3, 4),
    number_range: tuple[int, int] = (1, 99),
    target_range: tuple[int, int] = (1, 100),
    system_prompt: str | None = None,
) -> list[dict[str, Any]]:
    """`n` Countdown problems: reach `target` with `+ - * /` using each of `numbers` exactly once.

    The count of numbers is drawn from `num_numbers` (inclusive), each number from `number_range`; the target
    is the value of a random expression over all of them (intermediate results stay non-negative integers),
    redrawn until it falls in `target_range`. That expression is the `solution` column.
    """
    _check_count(n)
    low_count, high_count = num_numbers
    if not 2 <= low_count <= high_count:
        raise ValueError(f"num_numbers={num_numbers}: need 2 <= low <= high")
    if not 1 <= number_range[0] <= number_range[1]:
        raise ValueError(f"number_range={number_range}: need 1 <= low <= high")
    if not target_range[0] <= target_range[1]:
        raise ValueError(f"target_range={target_range}: need low <= high")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        numbers, target, solution = _countdown_problem(rng, num_numbers, number_range, target_range)
        question = _COUNTDOWN_QUESTION.format(numbers=numbers, target=target)
        rows.append(
            {"prompt": _messages(question, system_prompt), "numbers": numbers, "target": target, "solution": solution}
        )
    return rows


def countdown_dataset(n: int, seed: int, **kwargs: Any) -> Any:
    """`countdown_rows(...)` as a `datasets.Dataset`."""
    return _to_dataset(countdown_rows(n, seed, **kwargs))


def _arithmetic_problem(rng: random.Random, op: str, low: int, high: int, allow_negative: bool) -> tuple[int, int, int]:
    if op == "/":
        b = rng.randint(max(low, 1), high)
        quotient = rng.randint(low, high)
        return b * quotient, b, quotient
    a, b = rng.randint(low, high), rng.randint(low, high)
    if op == "+":
        return a, b, a + b
    if op == "*":
        return a, b, a * b
    if not allow_negative and a < b:
        a, b = b, a
    return a, b, a - b


def _countdown_problem(
    rng: random.Random,
    num_numbers: tuple[int, int],
    number_range: tuple[int, int],
    target_range: tuple[int, int],
) -> tuple[list[int], int, str]:
    for _ in range(_MAX_COUNTDOWN_TRIES):
        numbers = [rng.randint(*number_range) for _ in range(rng.randint(*num_numbers))]
        value, expression = _random_expression(rng, numbers)
        if target_range[0] <= value <= target_range[1]:
            return numbers, value, expression
    raise ValueError(
        f"could not reach a target in {target_range} from numbers in {number_range} after "
        f"{_MAX_COUNTDOWN_TRIES} tries; widen target_range"
    )


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[int, str]:
    """Combine all `numbers` pairwise at random into one expression; every intermediate is an integer >= 0."""
    pool = [(number, str(number)) for number in numbers]
    while len(pool) > 1:
        rng.shuffle(pool)
        (left, left_text), (right, right_text) = pool.pop(), pool.pop()
        candidates = [("+", left + right), ("*", left * right)]
        if left >= right:
            candidates.append(("-", left - right))
        if right != 0 and left % right == 0:
            candidates.append(("/", left // right))
        op, value = rng.choice(candidates)
        text = f"{_group(left_text)} {op} {_group(right_text)}"
        pool.append((value, text))
    value, text = pool[0]
    return value, text


def _group(text: str) -> str:
    return f"({text})" if " " in text else text


def _messages(question: str, system_prompt: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": question}]


def _check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r}: must be a non-negative integer")


def _to_dataset(rows: list[dict[str, Any]]) -> Any:
    import datasets

    return datasets.Dataset.from_list(rows)
