"""`log_completions`: each scored group printed as a table (prompt, then one row per completion with its reward and
advantage), like TRL's completions table; `num_completions_to_print` caps the rows of a group.

Printed by whoever scores the group (a rollout actor's output reaches the driver's console through Ray). Uses rich
when it is installed, plain text otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlasync.rewards.text import completion_text

MAX_CHARS = 400  # per cell: long completions are cut in the middle


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


def print_group(
    prompt: Any,
    completions: Sequence[Any],
    rewards: Sequence[float | None],
    advantages: Sequence[float] | None,
    *,
    group_id: int,
    policy_version: int,
    limit: int | None = None,
) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(
            format_group(
                prompt, completions, rewards, advantages, group_id=group_id, policy_version=policy_version, limit=limit
            ),
            flush=True,
        )
        return
    table = Table(title=f"group {group_id} (policy v{policy_version}): {_cut(_prompt_text(prompt))}", show_lines=True)
    for column in ("#", "completion", "reward", "advantage"):
        table.add_column(column)
    for index, (completion, reward, advantage) in _rows(completions, rewards, advantages, limit):
        table.add_row(str(index), _cut(completion_text(completion)), _number(reward), _number(advantage))
    Console().print(table)


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
