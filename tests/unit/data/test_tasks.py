"""Procedural tasks: deterministic for a seed, correct answers, rows and Dataset agree, rewards accept them."""

import re

import pytest

from rlasync.data import arithmetic_dataset, arithmetic_rows, countdown_dataset, countdown_rows, validate_prompt_dataset
from rlasync.rewards import accuracy_reward, last_number_reward

QUESTION = re.compile(r"What is (\d+) ([-+*/]) (\d+)\? Answer with just the number\.")
OPS = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}


def test_arithmetic_rows_are_deterministic_for_a_seed():
    assert arithmetic_rows(20, seed=3) == arithmetic_rows(20, seed=3)
    assert arithmetic_rows(20, seed=3) != arithmetic_rows(20, seed=4)
    assert arithmetic_rows(5, seed=3) == arithmetic_rows(20, seed=3)[:5]


@pytest.mark.parametrize("ops", [("+",), ("+", "-", "*", "/")])
def test_arithmetic_answers_are_correct(ops):
    rows = arithmetic_rows(200, seed=0, max_operand=12, ops=ops)
    used = set()
    for row in rows:
        (message,) = row["prompt"]
        assert message["role"] == "user"
        a, op, b = QUESTION.fullmatch(message["content"]).groups()
        used.add(op)
        if op == "/":
            assert int(a) % int(b) == 0
        else:
            assert 0 <= int(a) <= 12 and 0 <= int(b) <= 12
        assert row["answer"] == row["solution"] == str(OPS[op](int(a), int(b)))
        assert int(row["answer"]) >= 0  # subtraction orders its operands by default
    assert used == set(ops)


def test_arithmetic_options_and_errors():
    rows = arithmetic_rows(50, seed=1, ops=("-",), allow_negative=True, system_prompt="Be brief.")
    assert rows[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert any(int(row["answer"]) < 0 for row in rows)
    with pytest.raises(ValueError, match="ops"):
        arithmetic_rows(1, seed=0, ops=("^",))
    with pytest.raises(ValueError, match="n="):
        arithmetic_rows(-1, seed=0)


def test_a_correct_completion_scores_one_with_the_built_in_rewards():
    rows = arithmetic_rows(8, seed=5, ops=("+", "*"))
    answers = [row["answer"] for row in rows]
    right = [[{"role": "assistant", "content": f"The answer is {a}."}] for a in answers]
    wrong = [[{"role": "assistant", "content": f"The answer is {int(a) + 1}."}] for a in answers]
    assert last_number_reward(right, answer=answers) == [1.0] * 8
    assert last_number_reward(wrong, answer=answers) == [0.0] * 8
    boxed = [[{"role": "assistant", "content": f"So it is $\\boxed{{{a}}}$"}] for a in answers]
    assert accuracy_reward(boxed, solution=[row["solution"] for row in rows]) == [1.0] * 8


def test_datasets_hold_the_same_rows_and_pass_validation():
    dataset = arithmetic_dataset(10, seed=2, ops=("+", "-"))
    assert dataset.column_names == ["prompt", "answer", "solution"]
    assert dataset.to_list() == arithmetic_rows(10, seed=2, ops=("+", "-"))
    validate_prompt_dataset(dataset)
    countdown = countdown_dataset(4, seed=2)
    assert countdown.column_names == ["prompt", "numbers", "target", "solution"]
    assert countdown.to_list() == countdown_rows(4, seed=2)
    validate_prompt_dataset(countdown)


def test_countdown_solutions_use_each_number_once_and_reach_the_target():
    rows = countdown_rows(100, seed=7)
    assert rows == countdown_rows(100, seed=7)
    for row in rows:
        assert 3 <= len(row["numbers"]) <= 4 and all(1 <= n <= 99 for n in row["numbers"])
        assert 1 <= row["target"] <= 100
        assert sorted(int(n) for n in re.findall(r"\d+", row["solution"])) == sorted(row["numbers"])
        assert eval(row["solution"]) == row["target"]  # integer-exact: every division in it divides evenly
        assert str(row["numbers"]) in row["prompt"][0]["content"]
        assert f"equals {row['target']}" in row["prompt"][0]["content"]
