"""Environments in the rollout loop (docs/algorithms.md §3.4): probing, reset observations, per-environment tools, rewards."""

import asyncio
import itertools
import random

import pytest

from rlasync.algorithms.grpo.loop import AsyncRolloutLoop, PromptLease
from rlasync.config import AsyncGRPOConfig
from rlasync.metrics import MetricSink
from rlasync.rollout.environments import EnvironmentHookError, append_to_last_message, probe_environments

BUILT = []
RESETS = []


def shout(text: str) -> str:
    """A standalone tool.

    Args:
        text: what to shout
    """
    return text.upper()


class Counter:
    """Counts; its reward is the final value."""

    _ids = itertools.count()

    def __init__(self):
        self.instance_id = next(self._ids)
        self.value = 0
        BUILT.append(self)

    @property
    def broken(self):
        raise AssertionError("probing must not evaluate properties")

    def reset(self, start=0, **row):
        RESETS.append(("Counter", self.instance_id, dict(row, start=start)))
        self.value = int(start)
        return f" [counter at {start}]"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.value += by
        return self.value

    def _private(self):
        return "not a tool"

    def get_reward(self) -> float:
        return float(self.value)


class Echo:
    """No reward; an async tool."""

    def reset(self, **row):
        RESETS.append(("Echo", id(self), dict(row)))
        return None

    async def echo(self, text: str) -> str:
        """Echo.

        Args:
            text: what to echo
        """
        return text


class NoReset:
    def step(self):
        return 0


class Source:
    def __init__(self, rows):
        self.rows = list(rows)
        self.leased = []

    def lease(self):
        if len(self.leased) >= len(self.rows):
            return None
        lease = PromptLease(len(self.leased), len(self.leased), self.rows[len(self.leased)], 0)
        self.leased.append(lease)
        return lease

    def release(self, lease, reason):
        raise AssertionError(f"lease {lease.group_id} released: {reason}")


class Sink:
    def __init__(self):
        self.results = []

    def put(self, result):
        self.results.append(result)


def build_loop(tokenizer, engine, rows, environment_factory, reward_funcs=(), tools=None, **config):
    fields = {
        "num_generations": 2,
        "max_completion_length": 256,
        "max_concurrent_rollouts": 2,
        "num_sampler_logprobs": 0,
        "score_centering": False,
    }
    return AsyncRolloutLoop(
        config=AsyncGRPOConfig(**{**fields, **config}),
        tokenizer=tokenizer,
        engine=engine,
        prompt_source=Source(rows),
        sink=Sink(),
        reward_funcs=list(reward_funcs),
        tools=tools,
        environment_factory=environment_factory,
        rng=random.Random(0),
    )


def run_loop(loop):
    pushed = []
    loop._metrics_callback = pushed.extend
    asyncio.run(loop.run())
    sink = MetricSink()
    sink.update(pushed)
    return sink.reduce()


@pytest.fixture(autouse=True)
def clear_records():
    BUILT.clear()
    RESETS.clear()


