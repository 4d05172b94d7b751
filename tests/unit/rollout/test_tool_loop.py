"""The default multi-turn tool loop of `AsyncRolloutLoop` (docs/algorithms.md §3.1/§3.2) against a scripted engine."""

import asyncio
import random
import threading

import pytest

from rlasync.algorithms.grpo.loop import AsyncRolloutLoop, PromptLease
from rlasync.config import AsyncGRPOConfig
from rlasync.metrics import MetricSink


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


THREADS = []


def where_am_i() -> str:
    """Names the thread it runs on."""
    THREADS.append(threading.current_thread().name)
    return "here"


async def lookup(key: str) -> str:
    """Look a key up asynchronously.

    Args:
        key: the key
    """
    await asyncio.sleep(0)
    return f"value-of-{key}"


def explode() -> str:
    """Always fails."""
    raise RuntimeError("boom")


class Source:
    def __init__(self, rows):
        self.rows = list(rows)
        self.leased = []
        self.released = []

    def lease(self):
        if len(self.leased) >= len(self.rows):
            return None
        group_id = len(self.leased)
        lease = PromptLease(group_id, group_id, self.rows[group_id], 0)
        self.leased.append(lease)
        return lease

    def release(self, lease, reason):
        self.released.append((lease.group_id, reason))


class Sink:
    def __init__(self):
        self.results = []

    def put(self, result):
        self.results.append(result)


def index_reward(completions, **kwargs):
    return [float(i) for i in range(len(completions))]  # never a zero-std group: every group is kept


def question(text="What is 3 + 4?"):
    return {"prompt": [{"role": "user", "content": text}]}


def build_loop(tokenizer, engine, tools, rows=None, reward_funcs=(index_reward,), **config):
    fields = {
        "num_generations": 2,
        "max_completion_length": 256,
        "max_concurrent_rollouts": 4,
        "num_sampler_logprobs": 0,
        "score_centering": False,
    }
    return AsyncRolloutLoop(
        config=AsyncGRPOConfig(**{**fields, **config}),
        tokenizer=tokenizer,
        engine=engine,
        prompt_source=Source(rows or [question()]),
        sink=Sink(),
        reward_funcs=list(reward_funcs),
        tools=tools,
        rng=random.Random(0),
    )


def run_loop(loop):
    pushed = []
    loop._metrics_callback = pushed.extend
    asyncio.run(loop.run())
    sink = MetricSink()
    sink.update(pushed)
    return sink.reduce()


def completions(loop):
    return [sample.completion for result in loop.sink.results for sample in result.scored.samples]


def test_a_tool_result_reaches_the_next_prompt_and_the_completion(char_tokenizer, scripted_engine, tool_call):
    def script(prompt, turn):
        return "Adding." + tool_call("add", {"a": 3, "b": 4}) if turn == 0 else "It is 7."

    engine = scripted_engine(char_tokenizer, script)
    loop = build_loop(char_tokenizer, engine, [add])
    metrics = run_loop(loop)

    assert len(engine.requests) == 4  # 2 rollouts x 2 turns
    second_prompts = [text for text in engine.requests if text.count("<|assistant|>") == 2]
    assert len(second_prompts) == 2
    assert all("<|tool:add|>7<|assistant|>" in text for text in second_prompts)
    assert all(text.startswith("<bos>[tools: add]") for text in engine.requests)  # tools rendered every turn
    [result] = loop.sink.results
    assert result.scored.samples and not result.dropped
    for completion in completions(loop):
        assert completion == [
            {
                "role": "assistant",
                "content": "Adding.",
                "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}],
            },
            {"role": "tool", "name": "add", "content": "7"},
            {"role": "assistant", "content": "It is 7."},
        ]
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0
    assert all("tools/call_frequency" not in sample.metrics for sample in result.scored.samples)  # per rollout, not row
    assert metrics["tools/add/call_count"] == 2.0 and metrics["tools/parallel_calls_mean"] == 1.0
    assert metrics["tools/loop_exhausted_frac"] == 0.0
    assert metrics["rollout/turns_mean"] == 2.0
    assert metrics["rollout/fork_frac"] == 0.0 and metrics["rollout/drift_tokens_mean"] == 0.0
    generated = sum(len(turn.output_ids) for turn in engine.turns)
    assert metrics["completions/mean_length"] == generated / 2  # completion_ids = every turn's output


