"""The watchdog on a real run (Ray local cluster, CPU, tiny random Llama): a constant reward drops every group
for zero spread, so no step ever trains; `train()` raises the zero-spread reason within the bound instead of
spinning forever (docs/algorithms.md §2.1)."""

import time

import pytest

from tests.integration.tiny_runs import tiny_grpo_config

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("pickle_by_value")]


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def test_a_constant_reward_stops_the_run_with_the_zero_spread_reason(ray_cluster, tiny_model_dir, tmp_path):
    from rlasync import AsyncGRPOTrainer
    from rlasync.data import arithmetic_dataset

    bound_s = 15.0
    config = tiny_grpo_config(
        tmp_path,
        max_steps=3,
        learning_rate=1e-6,  # AsyncGRPOConfig's default, not the tiny runs' 1e-2
        save_steps=500,  # AsyncGRPOConfig's default, not the tiny runs' 100
        num_sampler_logprobs=4,
        watchdog_timeout_s=bound_s,
    )
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=constant_reward, args=config, train_dataset=arithmetic_dataset(64, seed=0)
    )
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        trainer.train()
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert "no training step completed in" in message and f"watchdog_timeout_s={bound_s:g}" in message
    assert "groups in a row had zero reward spread" in message, message
    assert "every reward 1 (constant_reward)" in message
    assert elapsed < 120.0  # start-up + the 15-s bound + one poll, not the 300-s floor