def test_reset_extends_the_prompt_tools_act_on_the_instance_and_get_reward_is_a_column(
    char_tokenizer, scripted_engine, tool_call
):
    def script(prompt, turn):
        start = int(prompt.split("[counter at ")[1].split("]")[0])
        return tool_call("increment", {"by": start + 1}) if turn == 0 else "done"

    rows = [
        {"prompt": [{"role": "user", "content": "Count."}], "start": 1},
        {"prompt": [{"role": "user", "content": "Count."}], "start": 5},
    ]
    original = [dict(row, prompt=[dict(m) for m in row["prompt"]]) for row in rows]
    engine = scripted_engine(char_tokenizer, script)
    loop = build_loop(char_tokenizer, engine, rows, Counter, tools=[shout], max_concurrent_rollouts=1)
    metrics = run_loop(loop)

    assert rows == original  # the dataset rows are never mutated
    first_turns = [text for text in engine.requests if text.count("<|assistant|>") == 1]
    assert sorted(first_turns) == sorted(
        ["<bos>[tools: shout,increment]<|user|>Count. [counter at 1]<|assistant|>"] * 2
        + ["<bos>[tools: shout,increment]<|user|>Count. [counter at 5]<|assistant|>"] * 2
    )
    # reset got the whole row (prompt included) as keyword arguments
    assert [(entry[0], entry[2]["start"], "prompt" in entry[2]) for entry in RESETS] == [
        ("Counter", 1, True),
        ("Counter", 1, True),
        ("Counter", 5, True),
        ("Counter", 5, True),
    ]
    assert len(BUILT) == 1  # the probe instance is reused (one rollout at a time)
    by_start = {1: 1 + 2, 5: 5 + 6}  # start + (start + 1)
    for result, row in zip(loop.sink.results, rows, strict=True):
        table = result.scored.reward_table
        assert table.names == ("Counter",)
        assert table.column("Counter").tolist() == [by_start[row["start"]]] * 2
        for sample in result.scored.samples:
            assert sample.prompt[-1]["content"] == f"Count. [counter at {row['start']}]"
    assert metrics["env/reset_s"] >= 0.0 and metrics["env/reward_s"] >= 0.0
    assert metrics["tools/increment/call_count"] == 4.0


def test_reward_functions_score_next_to_the_environment_column(char_tokenizer, scripted_engine):
    def length_reward(completions, start, **kwargs):
        assert start == [3, 3]  # dataset columns still reach the reward functions
        return [0.5, 1.5]

    engine = scripted_engine(char_tokenizer, lambda prompt, turn: "no tools needed")
    rows = [{"prompt": [{"role": "user", "content": "Hi"}], "start": 3}]
    loop = build_loop(char_tokenizer, engine, rows, Counter, reward_funcs=[length_reward])
    run_loop(loop)
    [result] = loop.sink.results
    assert result.scored.reward_table.names == (
        "length_reward",
        "Counter",
    )
    assert result.scored.rewards.tolist() == [3.5, 4.5]


def test_rows_are_routed_to_their_named_environment_with_only_its_tools(char_tokenizer, scripted_engine, tool_call):
    def script(prompt, turn):
        if turn > 0:
            return "ok"
        return tool_call("echo", {"text": "hey"}) if "echo" in prompt.split("]")[0] else "plain"

    rows = [
        {"prompt": [{"role": "user", "content": "A"}], "environment": "counter", "start": 2},
        {"prompt": [{"role": "user", "content": "B"}], "environment": "echo"},
    ]
    engine = scripted_engine(char_tokenizer, script)
    loop = build_loop(
        char_tokenizer,
        engine,
        rows,
        {"counter": Counter, "echo": Echo},
        reward_funcs=[lambda completions, **kw: [0.0, 1.0]],
    )
    metrics = run_loop(loop)
    assert {text.split("<|user|>")[0] for text in engine.requests if "<|user|>A" in text} == {"<bos>[tools: increment]"}
    assert {text.split("<|user|>")[0] for text in engine.requests if "<|user|>B" in text} == {"<bos>[tools: echo]"}
    assert sorted({(kind, tuple(sorted(kwargs))) for kind, _, kwargs in RESETS}) == [
        ("Counter", ("prompt", "start")),  # the environment column is not passed to reset
        ("Echo", ("prompt",)),
    ]
    counter_group, echo_group = loop.sink.results
    assert counter_group.scored.reward_table.names == (
        "<lambda>",
        "Counter",
    )
    assert counter_group.scored.reward_table.column("Counter").tolist() == [2.0, 2.0]
    assert echo_group.scored.reward_table.names == ("<lambda>",)  # Echo owns no reward
    for sample in echo_group.scored.samples:
        assert sample.completion[1] == {"role": "tool", "name": "echo", "content": "hey"}
    assert metrics["tools/echo/call_count"] == 2.0


def test_a_row_naming_an_unknown_environment_stops_the_loop_with_the_fix(char_tokenizer, scripted_engine):
    rows = [{"prompt": [{"role": "user", "content": "A"}], "environment": "chess"}]
    loop = build_loop(
        char_tokenizer,
        scripted_engine(char_tokenizer, lambda prompt, turn: "x"),
        rows,
        {"counter": Counter, "echo": Echo},
        reward_funcs=[lambda completions, **kw: [0.0, 1.0]],
    )
    with pytest.raises(ValueError, match=r"environment 'chess' is not among the environments \['counter', 'echo'\]"):
        asyncio.run(loop.run())