def test_training_sequences_train_exactly_the_generated_tokens_not_the_tool_output(
    char_tokenizer, scripted_engine, tool_call
):
    def script(prompt, turn):
        return tool_call("add", {"a": 3, "b": 4}) if turn == 0 else "7"

    engine = scripted_engine(char_tokenizer, script)
    loop = build_loop(char_tokenizer, engine, [add], num_generations=2, max_concurrent_rollouts=1)
    run_loop(loop)
    [result] = loop.sink.results
    assert len(result.scored.samples) == 2  # the template preserves prefixes: one sequence per rollout
    for index, sample in enumerate(result.scored.samples):
        first, second = engine.turns[2 * index : 2 * index + 2]
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids
        ids, mask = sample.input_ids.tolist(), sample.completion_mask.tolist()
        assert ids == second.prompt_ids + second.output_ids
        expected_mask = [0] * len(first.prompt_ids) + [1] * len(first.output_ids)
        expected_mask += [0] * (len(second.prompt_ids) - len(expected_mask)) + [1] * len(second.output_ids)
        assert mask == expected_mask
        context = char_tokenizer.decode([token for token, m in zip(ids, mask) if not m])
        assert "<|tool:add|>7<|assistant|>" in context  # the tool output is context, never trained
        trained = [token for token, m in zip(ids, mask) if m]
        assert trained == first.output_ids + second.output_ids
        assert sample.sampler_logprobs[[bool(m) for m in mask]].tolist() == pytest.approx(
            first.output_log_probs + second.output_log_probs
        )


def test_a_template_that_rewrites_history_forks_and_trains_every_generated_token_once(
    forking_tokenizer, scripted_engine, tool_call
):
    def script(prompt, turn):
        return tool_call("add", {"a": turn, "b": 1}) if turn < 2 else "done"

    engine = scripted_engine(forking_tokenizer, script)
    loop = build_loop(forking_tokenizer, engine, [add], num_generations=2, max_concurrent_rollouts=1)
    metrics = run_loop(loop)
    [result] = loop.sink.results
    assert len(result.scored.samples) == 6  # 3 turns per rollout, each turn a fork
    for index in range(2):
        turns = engine.turns[3 * index : 3 * index + 3]
        samples = result.scored.samples[3 * index : 3 * index + 3]
        for turn, sample in zip(turns, samples, strict=True):
            assert sample.input_ids.tolist() == turn.prompt_ids + turn.output_ids
            assert sample.completion_mask.tolist() == [0] * len(turn.prompt_ids) + [1] * len(turn.output_ids)
    assert metrics["rollout/samples_per_rollout"] == 3.0
    assert metrics["rollout/fork_frac"] == 1.0 and metrics["rollout/drift_tokens_max"] > 0


def test_parallel_calls_run_in_order_with_sync_async_unknown_and_failing_tools(
    char_tokenizer, scripted_engine, tool_call
):
    THREADS.clear()

    def script(prompt, turn):
        if turn > 0:
            return "done"
        calls = [
            ("lookup", {"key": "k"}),
            ("where_am_i", {}),
            ("missing", {"x": 1}),
            ("explode", {}),
        ]
        return "".join(tool_call(name, arguments) for name, arguments in calls)

    engine = scripted_engine(char_tokenizer, script)
    loop = build_loop(char_tokenizer, engine, [lookup, where_am_i, explode])
    metrics = run_loop(loop)
    for completion in completions(loop):
        tool_messages = completion[1:5]
        assert tool_messages == [
            {"role": "tool", "name": "lookup", "content": "value-of-k"},
            {"role": "tool", "name": "where_am_i", "content": "here"},
            {"role": "tool", "name": "missing", "content": str({"error": "unknown tool missing"})},
            {"role": "tool", "name": "explode", "content": str({"error": "boom"})},
        ]
        assert completion[-1] == {"role": "assistant", "content": "done"}
    assert metrics["tools/call_frequency"] == 4.0 and metrics["tools/failure_frequency"] == 0.5
    assert metrics["tools/parallel_calls_mean"] == 4.0
    assert metrics["tools/unknown_name_count"] == 2.0 and metrics["tools/explode/failure_count"] == 2.0
    assert metrics["tools/lookup/call_count"] == 2.0 and "tools/lookup/failure_count" not in metrics
    assert THREADS and all(name.startswith("rlasync-tool") for name in THREADS)
    assert loop._tool_executor is None  # shut down when run() ended


