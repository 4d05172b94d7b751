"""The text a built-in reward reads from a completion.

A completion is either a plain string or a list of chat messages. For messages, the text is the content of
the last assistant message (the final answer of a multi-turn conversation with tool calls); for a
single-message completion this is the same message TRL's built-in rewards read (`completion[0]`). Content
given as a list of parts contributes its text parts; a message without content (a bare tool call) reads as "".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def completion_text(completion: str | Sequence[dict[str, Any]]) -> str:
    """The answer text of one completion (see the module docstring)."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role", "assistant") == "assistant":
            return _content_text(message.get("content"))
    return ""


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
