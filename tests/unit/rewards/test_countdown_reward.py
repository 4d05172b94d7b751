import pytest

from rlasync.data import countdown_rows
from rlasync.rewards import countdown_reward


def test_every_generated_solution_scores_one():
    """The generator's own expression for each row (the reference) reaches its target with its numbers."""
    rows = countdown_rows(300, seed=5)
    completions = [f"<think>easy</think> <answer> {row['solution']} </answer>" for row in rows]
    scores = countdown_reward(completions, [r["numbers"] for r in rows], [r["target"] for r in rows])
    assert scores == [1.0] * len(rows)


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("6 / 3 * 4", 1.0),  # exact division
        ("(6 / 3) * 4", 1.0),
        ("4 * 6 / 3", 1.0),
        ("6 / 4 * 3", 0.0),  # 4.5
        ("6 * 4 / 3 + 0", 0.0),  # a number that is not in the row
        ("6 * 4 / 3 / 1", 0.0),
        ("6 + 3 - 4 + 3", 0.0),  # 3 used twice
        ("6 * 4", 0.0),  # 3 unused
        ("-6 + 4 * 3 + 2", 0.0),  # unary minus and a foreign number
        ("6.0 / 3 * 4", 0.0),  # not an integer literal
        ("__import__('os').getcwd()", 0.0),
        ("6 ** 3 / 4", 0.0),
        ("", 0.0),
    ],
)
def test_answers_are_checked_exactly(answer, score):
    assert countdown_reward([f"<answer>{answer}</answer>"], [[6, 4, 3]], [8]) == [score]


def test_the_last_answer_tag_counts_and_conversational_completions_are_read():
    messages = [{"role": "assistant", "content": "<answer> 1 + 1 </answer> no wait <answer>6 / 3 * 4</answer>"}]
    assert countdown_reward([messages], [[6, 4, 3]], [8]) == [1.0]
    assert countdown_reward(["6 / 3 * 4"], [[6, 4, 3]], [8]) == [0.0]  # no tag
    assert countdown_reward(["<answer>5 / (3 - 3)</answer>"], [[5, 3, 3]], [1]) == [0.0]  # division by zero
