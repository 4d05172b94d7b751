"""The custom reward-function examples of TRL's AsyncGRPOTrainer document ("Using a custom reward function",
examples 1-5, and "Passing the reward function to the trainer"), copied as written; only `trl` became `rlasync`.

The doctests run as written. The trainer runs use the tiny random model: its completions never match the
`<think>` format nor a `\\boxed{}` answer, so every group of those rewards alone has zero spread (dropped, no
step); `digit_share` (not in the document) gives the groups a spread so a step trains and the window is logged.
"""

import asyncio
import re

import pytest

pytestmark = pytest.mark.integration


# --- document, "Example 1: reward longer completions" ------------------------------------------------------------
def reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


# --- document, "Example 2: reward completions with a specific format" --------------------------------------------
def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


# --- document, "Example 3: reward based on a reference" (named `reward_func` there; renamed: Example 1 took it) ---
def reference_reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion[0]["content"]) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


# --- document, "Example 5: asynchronous reward functions" --------------------------------------------------------
async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


def digit_share(completions, **kwargs):
    """Not in the document: the share of digit words, which varies within a group of random completions."""
    out = []
    for completion in completions:
        words = completion[-1]["content"].split()
        out.append(sum(w.isdigit() for w in words) / max(len(words), 1))
    return out


def test_example_1_doctest():
    prompts = [[{"role": "user", "content": "The sky is"}], [{"role": "user", "content": "The sun is"}]]
    completions = [[{"role": "assistant", "content": " blue."}], [{"role": "assistant", "content": " in the sky."}]]
    completion_ids = [[6303, 13], [304, 279, 12884, 13]]
    assert reward_func(prompts=prompts, completions=completions, completion_ids=completion_ids) == [2.0, 4.0]


def test_example_2_doctest():
    prompts = [
        [{"role": "user", "content": "What is the result of (1 + 2) * 4?"}],
        [{"role": "user", "content": "What is the result of (3 + 1) * 2?"}],
    ]
    completions = [
        [
            {
                "role": "assistant",
                "content": "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think><answer>(1 + 2) * 4 = 12</answer>",
            }
        ],  # noqa: E501
        [
            {
                "role": "assistant",
                "content": "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8.",
            }
        ],  # noqa: E501
    ]
    assert format_reward_func(prompts=prompts, completions=completions) == [1.0, 0.0]


def test_example_3_doctest():
    prompts = [
        [{"role": "user", "content": "Solve the equation $2x + 3 = 7$."}],
        [{"role": "user", "content": "Solve the equation $3x - 5 = 10$."}],
    ]
    completions = [
        [{"role": "assistant", "content": r"The solution is \boxed{2}."}],
        [{"role": "assistant", "content": r"The solution is \boxed{6}."}],
    ]
    ground_truth = ["2", "5"]
    assert reference_reward_func(prompts=prompts, completions=completions, ground_truth=ground_truth) == [1.0, 0.0]


def test_example_5_is_a_coroutine_function():
    completions = [[{"role": "assistant", "content": "x"}], []]
    assert asyncio.run(async_reward_func(prompts=[None, None], completions=completions)) == [1.0, 0.0]


def test_sync_async_and_column_rewards_in_one_run(pickle_by_value, tiny_model_dir, tmp_path, docs):
    """ "Passing the reward function to the trainer": a list mixing sync and async functions, summed; the
    `ground_truth` column reaches Example 3's function as a keyword argument. Also the document's
    `max_concurrent_rollouts=64` ("Concurrency") and `top_p=0.95, top_k=512` ("Top-k and top-p sampling")."""
    from rlasync import AsyncGRPOConfig, AsyncGRPOTrainer
    from rlasync.data import arithmetic_rows

    rows = arithmetic_rows(16, seed=0)
    dataset = [{"prompt": row["prompt"], "ground_truth": str(row["answer"])} for row in rows]
    training_args = AsyncGRPOConfig(
        **docs.fields(tmp_path, top_k=512),
        max_concurrent_rollouts=64,
        top_p=0.95,
    )
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[reward_func, format_reward_func, reference_reward_func, async_reward_func, digit_share],
        args=training_args,
        train_dataset=dataset,
    )
    trainer.train()
    records = docs.metrics(tmp_path)
    keys = set().union(*records)
    for name in ("reward_func", "format_reward_func", "reference_reward_func", "async_reward_func", "digit_share"):
        assert f"rewards/{name}/mean" in keys, sorted(keys)
    first = records[0]
    assert first["rewards/reward_func/mean"] > 0  # completion lengths
    assert first["rewards/format_reward_func/mean"] == 0.0 and first["rewards/async_reward_func/mean"] == 1.0
    assert "reward" in keys and "frac_zero_std_groups" in keys
