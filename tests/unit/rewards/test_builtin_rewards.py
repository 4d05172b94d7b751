"""Built-in rewards: accuracy_reward (math-verify), think_format_reward, last_number_reward."""

import asyncio

import pytest

from rlasync.rewards import (
    accuracy_reward,
    call_reward_funcs,
    completion_text,
    last_number_reward,
    think_format_reward,
)


def messages(text):
    return [{"role": "assistant", "content": text}]


def test_accuracy_reward_latex_answers():
    completions = [
        messages(r"My answer is \boxed{\frac{1}{3}}"),
        messages(r"My answer is \boxed{\frac{1}{2}}"),
        messages(r"The final answer is $\frac{2}{6}$"),
    ]
    assert accuracy_reward(completions, [r"\frac{1}{3}"] * 3) == [1.0, 0.0, 1.0]


def test_accuracy_reward_plain_answers():
    completions = [r"\boxed{42}", "The final answer is $42$", "The answer is 42", messages(r"\boxed{41}")]
    # Plain-text gold parses; the completion must give its answer in LaTeX (TRL's rule), so a bare 42 scores 0.
    assert accuracy_reward(completions, ["42", 42, "42", "42"]) == [1.0, 1.0, 0.0, 0.0]


def test_accuracy_reward_unparsable_gold_is_unscored():
    assert accuracy_reward([r"\boxed{1}", r"\boxed{1}"], ["not a number", "1"]) == [None, 1.0]


def test_accuracy_reward_runs_in_the_calling_convention_thread():
    # Sync rewards run in a worker thread, where math-verify's signal-based timeouts must be off.
    table = asyncio.run(
        call_reward_funcs(
            [accuracy_reward],
            prompts=["q", "q"],
            completions=[messages(r"\boxed{2}"), messages(r"\boxed{3}")],
            completion_ids=[[1], [2]],
            reward_kwargs={"solution": ["2", "2"]},
        )
    )
    assert table.totals().tolist() == [1.0, 0.0]


def test_think_format_reward():
    completions = [
        messages("<think>\nThis is my reasoning.\n</think>\nThis is my answer."),
        messages("<think>\nThis is my reasoning.\nThis is my answer."),
        "<think>a</think>b",
        "x <think>a</think>b",  # must open with the block
        "<think>a<think>b</think>c",  # no nested think
        "<think></think>",
    ]
    assert think_format_reward(completions) == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("reply", "gold", "expected"),
    [
        ("7 + 5 = 12", 12, 1.0),
        ("The answer is 12.", "12", 1.0),
        ("12.0", 12, 1.0),
        ("12.5", 12, 0.0),
        ("I think 12, no wait, 13", 12, 0.0),
        ("-3", "-3", 1.0),
        ("8-3", 3, 1.0),  # subtraction, not -3
        ("no number here", 4, 0.0),
        ("4", "four", None),
        ("4", True, None),
    ],
)
def test_last_number_reward(reply, gold, expected):
    assert last_number_reward([messages(reply)], answer=[gold]) == [expected]


def test_last_number_reward_reads_solution_without_answer_and_needs_one():
    assert last_number_reward(["5"], solution=["5"]) == [1.0]
    assert last_number_reward(["5"], answer=["6"], solution=["5"]) == [0.0]
    with pytest.raises(ValueError, match="`answer`"):
        last_number_reward(["5"])


def test_completion_text_reads_the_last_assistant_message():
    conversation = [
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add"}}]},
        {"role": "tool", "name": "add", "content": "12"},
        {"role": "assistant", "content": [{"type": "text", "text": "It is "}, {"type": "text", "text": "12"}]},
    ]
    assert completion_text(conversation) == "It is 12"
    assert completion_text(conversation[:2]) == ""
    assert completion_text("plain") == "plain"
