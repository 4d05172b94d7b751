"""Training chat templates: prefix-preserving variants of known families' templates (docs/algorithms.md §3.3).

The multi-turn tool loop re-renders the whole conversation every turn. A template whose rendering of the earlier
messages changes when a message is appended breaks the turn's prompt away from the tokens held so far, and the
reconciliation (docs/algorithms.md §3.3) forks a new training sample (`rollout/fork_frac` > 0): the forked sample
repeats the whole history as context, costing forward tokens.

Qwen3's own template is not prefix-preserving: it writes an assistant message's `<think>` block only for the
messages after the last user query that are either the last message or carry reasoning. The generation prompt of
`enable_thinking=False` (`<think>\\n\\n</think>\\n\\n`) and a tool-calling answer with an empty reasoning are held
with their (empty) `<think>` block, but once a tool message follows, the stock template re-renders that answer
without it; and a new user message drops every earlier answer's reasoning. `QWEN3_TRAINING_TEMPLATE` renders the
same text for the latest turn and always writes each assistant message's `<think>` block, so appending a message
never changes what came before.

    training_chat_template(tokenizer)        the patched template of the tokenizer's family, or None
    is_prefix_preserving(tokenizer, ...)     probe: does appending a tool message keep the earlier rendering?
    with_training_chat_template(tokenizer)   a copy of the tokenizer carrying the training template, when needed

Pure Python (jinja through transformers' `apply_chat_template`); no torch, no ray.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

# Qwen3 family, prefix-preserving: every assistant message is written as
#   <|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{content}{tool calls}<|im_end|>\n
# whatever follows it (the stock template writes the <think> block only after the last user query). Reasoning comes
# from `reasoning_content` or from a `<think>...</think>` head of the content. Tool messages are grouped into one
# user turn of <tool_response> blocks, as in the stock template.
QWEN3_TRAINING_TEMPLATE = """\
{%- macro system_block(system_text) -%}
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if system_text -%}{{- system_text + '\\n\\n' -}}{%- endif -%}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' -}}
{{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}' -}}
{{- '\\n</tool_call><|im_end|>\\n' -}}
{%- elif system_text is not none -%}
{{- '<|im_start|>system\\n' + system_text + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
{{- system_block(messages[0].content if messages[0].content is string else '') -}}
{%- set history = messages[1:] -%}
{%- else -%}
{{- system_block(none) -}}
{%- set history = messages -%}
{%- endif -%}
{%- for message in history -%}
{%- set text = message.content if message.content is string else '' -%}
{%- if message.role == 'user' or message.role == 'system' -%}
{{- '<|im_start|>' + message.role + '\\n' + text + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set reasoning = '' -%}
{%- if message.reasoning_content is string -%}
{%- set reasoning = message.reasoning_content -%}
{%- elif '<think>' in text and '</think>' in text -%}
{%- set reasoning = text.split('</think>')[0].split('<think>')[-1] -%}
{%- set text = text.split('</think>')[-1] -%}
{%- endif -%}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + text.lstrip('\\n') -}}
{%- for call in message.tool_calls or [] -%}
{%- set function = call.function if call.function is defined else call -%}
{%- if not loop.first or text -%}{{- '\\n' -}}{%- endif -%}
{{- '<tool_call>\\n{"name": "' + function.name + '", "arguments": ' -}}
{{- function.arguments if function.arguments is string else function.arguments | tojson -}}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or history[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + text + '\\n</tool_response>' -}}
{%- if loop.last or history[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""

# family -> (markers that all appear in the family's stock template, its training template)
TRAINING_TEMPLATES: dict[str, tuple[tuple[str, ...], str]] = {
    "qwen3": (("<|im_start|>", "last_query_index", "</think>", "<tool_response>"), QWEN3_TRAINING_TEMPLATE),
}

_PROBE_CALL = {"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}


def template_family(tokenizer: Any) -> str | None:
    """The known family (a `TRAINING_TEMPLATES` key) whose stock template the tokenizer carries, else None."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    for family, (markers, training) in TRAINING_TEMPLATES.items():
        if template == training or all(marker in template for marker in markers):
            return family
    return None


def training_chat_template(tokenizer: Any) -> str | None:
    """The prefix-preserving training template of the tokenizer's family, or None for an unknown family."""
    family = template_family(tokenizer)
    return TRAINING_TEMPLATES[family][1] if family is not None else None


def is_prefix_preserving(
    tokenizer: Any,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Any] | None = None,
) -> bool:
    """Whether appending a tool message (then an answer, then a user message) to a conversation keeps the text the
    template rendered for the earlier messages, under `chat_template_kwargs` (docs/algorithms.md §3.3).

    The probe is a user question, an assistant answer with a tool call and no reasoning, the tool's reply, a final
    answer and a new user question: each rendering (without generation prompt) must start with the previous one.
    """
    conversation: list[dict[str, Any]] = [
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
        {"role": "tool", "name": "probe", "content": "result"},
        {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "follow-up"},
    ]
    kwargs = dict(chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = list(tools)
    previous = None
    for end in range(2, len(conversation) + 1):
        text = tokenizer.apply_chat_template(conversation[:end], tokenize=False, add_generation_prompt=False, **kwargs)
        if previous is not None and not text.startswith(previous):
            return False
        previous = text
    return True


def with_training_chat_template(
    tokenizer: Any,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Any] | None = None,
) -> Any:
    """The tokenizer to render a tool loop with: `tokenizer` itself when its template is prefix-preserving (or its
    family has no training template), else a shallow copy carrying the family's training template (logged once).

    The caller's tokenizer is never modified. Call it when the rollout has tools (the multi-turn loop); a
    single-turn rollout renders one prompt and needs no training template.
    """
    training = training_chat_template(tokenizer)
    if training is None or tokenizer.chat_template == training:
        return tokenizer
    if is_prefix_preserving(tokenizer, chat_template_kwargs, tools):
        return tokenizer
    patched = copy.copy(tokenizer)
    patched.chat_template = training
    logger.info(
        "the tokenizer's %s chat template is not prefix-preserving (appending a tool message re-renders earlier "
        "turns); the tool loop renders with its training template (rlasync.data.chat_templates)",
        template_family(tokenizer),
    )
    return patched


__all__ = [
    "QWEN3_TRAINING_TEMPLATE",
    "TRAINING_TEMPLATES",
    "is_prefix_preserving",
    "template_family",
    "training_chat_template",
    "with_training_chat_template",
]
