"""The reward calling convention (docs/algorithms.md §2.6.1): arguments, concurrency, summing, names and errors."""

import asyncio
import functools
import math
import threading

import numpy as np
import pytest

from rlasync.rewards import RewardFunctionError, RewardTable, call_reward_funcs, reward_func_name, unique_names

WAIT_S = 5.0  # only reached when the functions do not run concurrently (the test then fails)

COMPLETIONS = [[{"role": "assistant", "content": f"c{i}"}] for i in range(3)]
PROMPTS = [[{"role": "user", "content": "hi"}]] * 3
COMPLETION_IDS = [[10], [20, 21], [30]]


def score(reward_funcs, reward_kwargs=None, extra_columns=None):
    return asyncio.run(
        call_reward_funcs(
            reward_funcs,
            prompts=PROMPTS,
            completions=COMPLETIONS,
            completion_ids=COMPLETION_IDS,
            reward_kwargs=reward_kwargs or {},
            extra_columns=extra_columns,
        )
    )


def ones(completions, **kwargs):
    return [1.0] * len(completions)


def test_every_argument_and_dataset_column_is_passed_by_keyword():
    seen = {}

    def record(**kwargs):
        seen.update(kwargs)
        return [0.0, 0.0, 0.0]

    score([record], reward_kwargs={"solution": ["1", "1", "1"], "difficulty": [3, 3, 3]})
    assert set(seen) == {"prompts", "completions", "completion_ids", "solution", "difficulty"}
    assert seen["prompts"] == PROMPTS and seen["completions"] == COMPLETIONS
    assert seen["completion_ids"] == COMPLETION_IDS and seen["solution"] == ["1", "1", "1"]


def test_sync_and_async_functions_run_concurrently():
    # Each function waits for something only another one does; run one after the other, they would time out.
    sync_started = threading.Event()
    async_done = threading.Event()
    barrier = threading.Barrier(2, timeout=WAIT_S)

    def sync_a(**kwargs):
        sync_started.set()
        assert async_done.wait(WAIT_S), "the coroutine function did not run while the sync one was running"
        barrier.wait()
        return [1.0, 1.0, 1.0]

    def sync_b(**kwargs):
        barrier.wait()  # needs sync_a in another thread at the same time
        return [2.0, 2.0, 2.0]

    async def async_c(**kwargs):
        assert await asyncio.to_thread(sync_started.wait, WAIT_S), "the sync function was not started"
        async_done.set()
        return [4.0, 4.0, 4.0]

    table = score([sync_a, sync_b, async_c])
    assert table.names == ("sync_a", "sync_b", "async_c")
    np.testing.assert_array_equal(table.totals(), [7.0, 7.0, 7.0])


def test_async_functions_are_awaited_concurrently():
    async def run():
        barrier = asyncio.Barrier(2)

        async def first(**kwargs):
            await asyncio.wait_for(barrier.wait(), WAIT_S)
            return [1, 1, 1]

        async def second(**kwargs):
            await asyncio.wait_for(barrier.wait(), WAIT_S)
            return [2, 2, 2]

        return await call_reward_funcs(
            [first, second], prompts=PROMPTS, completions=COMPLETIONS, completion_ids=COMPLETION_IDS, reward_kwargs={}
        )

    np.testing.assert_array_equal(asyncio.run(run()).totals(), [3.0, 3.0, 3.0])


def test_rewards_sum_over_functions_ignoring_none_and_all_none_is_nan():
    def first(**kwargs):
        return [1.0, None, None]

    def second(**kwargs):
        return [2, 5, None]

    table = score([first, second])
    np.testing.assert_array_equal(table.column("first"), [1.0, math.nan, math.nan])
    totals = table.totals()
    assert totals[:2].tolist() == [3.0, 5.0] and math.isnan(totals[2])
    assert table.values.dtype == np.float64 and table.values.shape == (2, 3)


def test_nan_counts_as_unscored_and_numpy_numbers_are_accepted():
    def numpy_rewards(**kwargs):
        return np.array([0.5, np.nan, 2.0], dtype=np.float32)

    def numpy_ints(**kwargs):
        return [np.int64(1), np.int32(2), None]

    totals = score([numpy_rewards, numpy_ints]).totals()
    assert totals.tolist() == [1.5, 2.0, 2.0]


def test_extra_columns_are_named_and_summed():
    table = score([ones], extra_columns={"MathEnv": [0.5, None, None], "rollout_reward": [None, None, None]})
    assert table.names == ("ones", "MathEnv", "rollout_reward")
    assert table.totals().tolist() == [1.5, 1.0, 1.0]


def test_no_columns_leaves_every_rollout_unscorable():
    table = score([])
    assert table.names == () and table.values.shape == (0, 3)
    assert np.isnan(table.totals()).all()


def test_column_names():
    class Scorer:
        def __call__(self, **kwargs):
            return [0.0, 0.0, 0.0]

    class Named(Scorer):
        __name__ = "named_scorer"

    def base(scale, **kwargs):
        return [scale] * 3

    assert reward_func_name(ones) == "ones"
    assert reward_func_name(functools.partial(functools.partial(base, scale=2.0))) == "base"
    assert reward_func_name(Scorer()) == "Scorer"
    assert reward_func_name(Named()) == "named_scorer"
    assert unique_names(["a", "b", "a", "a", "a_2"]) == ["a", "b", "a_2", "a_3", "a_2_2"]
    table = score([ones, ones, functools.partial(base, scale=2.0)], extra_columns=[("ones", [0, 0, 0])])
    assert table.names == ("ones", "ones_2", "base", "ones_3")


