"""The prefix-preserving Qwen3 training chat template (rlasync.data.chat_templates, docs/algorithms.md §3.3).

The tokenizer is built offline: one id per character plus Qwen3's special tokens, so token prefixes are exactly
text prefixes. `STOCK_QWEN3_STYLE` renders as Qwen3's own template does: an assistant message's `<think>` block
only after the last user query and only when it is the last message or has reasoning.
"""

import asyncio
import json
import random
import string

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlasync.algorithms.grpo.loop import AsyncRolloutLoop, PromptLease
from rlasync.config import AsyncGRPOConfig
from rlasync.data.chat_templates import (
    QWEN3_TRAINING_TEMPLATE,
    is_prefix_preserving,
    template_family,
    training_chat_template,
    with_training_chat_template,
)
from rlasync.metrics import MetricSink
from rlasync.records import TurnRecord

STOCK_QWEN3_STYLE = r"""{%- macro system_block(system_text) -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if system_text -%}{{- system_text + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' -}}
{{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' -}}
{{- '\n</tool_call><|im_end|>\n' -}}
{%- elif system_text is not none -%}
{{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' -}}
{%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
{{- system_block(messages[0].content if messages[0].content is string else '') -}}
{%- set history = messages[1:] -%}
{%- else -%}
{{- system_block(none) -}}
{%- set history = messages -%}
{%- endif -%}
{%- set ns = namespace(last_query_index=history|length - 1, searching=true) -%}
{%- for message in history[::-1] -%}
{%- set index = (history|length - 1) - loop.index0 -%}
{%- if ns.searching and message.role == 'user' -%}
{%- set ns.searching = false -%}
{%- set ns.last_query_index = index -%}
{%- endif -%}
{%- endfor -%}
{%- for message in history -%}
{%- set text = message.content if message.content is string else '' -%}
{%- if message.role == 'user' or message.role == 'system' -%}
{{- '<|im_start|>' + message.role + '\n' + text + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set reasoning = '' -%}
{%- if message.reasoning_content is string -%}
{%- set reasoning = message.reasoning_content -%}
{%- elif '<think>' in text and '</think>' in text -%}
{%- set reasoning = text.split('</think>')[0].split('<think>')[-1] -%}
{%- set text = text.split('</think>')[-1] -%}
{%- endif -%}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) -%}
{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + text.lstrip('\n') -}}
{%- else -%}
{{- '<|im_start|>assistant\n' + text -}}
{%- endif -%}
{%- for call in message.tool_calls or [] -%}
{%- set function = call.function if call.function is defined else call -%}
{%- if not loop.first or text -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n{"name": "' + function.name + '", "arguments": ' -}}
{{- function.arguments if function.arguments is string else function.arguments | tojson -}}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or history[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + text + '\n</tool_response>' -}}
{%- if loop.last or history[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]


def char_tokenizer(template):
    vocab = {token: i for i, token in enumerate([*SPECIALS, "<unk>", *sorted(set(string.printable))])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[1:],
        chat_template=template,
    )


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def call_text(a, b):
    return "<tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}) + "\n</tool_call>"


def ids_of(rendered):
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def render(tokenizer, messages, **kwargs):
    return ids_of(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=[add], **kwargs))


def tool_loop(tokenizer, outputs, enable_thinking, follow_up=None):
    """Turns (prompt ids, output ids) of a scripted tool loop; `outputs[k]` is turn k's generated text (without
    `<|im_end|>`). After a turn without a call, `follow_up` (if given) is a new user message."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 4, then 7 + 1?"}]
    turns = []
    for text in outputs:
        prompt = render(tokenizer, messages, enable_thinking=enable_thinking)
        output = tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
        turns.append((prompt, output))
        reasoning, _, content = text.rpartition("</think>")
        content = content.lstrip("\n")
        message = {"role": "assistant", "content": content.split("<tool_call>")[0].rstrip("\n")}
        if reasoning:
            message["reasoning_content"] = reasoning.replace("<think>", "").strip("\n")
        if "<tool_call>" in content:
            call = json.loads(content.split("<tool_call>")[1].split("</tool_call>")[0])
            message["tool_calls"] = [{"type": "function", "function": call}]
            messages += [message, {"role": "tool", "name": "add", "content": str(add(**call["arguments"]))}]
        else:
            messages += [message, {"role": "user", "content": follow_up or "thanks"}]
    return turns


def prefix_breaks(turns):
    """Indices k >= 1 whose prompt does not start with turn k-1's prompt + output."""
    return [
        k
        for k in range(1, len(turns))
        if turns[k][0][: len(turns[k - 1][0]) + len(turns[k - 1][1])] != turns[k - 1][0] + turns[k - 1][1]
    ]


NO_THINKING = ["Adding.\n" + call_text(3, 4), call_text(7, 1), "It is 7, then 8."]
THINKING = [
    "<think>\nFirst 3 + 4.\n</think>\n\n" + call_text(3, 4),
    "<think>\nNow 7 + 1.\n</think>\n\n" + call_text(7, 1),
    "<think>\nDone.\n</think>\n\nIt is 7, then 8.",
    "<think>\nAgain.\n</think>\n\nStill 8.",
]


@pytest.mark.parametrize("outputs, enable_thinking", [(NO_THINKING, False), (THINKING, True)])
def test_the_training_template_keeps_every_turn_a_prefix_of_the_next(outputs, enable_thinking):
    turns = tool_loop(char_tokenizer(QWEN3_TRAINING_TEMPLATE), outputs, enable_thinking)
    assert prefix_breaks(turns) == []


