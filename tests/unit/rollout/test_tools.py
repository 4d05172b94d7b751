"""Parsing tool calls out of assistant outputs and executing them (docs/algorithms.md §3.1 parsing, §3.2 execution)."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlasync.metrics import MetricSink
from rlasync.rollout.tools import (
    execute_tool_calls,
    make_tool_call,
    parse_response,
    parse_tool_call_text,
    tools_by_name,
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


async def async_echo(text: str) -> str:
    """Echo asynchronously.

    Args:
        text: what to echo
    """
    await asyncio.sleep(0)
    return f"echo:{text}"


def explode() -> str:
    """Always fails."""
    raise RuntimeError("boom")


TOOLS = tools_by_name([add, async_echo, explode])


def run(calls, tools=TOOLS, executor=None):
    return asyncio.run(execute_tool_calls(calls, tools, executor))


def reduced(metrics):
    sink = MetricSink()
    sink.update(metrics)
    return sink.reduce()


# ---- parsing ----------------------------------------------------------------------------------------------


def test_a_hermes_tool_call_becomes_an_openai_call_and_leaves_the_content(char_tokenizer, tool_call):
    text = "Let me add.\n" + tool_call("add", {"a": 3, "b": 4}) + "<eos>"
    parsed = parse_response(char_tokenizer, char_tokenizer.encode(text), [1])
    assert parsed.message == {
        "role": "assistant",
        "content": "Let me add.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}],
    }
    assert parsed.parse_failures == 0


def test_several_calls_in_one_message_keep_their_order(char_tokenizer, tool_call):
    text = tool_call("add", {"a": 1, "b": 2}) + "\n" + tool_call("async_echo", {"text": "x"}) + "<eos>"
    parsed = parse_response(char_tokenizer, char_tokenizer.encode(text))
    assert [call["function"]["name"] for call in parsed.tool_calls] == ["add", "async_echo"]
    assert parsed.message["content"] == ""


def test_without_tool_calls_the_message_is_the_plain_decoded_text(char_tokenizer):
    ids = char_tokenizer.encode("Just 7.<eos>")
    parsed = parse_response(char_tokenizer, ids)
    assert parsed.message == {"role": "assistant", "content": "Just 7."}
    assert "tool_calls" not in parsed.message and parsed.parse_failures == 0


def test_malformed_json_gives_no_call_counts_a_failure_and_keeps_the_text(char_tokenizer, tool_call):
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>'
    text = "Try: " + bad + tool_call("add", {"a": 1, "b": 1}) + "<eos>"
    parsed = parse_response(char_tokenizer, char_tokenizer.encode(text))
    assert parsed.parse_failures == 1
    assert [call["function"]["arguments"] for call in parsed.tool_calls] == [{"a": 1, "b": 1}]
    # the malformed block's text stays (its markers are special tokens here, stripped like every special token)
    assert parsed.message["content"] == 'Try: \n{"name": "add", "arguments": {"a": 1,'


@pytest.mark.parametrize(
    "body",
    ['{"arguments": {}}', '{"name": "add", "arguments": [1, 2]}', "[1, 2]", '{"name": 5}'],
)
def test_a_block_without_a_name_or_object_arguments_is_a_parse_failure(body):
    content, calls, failures = parse_tool_call_text(f"<tool_call>{body}</tool_call>")
    assert calls == [] and failures == 1 and body in content


def test_string_arguments_and_a_truncated_block_are_handled():
    content, calls, failures = parse_tool_call_text(
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 5}"}</tool_call> then <tool_call>{"name'
    )
    assert calls == [make_tool_call("add", {"a": 2, "b": 5})]
    assert failures == 1 and content.endswith('<tool_call>{"name')


def test_the_tokenizers_own_parser_is_used_when_it_has_a_response_template(char_tokenizer):
    class TemplatedTokenizer(type(char_tokenizer)):
        response_template = {"x-regex": "..."}

        def parse_response(self, response, schema=None, *, prefix=None, tools=None):
            self.seen = (list(response), list(prefix), tools)
            return {"role": "assistant", "content": "hi", "tool_calls": [{"name": "add", "arguments": {"a": 1}}]}

    tokenizer = TemplatedTokenizer()
    parsed = parse_response(tokenizer, [50, 51], [1, 2], tools=[add])
    assert tokenizer.seen == ([50, 51], [1, 2], [add])
    assert parsed.message == {"role": "assistant", "content": "hi", "tool_calls": [make_tool_call("add", {"a": 1})]}


def test_a_failing_tokenizer_parser_falls_back_to_the_text_format(char_tokenizer, tool_call):
    class BrokenTokenizer(type(char_tokenizer)):
        response_template = {}

        def parse_response(self, *args, **kwargs):
            raise ValueError("no match")

    tokenizer = BrokenTokenizer()
    parsed = parse_response(tokenizer, tokenizer.encode(tool_call("add", {"a": 1, "b": 2})), [1])
    assert parsed.tool_calls == [make_tool_call("add", {"a": 1, "b": 2})]


def test_duplicate_tool_names_are_rejected():
    def add(x: int) -> int:  # noqa: F811 - the point of the test
        return x

    with pytest.raises(ValueError, match="'add'"):
        tools_by_name([globals()["add"], add])


# ---- execution --------------------------------------------------------------------------------------------


def test_sync_and_async_tools_run_and_answer_in_call_order():
    with ThreadPoolExecutor(2) as executor:
        messages, calls, failures, metrics = run(
            [make_tool_call("async_echo", {"text": "hi"}), make_tool_call("add", {"a": 2, "b": 3})], executor=executor
        )
    assert messages == [
        {"role": "tool", "name": "async_echo", "content": "echo:hi"},
        {"role": "tool", "name": "add", "content": "5"},
    ]
    assert (calls, failures) == (2, 0)
    values = reduced(metrics)
    assert values["tools/add/call_count"] == 1.0 and values["tools/async_echo/call_count"] == 1.0
    assert values["tools/parallel_calls_mean"] == 2.0
    assert values["tools/latency_s"] >= 0.0 and "tools/add/latency_s" in values
    assert "tools/add/failure_count" not in values


def test_sync_tools_run_on_the_given_thread_pool():
    seen = []

    def where() -> str:
        """Reports its thread."""
        seen.append(threading.current_thread().name)
        return "ok"

    with ThreadPoolExecutor(1, thread_name_prefix="tool-pool") as executor:
        run([make_tool_call("where")], tools={"where": where}, executor=executor)
    assert seen and seen[0].startswith("tool-pool")


def test_an_unknown_tool_is_a_failure_without_latency():
    messages, calls, failures, metrics = run([make_tool_call("nope", {"x": 1})])
    assert messages == [{"role": "tool", "name": "nope", "content": str({"error": "unknown tool nope"})}]
    assert (calls, failures) == (1, 1)
    values = reduced(metrics)
    assert values["tools/unknown_name_count"] == 1.0
    assert values["tools/nope/call_count"] == 1.0 and values["tools/nope/failure_count"] == 1.0
    assert "tools/latency_s" not in values


def test_a_raising_tool_is_a_failure_with_its_error_and_a_latency(caplog, monkeypatch):
    monkeypatch.setattr("rlasync.rollout.tools._warned_tools", set())
    with caplog.at_level("WARNING"):
        messages, calls, failures, metrics = run([make_tool_call("explode"), make_tool_call("add", {"a": 1})])
        run([make_tool_call("explode")])
    warned = [r.getMessage() for r in caplog.records if "explode" in r.getMessage()]
    assert len(warned) == 1, warned  # once per tool
    assert warned[0].startswith("tool `explode` (tests.unit.rollout.test_tools.explode) raised RuntimeError: boom")
    assert messages[0] == {"role": "tool", "name": "explode", "content": str({"error": "boom"})}
    assert messages[1]["name"] == "add" and "error" in messages[1]["content"]  # missing argument b
    assert (calls, failures) == (2, 2)
    values = reduced(metrics)
    assert values["tools/explode/failure_count"] == 1.0 and values["tools/add/failure_count"] == 1.0
    assert "tools/explode/latency_s" in values and "tools/unknown_name_count" not in values


def test_no_calls_give_no_metrics():
    assert tuple(run([])) == ([], 0, 0, [])
