"""Prompts for GRPO: checking that a dataset is usable, and rendering one prompt into token ids.

A GRPO dataset needs a `prompt` column, and every prompt must be *conversational* (TRL's format): a list of
messages, each a dict with a `role` ("system", "user", "assistant", "tool") and a `content`:

    {"prompt": [{"role": "user", "content": "What is 3 + 4? Answer with just the number."}], "answer": "7"}

Every other column is passed to the reward functions as a keyword argument (one value per completion).
`render_prompt` turns the messages into the ids the engine is asked to continue, with the tokenizer's chat
template and the generation prompt appended. Nothing here imports torch, transformers or datasets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PROMPT_COLUMN = "prompt"
ROLES = ("system", "developer", "user", "assistant", "tool")
NUM_ROWS_CHECKED = 64
IMAGE_COLUMNS = ("image", "images")
"""TRL's vision-language columns: refused by name (rlasync trains text-only models)."""
IMAGE_PART_TYPES = ("image", "image_url", "input_image")
"""`validate_prompt_dataset` checks the prompts of this many leading rows (a full scan can be slow)."""

_CONVERSATIONAL_HELP = (
    "Prompts must be conversational (TRL's format): a list of messages such as "
    '[{"role": "user", "content": "What is 3 + 4?"}]. To convert a plain-text column, map every row with '
    '`lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]}` '
    "(e.g. `dataset.map(...)`)."
)

TEMPLATE_MARKERS = (
    "<|im_start|>",  # ChatML (Qwen, SmolLM, ...)
    "<|start_header_id|>",  # Llama 3
    "<|begin_of_text|>",
    "[INST]",  # Llama 2 / Mistral
    "<start_of_turn>",  # Gemma
    "<|user|>",  # Phi-3, Zephyr
    "<|assistant|>",
    "<|im_sep|>",  # Phi-4
    "<｜User｜>",  # DeepSeek
)
"""Chat-template tokens that mark a string prompt as already rendered with a chat template."""

_PRETEMPLATED_HELP = (
    "Prompts must be conversational (TRL's format): rlasync applies the tokenizer's chat template itself, so a "
    "string that already went through a chat template would be templated twice if wrapped in a user message. "
    "Keep the raw text of each turn instead: build the prompt from the un-templated column (e.g. `lambda row: "
    '{"prompt": [{"role": "user", "content": row["question"]}]}`), or split the rendered string back into its '
    'messages [{"role": "system", ...}, {"role": "user", ...}] without the template tokens.'
)


def template_marker(prompt: str) -> str | None:
    """The first chat-template token found in a string prompt (it is pre-templated), or None."""
    return next((marker for marker in TEMPLATE_MARKERS if marker in prompt), None)


def _string_prompt_help(prompt: Any) -> str:
    """The fix for a non-conversational prompt: for a pre-templated string, not the wrapping that would template it
    twice."""
    if isinstance(prompt, str) and template_marker(prompt) is not None:
        return f"It already holds the chat template token {template_marker(prompt)!r}. {_PRETEMPLATED_HELP}"
    return _CONVERSATIONAL_HELP


def is_conversational(prompt: Any) -> bool:
    """Whether `prompt` is a non-empty list of `{"role", "content"}` messages (it may also carry tool calls)."""
    return _conversational_problem(prompt) is None


def validate_prompt(prompt: Any, row_index: int | None = None) -> None:
    """Raise `ValueError` unless `prompt` is conversational and text-only; the message says what is wrong and how
    to fix it."""
    where = f"row {row_index}: " if row_index is not None else ""
    problem = _conversational_problem(prompt)
    if problem is not None:
        raise ValueError(f"{where}{problem}. {_string_prompt_help(prompt)}")
    image = _image_part(prompt)
    if image is not None:
        raise ValueError(f"{where}{image}: vision-language training is not supported (rlasync trains on text only)")


