"""A procedurally generated code task: "write `f(xs)` that returns ..." with hidden tests, scored by
`rlasync.rewards.code.code_reward` (the program runs in a sandbox; docs/rewards.md §1).

code  "Write a Python function `f(xs)` that takes a list of integers `xs` and returns the sum of the even numbers
      in `xs`. For example, `f([1, 2, 3, 4])` returns `6`. ..."
      columns: prompt (conversational), tests (hidden: Python assert statements on `f`, one input each),
               family (the task family's name), solution (a reference program that passes every test)

Each row draws a family (and its parameter, e.g. the `k` of "greater than k") and `num_tests` random inputs
(lists of `0..max_length` integers in `[-value_range, value_range]`; the first test of families defined on
empty lists uses the empty list). The same arguments (seed included) always give the same rows.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_QUESTION = (
    "Write a Python function `f(xs)` that takes a list of integers `xs` and returns {description}. "
    "For example, `f({example})` returns `{expected}`. Reply with the complete function in a ```python code block."
)


@dataclass(frozen=True)
class _Family:
    """One kind of task: its description, reference function and source, all given the row's parameter `k`."""

    name: str
    description: str
    reference: Callable[[list[int], int], Any]
    source: str
    parameters: tuple[int, int] = (0, 0)
    empty_ok: bool = True


FAMILIES: tuple[_Family, ...] = (
    _Family(
        "sum_even",
        "the sum of the even numbers in `xs` (0 when there are none)",
        lambda xs, k: sum(x for x in xs if x % 2 == 0),
        "def f(xs):\n    return sum(x for x in xs if x % 2 == 0)\n",
    ),
    _Family(
        "count_greater",
        "how many numbers in `xs` are greater than {k}",
        lambda xs, k: sum(1 for x in xs if x > k),
        "def f(xs):\n    return sum(1 for x in xs if x > {k})\n",
        parameters=(-3, 5),
    ),
    _Family(
        "spread",
        "the largest number in `xs` minus the smallest (0 for an empty list)",
        lambda xs, k: max(xs) - min(xs) if xs else 0,
        "def f(xs):\n    return max(xs) - min(xs) if xs else 0\n",
    ),
    _Family(
        "running_sum",
        "the list of running sums of `xs` (element i is xs[0] + ... + xs[i])",
        lambda xs, k: [sum(xs[: i + 1]) for i in range(len(xs))],
        "def f(xs):\n    out, total = [], 0\n    for x in xs:\n        total += x\n        out.append(total)\n"
        "    return out\n",
    ),
    _Family(
        "scale",
        "a new list with every number of `xs` multiplied by {k}",
        lambda xs, k: [x * k for x in xs],
        "def f(xs):\n    return [x * {k} for x in xs]\n",
        parameters=(2, 7),
    ),
    _Family(
        "divisible",
        "the numbers of `xs` that are divisible by {k}, in their original order",
        lambda xs, k: [x for x in xs if x % k == 0],
        "def f(xs):\n    return [x for x in xs if x % {k} == 0]\n",
        parameters=(2, 5),
    ),
    _Family(
        "distinct_count",
        "the number of distinct values in `xs`",
        lambda xs, k: len(set(xs)),
        "def f(xs):\n    return len(set(xs))\n",
    ),
    _Family(
        "argmax",
        "the index of the first occurrence of the largest number in `xs` (`xs` is never empty)",
        lambda xs, k: xs.index(max(xs)),
        "def f(xs):\n    return xs.index(max(xs))\n",
        empty_ok=False,
    ),
    _Family(
        "dedupe",
        "`xs` without repeated values, keeping the first occurrence of each, in order",
        lambda xs, k: list(dict.fromkeys(xs)),
        "def f(xs):\n    return list(dict.fromkeys(xs))\n",
    ),
)
FAMILY_NAMES = tuple(family.name for family in FAMILIES)


def code_rows(
    n: int,
    seed: int,
    *,
    families: Sequence[str] | None = None,
    num_tests: int = 5,
    max_length: int = 8,
    value_range: int = 9,
    system_prompt: str | None = None,
) -> list[dict[str, Any]]:
    """`n` rows of the code task, families drawn uniformly from `families` (default: all of `FAMILY_NAMES`)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r}: must be a non-negative integer")
    chosen = _families(families)
    if isinstance(num_tests, bool) or not isinstance(num_tests, int) or num_tests < 1:
        raise ValueError(f"num_tests={num_tests!r}: must be a positive integer")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length={max_length!r}: must be a positive integer")
    if isinstance(value_range, bool) or not isinstance(value_range, int) or value_range < 1:
        raise ValueError(f"value_range={value_range!r}: must be a positive integer")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        family = rng.choice(chosen)
        k = rng.randint(*family.parameters)
        example = _random_list(rng, max(3, min(max_length, 5)), value_range, at_least=3)
        inputs = [] if not family.empty_ok else [[]]
        while len(inputs) < num_tests:
            xs = _random_list(rng, max_length, value_range, at_least=1)
            if xs != example:  # the example in the prompt is never a hidden test
                inputs.append(xs)
        question = _QUESTION.format(
            description=family.description.format(k=k), example=example, expected=family.reference(example, k)
        )
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        rows.append(
            {
                "prompt": messages + [{"role": "user", "content": question}],
                "tests": [f"assert f({xs!r}) == {family.reference(list(xs), k)!r}" for xs in inputs[:num_tests]],
                "family": family.name,
                "solution": family.source.format(k=k),
            }
        )
    return rows


def code_dataset(n: int, seed: int, **kwargs: Any) -> Any:
    """`code_rows(...)` as a `datasets.Dataset`."""
    import datasets

    return datasets.Dataset.from_list(code_rows(n, seed, **kwargs))


def _families(names: Sequence[str] | None) -> list[_Family]:
    if names is None:
        return list(FAMILIES)
    if isinstance(names, str):
        names = [names]
    unknown = [name for name in names if name not in FAMILY_NAMES]
    if not names or unknown:
        raise ValueError(f"families={list(names)!r}: choose a non-empty subset of {list(FAMILY_NAMES)}")
    return [family for family in FAMILIES if family.name in names]


def _random_list(rng: random.Random, max_length: int, value_range: int, *, at_least: int) -> list[int]:
    return [rng.randint(-value_range, value_range) for _ in range(rng.randint(at_least, max(at_least, max_length)))]
