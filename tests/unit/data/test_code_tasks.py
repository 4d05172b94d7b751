"""The procedural code task (rlasync.data.code_tasks): seeded rows, hidden tests that the reference passes and
trivial programs do not, the run-file registration, and the reference scoring 1.0 through the sandbox."""

import shutil

import pytest

from rlasync.data import build_dataset, code_rows
from rlasync.data.code_tasks import FAMILY_NAMES
from rlasync.rewards.code import CodeReward, Limits, Sandbox


def _passes(program: str, tests: list[str]) -> int:
    """Trusted code only (the generator's own references): run in this process."""
    namespace: dict = {}
    exec(program, namespace)
    passed = 0
    for test in tests:
        try:
            exec(test, namespace)
        except AssertionError:
            continue
        passed += 1
    return passed


def test_rows_are_seeded_and_cover_every_family():
    rows = code_rows(300, seed=3)
    assert rows == code_rows(300, seed=3)
    assert rows != code_rows(300, seed=4)
    assert {row["family"] for row in rows} == set(FAMILY_NAMES)
    row = rows[0]
    assert set(row) == {"prompt", "tests", "family", "solution"}
    assert row["prompt"][-1]["role"] == "user" and "`f(xs)`" in row["prompt"][-1]["content"]
    assert len(row["tests"]) == 5 and all(test.startswith("assert f(") for test in row["tests"])


def test_the_reference_passes_every_hidden_test_and_trivial_programs_do_not():
    rows = code_rows(400, seed=11, num_tests=6)
    assert all(_passes(row["solution"], row["tests"]) == 6 for row in rows)
    for trivial in ("def f(xs):\n    return 0\n", "def f(xs):\n    return xs\n", "def f(xs):\n    return []\n"):
        fully_passed = sum(_passes(trivial, row["tests"]) == 6 for row in rows)
        assert fully_passed <= 0.05 * len(rows), trivial


def test_the_visible_example_is_not_a_hidden_test():
    for row in code_rows(50, seed=2):
        example = row["prompt"][-1]["content"].split("For example, `f(")[1].split(")`")[0]
        assert all(f"f({example})" not in test for test in row["tests"])


def test_options_are_checked_and_families_can_be_chosen():
    rows = code_rows(20, seed=0, families=["spread", "argmax"], num_tests=3, max_length=4, value_range=2)
    assert {row["family"] for row in rows} <= {"spread", "argmax"}
    assert all(len(row["tests"]) == 3 for row in rows)
    with pytest.raises(ValueError, match="families="):
        code_rows(2, seed=0, families=["sorting"])
    with pytest.raises(ValueError, match="num_tests="):
        code_rows(2, seed=0, num_tests=0)


def test_a_run_file_builds_it_by_name():
    dataset = build_dataset({"name": "code", "size": 6, "seed": 1, "families": ["dedupe"]})
    assert len(dataset) == 6 and set(dataset["family"]) == {"dedupe"}
    assert isinstance(dataset[0]["tests"], list)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_the_reference_scores_one_in_the_sandbox():
    rows = code_rows(2 * len(FAMILY_NAMES), seed=7)
    completions = [f"Sure:\n```python\n{row['solution']}```" for row in rows]
    reward = CodeReward(Sandbox(limits=Limits(cpu_s=2, wall_s=10)))
    assert reward(completions, tests=[row["tests"] for row in rows]) == [1.0] * len(rows)