@pytest.mark.parametrize("max_iterations, expected_turns, expected_tool_messages", [(0, 1, 0), (1, 2, 1), (3, 4, 3)])
def test_max_tool_calling_iterations_bounds_the_rounds_of_tool_execution(
    char_tokenizer, scripted_engine, tool_call, max_iterations, expected_turns, expected_tool_messages
):
    engine = scripted_engine(char_tokenizer, lambda prompt, turn: tool_call("add", {"a": turn, "b": 1}))
    loop = build_loop(char_tokenizer, engine, [add], max_tool_calling_iterations=max_iterations)
    metrics = run_loop(loop)
    assert len(engine.requests) == 2 * expected_turns
    for completion in completions(loop):
        assert [m["role"] for m in completion].count("tool") == expected_tool_messages
        assert [m["role"] for m in completion].count("assistant") == expected_turns
        assert completion[-1]["role"] == "assistant" and completion[-1]["tool_calls"]  # its calls were not run
    assert metrics["tools/loop_exhausted_frac"] == 1.0
    assert metrics.get("tools/add/call_count", 0.0) == 2.0 * expected_tool_messages
    assert len(loop.sink.results[0].scored.samples) == 2  # one sequence per rollout (prefix-preserving template)
    # per rollout, every rollout: 0.0 when the tools were never run (the document's rule: logged whenever there are tools)
    assert metrics["tools/call_frequency"] == float(expected_tool_messages)


def test_malformed_tool_json_runs_nothing_and_ends_the_conversation(char_tokenizer, scripted_engine):
    bad = '<tool_call>{"name": "add", "arguments": {"a": </tool_call>'
    engine = scripted_engine(char_tokenizer, lambda prompt, turn: "Calling " + bad)
    loop = build_loop(char_tokenizer, engine, [add])
    metrics = run_loop(loop)
    assert len(engine.requests) == 2  # one turn per rollout
    for completion in completions(loop):
        assert completion == [{"role": "assistant", "content": 'Calling {"name": "add", "arguments": {"a":'}]
    assert metrics["tools/parse_failure_count"] == 2.0
    assert "tools/add/call_count" not in metrics and metrics["tools/loop_exhausted_frac"] == 0.0


def test_a_conversation_outgrowing_the_engine_ends_cleanly_instead_of_failing_the_group(
    char_tokenizer, scripted_engine, tool_call
):
    def script(prompt, turn):
        return tool_call("add", {"a": 1, "b": 2})

    probe = char_tokenizer.render_text([question()["prompt"][0]], [add])
    engine = scripted_engine(char_tokenizer, script, max_model_len=len(char_tokenizer.encode(probe)) + 60)
    loop = build_loop(char_tokenizer, engine, [add])
    metrics = run_loop(loop)
    assert loop.prompt_source.released == []
    [result] = loop.sink.results
    assert len(result.scored.samples) == 2
    for completion in completions(loop):
        assert [m["role"] for m in completion] == ["assistant", "tool"]
    assert metrics["rollout/context_exhausted_count"] == 2.0
    assert metrics["rollout/turns_mean"] == 1.0


def test_a_first_prompt_longer_than_the_engine_still_fails_its_group(char_tokenizer, scripted_engine):
    engine = scripted_engine(char_tokenizer, lambda prompt, turn: "x", max_model_len=5)
    loop = build_loop(char_tokenizer, engine, [add])
    metrics = run_loop(loop)
    assert loop.sink.results == [] and loop.prompt_source.released == [(0, "failed")]
    assert metrics["rollout/failed_group_count"] == 1.0


def test_without_tools_the_loop_stays_single_turn_and_does_not_parse_tool_calls(
    char_tokenizer, scripted_engine, tool_call
):
    engine = scripted_engine(char_tokenizer, lambda prompt, turn: tool_call("add", {"a": 1, "b": 2}))
    loop = build_loop(char_tokenizer, engine, None)
    metrics = run_loop(loop)
    assert len(engine.requests) == 2 and not any("[tools:" in text for text in engine.requests)
    for completion in completions(loop):
        assert len(completion) == 1 and "tool_calls" not in completion[0]
    assert "tools/loop_exhausted_frac" not in metrics
