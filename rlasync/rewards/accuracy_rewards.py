"""Correctness rewards: `accuracy_reward` (TRL's, math-verify) and `last_number_reward` (integer answers).

Both return `None` for a completion whose gold answer cannot be read, so that the completion is left out of
its group's statistics instead of being scored 0.

`accuracy_reward` follows TRL: the gold `solution` is parsed with math-verify's defaults (LaTeX, then plain
expressions); the completion must state its answer in LaTeX (`\\boxed{...}` first, else `$...$` after an
anchor such as "final answer is"), with unit normalisation; a bare "The answer is 42" scores 0.0. math-verify
guards parsing with `signal.alarm`, which only works in the main thread: reward functions run in a worker
thread (the calling convention), where the timeouts are off as in TRL, so a pathological expression can
take long to parse.

`last_number_reward` suits procedurally generated arithmetic ("What is 7 + 5?"): the last number in the
reply must equal the integer in the `answer` column (or, without one, the `solution` column).
"""

from __future__ import annotations

import logging
import numbers
import re
import threading
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from rlasync.rewards.text import completion_text

PARSING_TIMEOUT_S = 10
VERIFY_TIMEOUT_S = 5

_NUMBER = re.compile(r"(?<!\d)-?\d+(?:\.\d+)?")
_INTEGER = re.compile(r"-?\d+")


def accuracy_reward(completions: Sequence[Any], solution: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 if the completion's LaTeX answer is equivalent to `solution` (math-verify), 0.0 if not, `None`
    if the gold solution cannot be parsed. Completions are plain strings or message lists."""
    from math_verify import LatexExtractionConfig, LatexNormalizationConfig, parse, verify

    parsing_timeout, verify_timeout = _math_verify_timeouts()
    answer_config = [
        LatexExtractionConfig(
            normalization_config=LatexNormalizationConfig(units=True),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    gold_cache: dict[str, list[Any]] = {}
    rewards: list[float | None] = []
    for completion, gold in zip(completions, solution, strict=True):
        gold = str(gold)
        if gold not in gold_cache:
            gold_cache[gold] = parse(gold, parsing_timeout=parsing_timeout)
        if not gold_cache[gold]:
            rewards.append(None)
            continue
        answer = parse(
            completion_text(completion),
            extraction_config=answer_config,
            extraction_mode="first_match",
            parsing_timeout=parsing_timeout,
        )
        rewards.append(float(verify(gold_cache[gold], answer, timeout_seconds=verify_timeout)))
    return rewards


def _math_verify_timeouts() -> tuple[int | None, int | None]:
    """TRL's rule: timeouts in the main thread; none elsewhere (signal.alarm), with the warning silenced."""
    if threading.current_thread() is threading.main_thread():
        return PARSING_TIMEOUT_S, VERIFY_TIMEOUT_S
    logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
    logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
    return None, None


def last_number_reward(
    completions: Sequence[Any],
    answer: Sequence[Any] | None = None,
    solution: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 if the last number in the reply equals the integer gold answer, else 0.0; `None` if the gold is
    not an integer.

    The gold comes from the `answer` column, else `solution` (an int or a string such as "-12"). Numbers in
    the reply are matched as `-?\\d+(\\.\\d+)?` ("12.0" equals 12, "12.5" does not); a minus directly after
    a digit is read as subtraction ("8-3" gives 8 and 3); thousands separators are not understood. A reply
    without a number scores 0.0.
    """
    gold_answers = answer if answer is not None else solution
    if gold_answers is None:
        raise ValueError("last_number_reward needs an `answer` (or `solution`) dataset column with the integer answer")
    return [
        _last_number_score(completion_text(completion), gold)
        for completion, gold in zip(completions, gold_answers, strict=True)
    ]


def _last_number_score(text: str, gold: Any) -> float | None:
    gold_int = _as_integer(gold)
    if gold_int is None:
        return None
    numbers = _NUMBER.findall(text)
    return float(bool(numbers) and Decimal(numbers[-1]) == gold_int)


def _as_integer(gold: Any) -> int | None:
    if isinstance(gold, bool):
        return None
    if isinstance(gold, numbers.Integral):
        return int(gold)
    if isinstance(gold, str) and _INTEGER.fullmatch(gold.strip()):
        return int(gold.strip())
    return None