def test_async_callable_object_is_awaited():
    class AsyncScorer:
        async def __call__(self, **kwargs):
            await asyncio.sleep(0)
            return [3.0, 3.0, 3.0]

    assert score([AsyncScorer()]).totals().tolist() == [3.0, 3.0, 3.0]


def test_raising_function_is_named_and_chained():
    def broken(**kwargs):
        raise KeyError("solution")

    where = r"\(tests\.unit\.rewards\.test_calling\.test_raising_function_is_named_and_chained\.<locals>\.broken\)"
    with pytest.raises(RewardFunctionError, match=rf"reward function 'broken' {where} raised KeyError") as info:
        score([ones, broken])
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([1.0, 1.0], r"'bad' returned 2 rewards for 3 completions"),
        (1.0, r"'bad' returned float; expected a list of 3 rewards"),
        (None, r"'bad' returned NoneType"),
        ("1.0", r"'bad' returned str"),
        ([1.0, "1", 0.0], r"'bad' returned '1' \(str\) for completion 1; rewards must be int, float or None"),
        ([1.0, 0.0, True], r"'bad' returned the bool True for completion 2"),
        ([1.0, np.bool_(False), 0.0], r"'bad' returned the bool"),
        ([1.0, math.inf, 0.0], r"'bad' returned inf for completion 1; rewards must be finite"),
    ],
)
def test_bad_return_values_are_named(returned, message):
    def bad(**kwargs):
        return returned

    with pytest.raises(RewardFunctionError, match=message.replace("'bad'", r"'bad' \([\w.<>]+\.bad\)")):
        score([bad])


def test_bad_extra_column_is_named():
    with pytest.raises(RewardFunctionError, match=r"reward column 'Env' returned 1 rewards for 3 completions"):
        score([ones], extra_columns={"Env": [1.0]})


def test_dataset_column_clashing_with_an_argument_is_refused():
    with pytest.raises(ValueError, match=r"\['completions'\] clash"):
        score([ones], reward_kwargs={"completions": [0, 0, 0]})


def test_reward_table_column_lookup():
    table = RewardTable(names=("a", "b"), values=np.array([[1.0, math.nan], [math.nan, math.nan]]))
    assert table.num_rollouts == 2
    assert table.column("a")[0] == 1.0
    assert table.totals()[0] == 1.0 and math.isnan(table.totals()[1])


class Judge:
    def __call__(self, completions, **kwargs):
        raise ValueError("no verdict")


def test_the_error_names_where_the_function_is_defined_also_for_a_callable_object_or_a_partial():
    from rlasync.rewards.calling import hook_name

    def base(scale, **kwargs):
        raise ValueError("broken")

    assert hook_name(Judge()) == "tests.unit.rewards.test_calling.Judge.__call__"
    assert hook_name(functools.partial(ones, scale=1)) == "tests.unit.rewards.test_calling.ones"
    assert hook_name(Judge.__call__) == "tests.unit.rewards.test_calling.Judge.__call__"
    with pytest.raises(RewardFunctionError, match=r"'Judge' \(tests\.unit\.rewards\.test_calling\.Judge\.__call__\)"):
        score([Judge()])


def test_a_function_that_modifies_its_inputs_changes_neither_the_group_nor_the_other_functions(caplog):
    completions = [[dict(m) for m in c] for c in COMPLETIONS]
    kwargs = {"solution": ["1", "2", "3"]}
    seen = []

    def clears(completions, solution, **kwargs):
        scores = [1.0, 0.0, 2.0]
        completions.clear()
        solution.reverse()
        return scores

    def edits(completions, **kwargs):
        completions[0][-1]["content"] = "edited"
        return [0.0] * 3

    def reads(completions, solution, **kwargs):
        seen.append(([c[-1]["content"] for c in completions], list(solution)))
        return [0.0] * 3

    with caplog.at_level("WARNING"):
        table = asyncio.run(
            call_reward_funcs(
                [clears, edits, reads],
                prompts=PROMPTS,
                completions=completions,
                completion_ids=COMPLETION_IDS,
                reward_kwargs=kwargs,
            )
        )
    assert table.totals().tolist() == [1.0, 0.0, 2.0]
    assert completions == COMPLETIONS and kwargs == {"solution": ["1", "2", "3"]}  # the group is unchanged
    assert seen == [(["c0", "c1", "c2"], ["1", "2", "3"])]
    assert (
        "reward function 'clears' (" in caplog.text
        and "modified its argument 'completions' (3 entries -> 0)" in caplog.text
    )
    assert (
        "reward function 'edits' (" in caplog.text
        and "modified its argument 'completions' (its contents)" in caplog.text
    )


def test_a_wrong_length_after_modifying_an_input_names_the_function_and_the_argument():
    def pops(completions, **kwargs):
        completions.pop()
        return [1.0] * len(completions)

    with pytest.raises(RewardFunctionError) as info:
        score([pops])
    message = str(info.value)
    assert message.startswith("reward function 'pops' (tests.unit.rewards.test_calling.")
    assert "returned 2 rewards for 3 completions" in message
    assert message.endswith("it modified its argument 'completions' (3 entries -> 2)")
