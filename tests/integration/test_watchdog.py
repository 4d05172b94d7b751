"""The watchdog on a real run (Ray local cluster, CPU, tiny random Llama): a constant reward drops every group
for zero spread, so no step ever trains; `train()` raises the zero-spread reason within the bound instead of
spinning forever (docs/algorithms.md §2.1)."""

import sys
import time

import pytest

pytestmark = pytest.mark.integration


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


@pytest.fixture(scope="module", autouse=True)
def _pickle_rewards_by_value(ray_cluster):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_a_constant_reward_stops_the_run_with_the_zero_spread_reason(ray_cluster, tiny_model_dir, tmp_path):
    from rlasync import AsyncGRPOTrainer
    from rlasync.config import AsyncGRPOConfig
    from rlasync.data import arithmetic_dataset

    bound_s = 15.0
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        max_steps=3,
        num_generations=4,
        max_completion_length=8,
        token_budget=192,
        max_staleness=2,
        gradient_checkpointing=False,
        top_k=16,
        num_sampler_logprobs=4,
        seed=0,
        watchdog_timeout_s=bound_s,
        cluster={
            "engine_kwargs": {"max_num_seqs": 16, "kv_cache_tokens": 2048, "max_model_len": 128},
            "collective_timeout_s": 60.0,
        },
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