def check_text_only_columns(columns: Sequence[str]) -> None:
    """Refuse TRL's image columns (`image`, `images`) by name: their images would silently be dropped."""
    found = [name for name in IMAGE_COLUMNS if name in columns]
    if found:
        raise ValueError(
            f"the dataset has an {found[0]!r} column: vision-language training is not supported (rlasync trains on "
            f"text only); remove the column (`dataset.remove_columns({found!r})`) to train on the text prompts"
        )


def row_prompt(row: Mapping[str, Any], row_index: int | None = None) -> list[dict[str, Any]]:
    """The conversational prompt of one dataset row; `ValueError` when the row has none or it is not
    conversational."""
    if PROMPT_COLUMN not in row:
        where = f"row {row_index}" if row_index is not None else "a dataset row"
        raise ValueError(
            f"{where} has no {PROMPT_COLUMN!r} column (columns: {sorted(row)}); GRPO needs a {PROMPT_COLUMN!r} "
            "column of conversational prompts"
        )
    prompt = row[PROMPT_COLUMN]
    validate_prompt(prompt, row_index)
    return list(prompt)


def leased_row_problem(row: Any, row_index: int) -> str | None:
    """Why the dataset row `row_index` cannot be rolled out (no prompt column, an empty or non-conversational
    prompt), or None: the rollout actors check every row as it is leased (the up-front check sees only the first
    `NUM_ROWS_CHECKED`), and drop a bad row, counted, instead of failing the run."""
    if not isinstance(row, Mapping):
        return f"row {row_index} is a {type(row).__name__}, not a dict of columns"
    try:
        check_text_only_columns(list(row))
        row_prompt(row, row_index)
    except ValueError as exc:
        return str(exc)
    return None


def validate_prompt_dataset(dataset: Any, num_rows: int | None = NUM_ROWS_CHECKED) -> None:
    """Check that `dataset` can feed GRPO: a `prompt` column, conversational prompts.

    `dataset` is a `datasets.Dataset` (or anything with `column_names` and integer indexing) or a sequence of
    dict rows. The first `num_rows` prompts are checked (`None`: all of them). Raises `ValueError`.
    """
    from rlasync.data.streaming import check_streaming_dataset, first_rows, is_streaming

    if is_streaming(dataset):  # a streaming dataset: its first rows (rlasync.data.streaming)
        check_streaming_dataset(dataset)
        dataset = first_rows(dataset, NUM_ROWS_CHECKED if num_rows is None else num_rows)
    columns = _column_names(dataset)
    check_text_only_columns(columns)
    if PROMPT_COLUMN not in columns:
        raise ValueError(
            f"the dataset has no {PROMPT_COLUMN!r} column (columns: {sorted(columns)}); GRPO needs a "
            f"{PROMPT_COLUMN!r} column of conversational prompts: rename your prompt column, e.g. "
            "`dataset.rename_column('question', 'prompt')`, and make each prompt a list of messages "
            '[{"role": "user", "content": ...}]'
        )
    total = len(dataset)
    if total == 0:
        raise ValueError("the dataset is empty: GRPO needs at least one prompt")
    count = total if num_rows is None else min(total, num_rows)
    for row_index in range(count):
        validate_prompt(dataset[row_index][PROMPT_COLUMN], row_index)


ENVIRONMENT_PROMPT = ({"role": "user", "content": ""},)
"""The prompt of a row without a `prompt` column when an environment serves it: `reset()`'s observation is
appended to this empty user message and becomes the prompt (docs/algorithms.md §3.4)."""


def with_environment_prompts(dataset: Any) -> Any:
    """`dataset` with an empty user message as the prompt of every row, when it has no `prompt` column: an
    environment-only dataset (e.g. only the `environment` column that routes rows among several environments),
    whose environments' `reset()` write the prompts. A dataset with a `prompt` column is returned as it is.

    Works on a `datasets.Dataset` / `IterableDataset` (lazily `map`ped), a list of rows, or a re-iterable of rows."""
    from rlasync.data.streaming import first_rows, is_streaming

    head = first_rows(dataset, 1)
    if not head or not isinstance(head[0], Mapping) or PROMPT_COLUMN in head[0]:
        return dataset
    if hasattr(dataset, "map"):
        return dataset.map(_add_environment_prompt)
    if is_streaming(dataset):
        return _EnvironmentPrompts(dataset)
    return [_add_environment_prompt(row) for row in dataset]


