"""Fakes shared by the tool-loop tests: a character-level tokenizer with a Hermes-style chat template and an
engine that answers from a script. (Tests import nothing from each other under `--import-mode=importlib`, so the
fakes are handed out as fixtures.)"""

import asyncio
import json

import pytest

from rlasync.engine.base import RequestRejectedError
from rlasync.records import TurnRecord

SPECIALS = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<tool_call>": 3, "</tool_call>": 4}
EOS_ID = SPECIALS["<eos>"]
CHAR_OFFSET = 16


class CharTokenizer:
    """One id per character (`ord + 16`), plus special tokens; `<tool_call>` is a special token (as in some
    Qwen vocabularies), so decoding with `skip_special_tokens=True` loses the call markers.

    The chat template renders `[tools: a,b]` when tools are given, then per message `<|role|>content`, with an
    assistant's tool calls re-rendered as `<tool_call>` blocks and a tool message as `<|tool:name|>content`; the
    generation prompt is `<|assistant|>`. `prefix_preserving=True` (default) renders an earlier answer exactly as
    the scripted engine generated it (calls as `tool_call_text`, then `<eos>`), so each turn's prompt extends the
    previous turn's prompt and output; `False` re-renders calls compactly and drops the `<eos>`, so turns fork.
    """

    eos_token_id = EOS_ID
    pad_token_id = SPECIALS["<pad>"]
    all_special_tokens = list(SPECIALS)

    def __init__(self, prefix_preserving=True):
        self.prefix_preserving = prefix_preserving
        self.rendered_tools = []  # the tools argument of each apply_chat_template call

    def encode(self, text):
        ids, position = [], 0
        while position < len(text):
            for token, token_id in SPECIALS.items():
                if text.startswith(token, position):
                    ids.append(token_id)
                    position += len(token)
                    break
            else:
                ids.append(ord(text[position]) + CHAR_OFFSET)
                position += 1
        return ids

    def decode(self, ids, skip_special_tokens=False):
        names = {token_id: token for token, token_id in SPECIALS.items()}
        return "".join(("" if skip_special_tokens else names[i]) if i in names else chr(i - CHAR_OFFSET) for i in ids)

    def render_text(self, messages, tools=None, add_generation_prompt=True):
        text = "<bos>"
        if tools:
            text += "[tools: " + ",".join(tool.__name__ if callable(tool) else str(tool) for tool in tools) + "]"
        for message in messages:
            if message["role"] == "tool":
                text += f"<|tool:{message['name']}|>{message['content']}"
                continue
            text += f"<|{message['role']}|>{message.get('content') or ''}"
            for call in message.get("tool_calls") or []:
                function = call["function"]
                if self.prefix_preserving:  # exactly as the model wrote it (see `tool_call_text`)
                    text += tool_call_text(function["name"], function["arguments"])
                else:
                    text += "<tool_call>" + json.dumps(function) + "</tool_call>"
            if message["role"] == "assistant" and self.prefix_preserving:
                text += "<eos>"
        if add_generation_prompt:
            text += "<|assistant|>"
        return text

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, tools=None, **kwargs):
        self.rendered_tools.append(list(tools) if tools else None)
        ids = self.encode(self.render_text(messages, tools, add_generation_prompt))
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}


def tool_call_text(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ScriptedEngine:
    """Answers each request with `script(prompt_text, turn_index)` (text; `<eos>` appended, finish "stop").

    `turn_index` counts the requests whose prompt extends an earlier request's prompt (0 = a conversation's
    first turn). Requests whose prompt exceeds `max_model_len` tokens are rejected like a real engine.
    """

    def __init__(self, tokenizer, script, max_model_len=None):
        self.tokenizer = tokenizer
        self.script = script
        self.max_model_len = max_model_len
        self.requests = []  # prompt texts
        self.turns = []

    async def generate(self, prompt_ids, sampling):
        await asyncio.sleep(0)
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
            raise RequestRejectedError(f"prompt of {len(prompt_ids)} tokens: max_model_len is {self.max_model_len}")
        text = self.tokenizer.decode(prompt_ids)
        self.requests.append(text)
        turn_index = text.count("<|assistant|>") - 1
        output = self.tokenizer.encode(self.script(text, turn_index)) + [EOS_ID]
        logprobs = [-0.01 * (k + 1) for k in range(len(output))]
        turn = TurnRecord(list(prompt_ids), output, logprobs, finish_reason="stop")
        self.turns.append(turn)
        return turn


@pytest.fixture
def char_tokenizer():
    return CharTokenizer()


@pytest.fixture
def forking_tokenizer():
    """A `CharTokenizer` whose template is not prefix-preserving (every tool round forks a new sequence)."""
    return CharTokenizer(prefix_preserving=False)


@pytest.fixture
def scripted_engine():
    """`scripted_engine(tokenizer, script, max_model_len=None)` builds a `ScriptedEngine`."""
    return ScriptedEngine


@pytest.fixture
def tool_call():
    """`tool_call(name, arguments)`: the Hermes text of one call."""
    return tool_call_text
