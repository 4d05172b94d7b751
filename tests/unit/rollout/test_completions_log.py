"""log_completions: one table per logging step (a uniform sample of the window's completions, at most
num_completions_to_print), and a group as text."""

import asyncio
import math
import random

from rlasync.rollout.completions_log import (
    CompletionRow,
    CompletionSampler,
    StepCompletionsPrinter,
    format_group,
    format_step,
)


def test_a_group_prints_its_prompt_and_each_completion_with_reward_and_advantage():
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2 + 3?"}]
    completions = [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "6"}], "seven"]
    text = format_group(prompt, completions, [1.0, 0.0, None], [0.7, -0.7, 0.0], group_id=3, policy_version=12)
    lines = text.splitlines()
    assert lines[0] == "group 3 (policy v12) prompt: What is 2 + 3?"
    assert lines[1] == "  [0] reward 1 advantage 0.7 | 5"
    assert lines[2] == "  [1] reward 0 advantage -0.7 | 6"
    assert lines[3] == "  [2] reward — advantage 0 | seven"  # unscorable: no reward
    assert len(lines) == 4


def test_num_completions_to_print_caps_the_rows_and_long_texts_are_cut():
    completions = ["x" * 1000, "b", "c", "d"]
    text = format_group("plain prompt", completions, [math.pi] * 4, None, group_id=0, policy_version=0, limit=2)
    lines = text.splitlines()
    assert len(lines) == 4 and lines[-1] == "  ... 2 more (num_completions_to_print=2)"
    assert " … " in lines[1] and len(lines[1]) < 500 and "reward 3.14 advantage —" in lines[1]


def test_a_window_keeps_a_uniform_sample_of_at_most_num_completions_to_print():
    sampler = CompletionSampler(3, random.Random(1))
    for group in range(10):
        sampler.add_group(f"q{group}", [f"a{group}-{i}" for i in range(4)], [1.0, 0.0, None, 0.5], None, group)
    rows = sampler.drain()
    assert len(rows) == 3 and all(isinstance(row, CompletionRow) for row in rows)
    assert len({row.policy_version for row in rows}) > 1  # not only the first groups: a sample of the window
    assert sampler.drain() == []  # drained: the next window starts empty
    everything = CompletionSampler(None)
    everything.add_group("q", ["a", "b"], [1.0, 0.0], [0.5, -0.5], 3)
    assert [(r.completion, r.reward, r.advantage) for r in everything.drain()] == [("a", 1.0, 0.5), ("b", 0.0, -0.5)]


def test_one_table_per_logging_step_of_at_most_the_limit():
    printed = []
    rows = [CompletionRow("q", f"a{i}", 1.0, 0.0, 2) for i in range(7)]

    async def drain():
        return list(rows)

    printer = StepCompletionsPrinter(drain, 5, printer=lambda rows, step: printed.append((step, list(rows))))
    asyncio.run(printer.after_log(4))
    assert len(printed) == 1 and printed[0][0] == 4 and len(printed[0][1]) == 5
    rows.clear()
    asyncio.run(printer.after_log(6))
    assert len(printed) == 1  # a window without completions prints nothing
    text = format_step([CompletionRow("What is 2 + 3?", "5", 1.0, 0.7, 12)], step=8)
    assert text.splitlines() == ["step 8: 1 completions", "  [v12] reward 1 advantage 0.7 | What is 2 + 3? -> 5"]


def test_the_step_loop_prints_after_each_logged_window_only(tmp_path):
    from rlasync.driver import Checkpointer, StepLoop, StepSettings
    from tests.unit.driver.test_step_loop import FakeFleet, FakeQueue, FakeWeights, Journal, RecordingSink
    from tests.unit.driver.test_step_loop_callbacks import TokenLearners

    class Printer:
        steps = []

        async def after_log(self, step):
            self.steps.append(step)

    journal = Journal()
    loop = StepLoop(
        StepSettings(horizon=5, tokens_per_step=10, logging_steps=2, save_steps=100, poll_s=0.0),
        queue=FakeQueue(journal, num_samples=100),
        learners=TokenLearners(),
        weights=FakeWeights(journal),
        fleet=FakeFleet(journal, None),
        checkpointer=Checkpointer(tmp_path),
        sinks=[RecordingSink()],
        state={},
        completions=Printer(),
    )
    asyncio.run(loop.run())
    assert Printer.steps == [2, 4]  # the logging steps, not every scored group (nor every step)


def test_the_rollout_loop_samples_completions_instead_of_printing_each_group(capsys):
    from rlasync.algorithms.grpo.loop import AsyncRolloutLoop
    from rlasync.config import AsyncGRPOConfig
    from tests.unit.rollout.test_loop import FakeEngine, FakePromptSource, FakeTokenizer, ListSink, parity_reward, rows

    args = AsyncGRPOConfig(num_generations=4, max_completion_length=6, log_completions=True, num_completions_to_print=3)
    loop = AsyncRolloutLoop(
        config=args,
        tokenizer=FakeTokenizer(),
        engine=FakeEngine(),
        prompt_source=FakePromptSource(rows(5)),
        sink=ListSink(),
        reward_funcs=[parity_reward],
        rng=random.Random(0),
    )
    asyncio.run(loop.run())
    assert capsys.readouterr().out == ""  # no table per group
    assert loop.completion_samples.seen == 20 and len(loop.completion_samples.drain()) == 3
    args.log_completions = False
    quiet = AsyncRolloutLoop(
        config=args,
        tokenizer=FakeTokenizer(),
        engine=FakeEngine(),
        prompt_source=FakePromptSource(rows(1)),
        sink=ListSink(),
        reward_funcs=[parity_reward],
    )
    assert quiet.completion_samples is None  # off by default