def _add_environment_prompt(row: Mapping[str, Any]) -> dict[str, Any]:
    return {**row, PROMPT_COLUMN: [dict(message) for message in ENVIRONMENT_PROMPT]}


class _EnvironmentPrompts:
    """A re-iterable of rows with the environment prompt added (for a plain re-iterable dataset)."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __iter__(self) -> Any:
        return (_add_environment_prompt(row) for row in self.rows)


def render_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Any] | None = None,
) -> list[int]:
    """The token ids of `messages` rendered with the tokenizer's chat template, generation prompt appended.

    `chat_template_kwargs` go to the template (e.g. `enable_thinking=False`); `tools` are JSON schemas or
    functions the template may describe. Handles transformers 5's return types (a `BatchEncoding` by
    default, or a plain list of ids).
    """
    kwargs = dict(chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = list(tools)
    rendered = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, **kwargs)
    return _token_ids(rendered)


def _token_ids(rendered: Any) -> list[int]:
    """Ids from what `apply_chat_template(tokenize=True)` returned: BatchEncoding/dict, list, or array."""
    if isinstance(rendered, Mapping) or hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    if hasattr(rendered, "tolist"):
        rendered = rendered.tolist()
    if isinstance(rendered, str):
        raise TypeError("apply_chat_template returned text; expected token ids (tokenize=True)")
    ids = list(rendered)
    if ids and isinstance(ids[0], list | tuple):  # a batch of one conversation
        if len(ids) != 1:
            raise ValueError(f"expected one rendered conversation, got a batch of {len(ids)}")
        ids = list(ids[0])
    return [int(token) for token in ids]


def _conversational_problem(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return f"the prompt is a plain string ({_preview(prompt)})"
    if not isinstance(prompt, list | tuple):
        return f"the prompt is a {type(prompt).__name__}, not a list of messages"
    if not prompt:
        return "the prompt is an empty list of messages"
    for position, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            return f"message {position} of the prompt is a {type(message).__name__}, not a dict"
        missing = [key for key in ("role", "content") if key not in message]
        if missing and not (missing == ["content"] and message.get("tool_calls")):
            return f"message {position} of the prompt has no {' or '.join(repr(k) for k in missing)} key"
        if message["role"] not in ROLES:
            return f"message {position} has role {message['role']!r}; use one of {', '.join(ROLES)}"
    return None


def _image_part(prompt: Sequence[Mapping[str, Any]]) -> str | None:
    """The first image content part of a conversational prompt, described, or None."""
    for position, message in enumerate(prompt):
        content = message.get("content")
        if not isinstance(content, list | tuple):
            continue
        for part in content:
            if isinstance(part, Mapping) and (
                part.get("type") in IMAGE_PART_TYPES or any(key in part for key in IMAGE_PART_TYPES)
            ):
                return f"message {position} of the prompt has an image content part ({part.get('type', 'image')!r})"
    return None


def _column_names(dataset: Any) -> list[str]:
    names = getattr(dataset, "column_names", None)
    if names is not None:
        return list(names)
    if isinstance(dataset, Sequence) and not isinstance(dataset, str):
        if not dataset:
            raise ValueError("the dataset is empty: GRPO needs at least one prompt")
        if not isinstance(dataset[0], Mapping):
            raise ValueError(f"dataset rows must be dicts of columns, got {type(dataset[0]).__name__}")
        return list(dataset[0].keys())
    raise TypeError(
        f"unsupported dataset type {type(dataset).__name__}: give a datasets.Dataset or a list of dict rows"
    )


def _preview(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