def test_probing_lists_class_methods_without_evaluating_properties():
    [spec] = probe_environments(Counter).values()
    assert spec.key is None and spec.cls is Counter and spec.name == "Counter"
    assert spec.tool_names == ("increment",) and spec.owns_reward
    assert spec.pool == BUILT  # the probe instance seeds the pool
    specs = probe_environments({"e": Echo, "c": Counter})
    assert list(specs) == ["e", "c"] and not specs["e"].owns_reward and specs["e"].tool_names == ("echo",)


def test_construction_errors_name_the_field_and_the_fix(char_tokenizer, scripted_engine):
    engine = scripted_engine(char_tokenizer, lambda prompt, turn: "x")
    rows = [{"prompt": [{"role": "user", "content": "A"}]}]
    with pytest.raises(ValueError, match="NoReset .*has no reset method"):
        build_loop(char_tokenizer, engine, rows, {"bad": NoReset}, reward_funcs=[len])
    with pytest.raises(TypeError, match=r"environment_factory\['x'\] is a int"):
        build_loop(char_tokenizer, engine, rows, {"x": 3}, reward_funcs=[len])
    with pytest.raises(ValueError, match="No reward source"):
        build_loop(char_tokenizer, engine, rows, Echo)  # no reward function and Echo has no get_reward
    with pytest.raises(ValueError, match="two tools are named 'increment'"):

        def increment(by: int) -> int:
            """Clashes with Counter.increment.

            Args:
                by: amount
            """
            return by

        build_loop(char_tokenizer, engine, rows, Counter, tools=[increment])
    build_loop(char_tokenizer, engine, rows, Counter)  # get_reward alone is a reward source


def test_observations_append_to_string_and_block_contents_without_mutating():
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert append_to_last_message(prompt, " obs") == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q obs"},
    ]
    assert prompt[-1]["content"] == "Q"
    blocks = [{"role": "user", "content": [{"type": "image"}]}]
    assert append_to_last_message(blocks, "see")[-1]["content"] == [{"type": "image"}, {"type": "text", "text": "see"}]
    assert append_to_last_message(prompt, [{"type": "image"}])[-1]["content"] == [
        {"type": "text", "text": "Q"},
        {"type": "image"},
    ]


class BadReset(Counter):
    def reset(self, **row):
        raise KeyError("start")


class BadReward(Counter):
    def get_reward(self):
        return "ten"


def broken_factory():
    raise OSError("no board")


@pytest.mark.parametrize(
    "factory, expected",
    [
        (
            BadReset,
            r"environment tests\.unit\.rollout\.test_environments\.BadReset\.reset \(reset\(\*\*row\) with the "
            r"columns of row 0\) raised KeyError: 'start'",
        ),
        (
            BadReward,
            r"environment tests\.unit\.rollout\.test_environments\.BadReward\.get_reward returned 'ten' \(str\) "
            r"after the rollout of row 0: return a number",
        ),
    ],
    ids=["reset-raises", "get-reward-not-a-number"],
)
def test_an_environment_hook_that_fails_is_named_with_the_row(char_tokenizer, scripted_engine, factory, expected):
    rows = [{"prompt": [{"role": "user", "content": "A"}]}]
    loop = build_loop(char_tokenizer, scripted_engine(char_tokenizer, lambda prompt, turn: "x"), rows, factory)
    with pytest.raises(EnvironmentHookError, match=expected) as info:
        asyncio.run(loop.run())
    assert factory is BadReward or isinstance(info.value.__cause__, KeyError)


def test_a_factory_that_raises_is_named():
    with pytest.raises(
        EnvironmentHookError,
        match=r"environment_factory\['b'\] \(tests\.unit\.rollout\.test_environments\.broken_factory\) raised "
        r"OSError when called to build an environment: no board",
    ):
        probe_environments({"b": broken_factory})
