"""Format rewards (TRL's `think_format_reward`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from rlasync.rewards.text import completion_text

_THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the answer opens with one `<think>...</think>` block (no nested `<think>`), else 0.0.

    Same pattern and flags as TRL's `think_format_reward`. Completions are plain strings or message lists
    (the last assistant message is checked, see `rlasync.rewards.text`).
    """
    return [1.0 if _THINK_FORMAT.match(completion_text(completion)) else 0.0 for completion in completions]
