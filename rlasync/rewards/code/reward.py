"""`code_reward`: the fraction of a row's tests that the program in a completion passes, run in a sandbox.

A row gives its tests in either or both dataset columns:

    tests     list of Python statements run after the program, in its namespace, each passing when it raises
              nothing (e.g. "assert f([1, 2]) == 3"); one execution runs the program and then every test
    io_tests  list of {"input": str, "output": str}: the program runs once per case as a script with `input` on
              stdin, and passes when its stdout equals `output` (trailing whitespace of each line and trailing
              blank lines ignored); the comparison happens outside the sandbox

The score is passed / (len(tests) + len(io_tests)); a completion without code scores 0.0, a row with no tests
None (not scored). Executions of a group run concurrently, bounded per process (`Sandbox.max_concurrent`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlasync.rewards.code.sandbox import Execution, Sandbox, default_concurrency
from rlasync.rewards.text import completion_text

_FENCED = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = ("python", "python3", "py")


def extract_program(text: str) -> str:
    """The program in a completion's text: the last ```python (or ```py) fenced block; else the last fenced
    block without a language; else the whole text. An unclosed final fence (a completion cut at the token
    limit) runs to the end of the text. Leading and trailing blank lines are dropped."""
    blocks = [(tag.lower(), body) for tag, body in _FENCED.findall(text)]
    for wanted in (_PYTHON_TAGS, ("",)):
        bodies = [body for tag, body in blocks if tag in wanted]
        if bodies:
            return bodies[-1].strip("\n")
    return text.strip("\n") if not blocks else ""


def outputs_match(actual: str, expected: str) -> bool:
    """Whether two program outputs are the same up to trailing whitespace on each line and trailing blank lines."""
    return _normalise(actual) == _normalise(expected)


def _normalise(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


class CodeReward:
    """A reward function (TRL's calling convention) scoring each completion's program on its row's tests.

    `CodeReward(sandbox=Sandbox(limits=Limits(cpu_s=1, wall_s=3)))` for other limits; instances pickle, so they
    can be given to `reward_funcs` and run in the RewardActor pool. The metric name is `name`.
    """

    def __init__(self, sandbox: Sandbox | None = None, *, name: str = "code_reward") -> None:
        if sandbox is not None and not isinstance(sandbox, Sandbox):
            raise ValueError(f"CodeReward(sandbox={sandbox!r}): pass a rlasync.rewards.code.Sandbox(...) or None")
        self.sandbox = sandbox or Sandbox()
        self.__name__ = name

    def __call__(
        self,
        completions: Sequence[Any],
        tests: Sequence[Sequence[str] | None] | None = None,
        io_tests: Sequence[Sequence[Mapping[str, str]] | None] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        if tests is None and io_tests is None:
            raise ValueError(
                f"{self.__name__} needs a `tests` column (Python statements such as 'assert f(1) == 2') or an "
                "`io_tests` column ([{'input': ..., 'output': ...}]) in the dataset; the rows have neither"
            )
        count = len(completions)
        row_tests = _per_row(tests, count, "tests")
        row_cases = _per_row(io_tests, count, "io_tests")
        programs = [extract_program(completion_text(completion)) for completion in completions]
        return score_programs(programs, row_tests, row_cases, self.sandbox)

    def __repr__(self) -> str:
        return f"CodeReward(sandbox={self.sandbox!r}, name={self.__name__!r})"


def code_reward(
    completions: Sequence[Any],
    tests: Sequence[Sequence[str] | None] | None = None,
    io_tests: Sequence[Sequence[Mapping[str, str]] | None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """Fraction of each row's `tests` / `io_tests` that the completion's program passes, in the default
    sandbox (module docstring; `CodeReward` for other limits)."""
    return CodeReward()(completions, tests, io_tests)


def score_programs(
    programs: Sequence[str],
    tests: Sequence[Sequence[str]],
    io_tests: Sequence[Sequence[Mapping[str, str]]],
    sandbox: Sandbox,
) -> list[float | None]:
    """Score each program on its tests and cases; all executions run concurrently, within the sandbox's bound."""
    sandbox.mechanism()  # refuse (or warn) once, before starting anything
    jobs: list[tuple[int, str, Any]] = []
    for index, (program, row_tests, row_cases) in enumerate(zip(programs, tests, io_tests, strict=True)):
        if not program.strip():
            continue
        if row_tests:
            jobs.append((index, "tests", list(row_tests)))
        jobs += [(index, "case", _case(case, index)) for case in row_cases]
    passed = [0] * len(programs)
    if jobs:
        workers = min(len(jobs), sandbox.max_concurrent or default_concurrency())
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
            outcomes = list(pool.map(lambda job: _run_job(sandbox, programs[job[0]], job[1], job[2]), jobs))
        for (index, _, _), count in zip(jobs, outcomes, strict=True):
            passed[index] += count
    scores: list[float | None] = []
    for count, row_tests, row_cases in zip(passed, tests, io_tests, strict=True):
        total = len(row_tests) + len(row_cases)
        scores.append(count / total if total else None)
    return scores


def _run_job(sandbox: Sandbox, program: str, kind: str, payload: Any) -> int:
    if kind == "tests":
        execution: Execution = sandbox.run(program, tests=payload)
        return len([index for index in execution.passed if index < len(payload)])
    input_text, expected = payload
    execution = sandbox.run(program, stdin=input_text)
    return int(execution.ok and outputs_match(execution.stdout, expected))


def _case(case: Any, row: int) -> tuple[str, str]:
    if not isinstance(case, Mapping) or not isinstance(case.get("output"), str):
        raise ValueError(
            f"io_tests of row {row}: each case must be a dict with 'input' and 'output' strings, got {case!r}"
        )
    input_text = case.get("input") or ""
    if not isinstance(input_text, str):
        raise ValueError(f"io_tests of row {row}: 'input' must be a string, got {type(input_text).__name__}")
    return input_text, case["output"]


def _per_row(column: Sequence[Any] | None, count: int, name: str) -> list[list[Any]]:
    if column is None:
        return [[] for _ in range(count)]
    if len(column) != count:
        raise ValueError(f"the `{name}` column has {len(column)} values for {count} completions")
    rows = []
    for row, value in enumerate(column):
        if value is None:
            rows.append([])
        elif isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ValueError(
                f"`{name}` of row {row} is {type(value).__name__}; expected a list "
                + ("of Python statements" if name == "tests" else "of {'input': ..., 'output': ...} dicts")
            )
        else:
            values = list(value)
            if name == "tests" and not all(isinstance(test, str) for test in values):
                raise ValueError(f"`tests` of row {row}: every test must be a string of Python statements")
            rows.append(values)
    return rows