def test_the_stock_qwen3_template_rewrites_earlier_turns():
    stock = char_tokenizer(STOCK_QWEN3_STYLE)
    # enable_thinking=False: the held `<think>\n\n</think>\n\n` of a tool-calling answer is dropped once the tool replies
    assert prefix_breaks(tool_loop(stock, NO_THINKING, False)) == [1, 2]
    # thinking: within one user query the reasoning is kept, a new user query drops all earlier reasoning
    assert prefix_breaks(tool_loop(stock, THINKING, True)) == [3]


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_the_training_template_renders_the_latest_turn_as_the_stock_one(enable_thinking):
    stock, training = char_tokenizer(STOCK_QWEN3_STYLE), char_tokenizer(QWEN3_TRAINING_TEMPLATE)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "3 + 4?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "add",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}],
        },
        {"role": "tool", "name": "add", "content": "7"},
        {"role": "tool", "name": "add", "content": "7 again"},
    ]
    for end in (2, 4, 5):  # what the model is prompted with is the same text it was trained to continue
        kwargs = {"enable_thinking": enable_thinking}
        assert render(training, messages[:end], **kwargs) == render(stock, messages[:end], **kwargs)
    text = training.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    assert (
        text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_probe_and_the_swap():
    stock, training = char_tokenizer(STOCK_QWEN3_STYLE), char_tokenizer(QWEN3_TRAINING_TEMPLATE)
    assert template_family(stock) == template_family(training) == "qwen3"
    assert training_chat_template(stock) == QWEN3_TRAINING_TEMPLATE
    assert not is_prefix_preserving(stock, {"enable_thinking": False}, [add])
    assert is_prefix_preserving(training, {"enable_thinking": False}, [add])
    patched = with_training_chat_template(stock, {"enable_thinking": False}, [add])
    assert patched is not stock and patched.chat_template == QWEN3_TRAINING_TEMPLATE
    assert stock.chat_template == STOCK_QWEN3_STYLE  # the caller's tokenizer is left as it was
    assert with_training_chat_template(training) is training
    chatml = char_tokenizer(
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    assert template_family(chatml) is None and with_training_chat_template(chatml) is chatml


# ---- the rollout loop: rollout/fork_frac with each template ---------------------------------------------------


class Engine:
    """Answers turn k of a conversation with `NO_THINKING[k]` + `<|im_end|>`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def generate(self, prompt_ids, sampling):
        await asyncio.sleep(0)
        turn = self.tokenizer.decode(prompt_ids).count("<tool_response>")
        output = self.tokenizer.encode(NO_THINKING[turn] + "<|im_end|>", add_special_tokens=False)
        return TurnRecord(list(prompt_ids), output, [-0.1] * len(output), finish_reason="stop")


class Source:
    def __init__(self):
        self.leased = 0

    def lease(self):
        if self.leased:
            return None
        self.leased += 1
        return PromptLease(0, 0, {"prompt": [{"role": "user", "content": "3 + 4, then 7 + 1?"}]}, 0)

    def release(self, lease, reason):
        pass


class Sink:
    def __init__(self):
        self.results = []

    def put(self, result):
        self.results.append(result)


def run_tool_loop(tokenizer):
    loop = AsyncRolloutLoop(
        config=AsyncGRPOConfig(
            num_generations=2,
            max_completion_length=256,
            max_concurrent_rollouts=2,
            num_sampler_logprobs=0,
            score_centering=False,
            chat_template_kwargs={"enable_thinking": False},
        ),
        tokenizer=tokenizer,
        engine=Engine(tokenizer),
        prompt_source=Source(),
        sink=Sink(),
        reward_funcs=[lambda completions, **kw: [float(i) for i in range(len(completions))]],
        tools=[add],
        rng=random.Random(0),
    )
    pushed = []
    loop._metrics_callback = pushed.extend
    asyncio.run(loop.run())
    sink = MetricSink()
    sink.update(pushed)
    return loop, sink.reduce()


def test_the_tool_loop_renders_qwen3_with_the_training_template_and_does_not_fork():
    stock = char_tokenizer(STOCK_QWEN3_STYLE)
    loop, metrics = run_tool_loop(stock)
    assert loop.tokenizer.chat_template == QWEN3_TRAINING_TEMPLATE  # swapped in because tools are on
    assert metrics["rollout/fork_frac"] == 0.0 and metrics["rollout/drift_tokens_max"] == 0.0
    assert metrics["rollout/samples_per_rollout"] == 1.0
    [result] = loop.sink.results
    assert [sample.completion_mask.sum() for sample in result.scored.samples] == [
        sum(len(stock.encode(text + "<|im_end|>", add_special_tokens=False)) for text in NO_THINKING)
    ] * 2  # every generated token trained, in one sample per rollout


def test_the_stock_template_forks_in_the_tool_loop():
    """Control: the same loop with the stock template (its family unknown to the swap) forks at every tool turn."""
    stock = char_tokenizer(STOCK_QWEN3_STYLE.replace("last_query_index", "last_user_index"))
    loop, metrics = run_tool_loop(stock)
    assert loop.tokenizer is stock
    assert metrics["rollout/fork_frac"] == 1.0 and metrics["rollout/samples_per_rollout"] == 3.0
