"""`log_completions`: TRL's completions table, one per logging step (the completions scored in that window, at most
`num_completions_to_print` of them, a uniform sample: TRL's rule), with each row's prompt, completion, reward and
advantage; and `format_group`, one scored group as text.

    rollout loop: CompletionSampler.add_group(...)   a reservoir sample of the window's completions (per actor)
    rollout actor: drain_completions()               the sample, emptied (actors/loop_host.py)
    driver: StepCompletionsPrinter.after_log(step)   after a logged window: drains every actor, samples, prints

Uses rich when it is installed, plain text otherwise.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlasync.rewards.text import completion_text

MAX_CHARS = 400  # per cell: long completions are cut in the middle
MAX_KEPT = 1024  # completions a window keeps when num_completions_to_print is None (TRL: all of them)


@dataclass(frozen=True)
class CompletionRow:
    """One completion of the table: texts already cut to `MAX_CHARS` (they travel from the rollout actors)."""

    prompt: str
    completion: str
    reward: float | None
    advantage: float | None
    policy_version: int


class CompletionSampler:
    """A uniform sample of at most `limit` (None: `MAX_KEPT`) of the completions added since the last `drain()`
    (reservoir sampling, so a long window costs no more memory)."""

    def __init__(self, limit: int | None, rng: random.Random | None = None) -> None:
        self.limit = MAX_KEPT if limit is None else int(limit)
        self.rng = rng if rng is not None else random.Random(0)
        self.rows: list[CompletionRow] = []
        self.seen = 0

    def add_group(
        self,
        prompt: Any,
        completions: Sequence[Any],
        rewards: Sequence[float | None],
        advantages: Sequence[float] | None,
        policy_version: int,
    ) -> None:
        advantages = list(advantages) if advantages is not None else [None] * len(completions)
        text = _cut(_prompt_text(prompt))
        for completion, reward, advantage in zip(completions, rewards, advantages, strict=False):
            self.seen += 1
            row = CompletionRow(text, _cut(completion_text(completion)), reward, advantage, policy_version)
            if len(self.rows) < self.limit:
                self.rows.append(row)
                continue
            slot = self.rng.randrange(self.seen)
            if slot < self.limit:
                self.rows[slot] = row

    def drain(self) -> list[CompletionRow]:
        rows, self.rows, self.seen = self.rows, [], 0
        return rows


def format_step(rows: Sequence[CompletionRow], step: int) -> str:
    """The plain-text table of one logging step's completions (the rich rendering shows the same cells)."""
    lines = [f"step {step}: {len(rows)} completions"]
    for row in rows:
        lines.append(
            f"  [v{row.policy_version}] reward {_number(row.reward)} advantage {_number(row.advantage)} | "
            f"{row.prompt} -> {row.completion}"
        )
    return "\n".join(lines)


def print_step(rows: Sequence[CompletionRow], step: int) -> None:
    """One table for the logging step `step` (TRL's `print_prompt_completions_sample`)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_step(rows, step), flush=True)
        return
    table = Table(title=f"step {step}", show_lines=True)
    for column in ("prompt", "completion", "reward", "advantage", "policy"):
        table.add_column(column)
    for row in rows:
        table.add_row(row.prompt, row.completion, _number(row.reward), _number(row.advantage), f"v{row.policy_version}")
    Console().print(table)


class StepCompletionsPrinter:
    """The driver's side: after a logged window, `drain()` (every rollout actor's sample) and print one table of at
    most `limit` of them (a uniform sample; None: all); nothing when the window scored none."""

    def __init__(
        self,
        drain: Callable[[], Awaitable[list[CompletionRow]]],
        limit: int | None,
        rng: random.Random | None = None,
        printer: Callable[[Sequence[CompletionRow], int], None] = print_step,
    ) -> None:
        self.drain, self.limit = drain, limit
        self.rng = rng if rng is not None else random.Random(0)
        self.printer = printer

    async def after_log(self, step: int) -> None:
        rows = list(await self.drain())
        if self.limit is not None and len(rows) > self.limit:
            rows = self.rng.sample(rows, self.limit)
        if rows and self.limit != 0:
            self.printer(rows, step)


def format_group(
    prompt: Any,
    completions: Sequence[Any],
    rewards: Sequence[float | None],
    advantages: Sequence[float] | None,
    *,
    group_id: int,
    policy_version: int,
    limit: int | None = None,
) -> str:
    """A plain-text table of one scored group (the rich rendering shows the same cells)."""
    lines = [f"group {group_id} (policy v{policy_version}) prompt: {_cut(_prompt_text(prompt))}"]
    for index, (completion, reward, advantage) in _rows(completions, rewards, advantages, limit):
        text = _cut(completion_text(completion))
        lines.append(f"  [{index}] reward {_number(reward)} advantage {_number(advantage)} | {text}")
    hidden = len(completions) - len(lines) + 1
    if hidden > 0:
        lines.append(f"  ... {hidden} more (num_completions_to_print={limit})")
    return "\n".join(lines)


def _rows(completions, rewards, advantages, limit):
    count = len(completions) if limit is None else min(limit, len(completions))
    advantages = list(advantages) if advantages is not None else [None] * len(completions)
    return list(enumerate(zip(completions, rewards, advantages)))[:count]


def _prompt_text(prompt: Any) -> str:
    """A plain prompt, or the last user message of a conversational one."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        return ""
    return completion_text([{**users[-1], "role": "assistant"}])  # the same content reading as completions


def _cut(text: str) -> str:
    text = " ".join(text.split())
    if len(text) <= MAX_CHARS:
        return text
    half = MAX_CHARS // 2
    return f"{text[:half]} … {text[-half:]}"


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"
