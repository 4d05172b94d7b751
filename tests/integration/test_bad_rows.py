"""Every dataset row is checked as it is leased (actors/loop_host.py QueuePromptSource): a bad row past the ones
checked up front is dropped, counted as "filtered" and the epoch still consumes every row exactly once; with
`strict_dataset=True` the run stops with an error naming the row."""

import pytest

from tests.integration.tiny_runs import digit_reward, tiny_grpo_config

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("pickle_by_value")]

BAD_ROW = 5


def trainer_with_a_bad_row(tiny_model_dir, tmp_path, monkeypatch, **changes):
    from rlasync import AsyncGRPOTrainer
    from rlasync.data import arithmetic_dataset

    # as if the bad row lay past the NUM_ROWS_CHECKED rows validated up front
    monkeypatch.setattr("rlasync.trainers.grpo.validate_prompt_dataset", lambda dataset: None)
    rows = arithmetic_dataset(8, seed=0).to_list()
    rows[BAD_ROW] = {**rows[BAD_ROW], "prompt": "What is 1 + 1?"}  # a plain string: not conversational
    config = tiny_grpo_config(
        tmp_path,
        max_steps=-1,
        num_train_epochs=1.0,
        num_generations=2,
        max_completion_length=6,
        max_staleness=4,  # AsyncGRPOConfig's default, not the tiny runs' 2
        num_sampler_logprobs=4,
        rollout_worker_timeout=60.0,
        **changes,
    )
    return AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=digit_reward, args=config, train_dataset=rows)


def test_a_bad_row_is_dropped_and_counted_as_filtered(ray_cluster, tiny_model_dir, tmp_path, monkeypatch):
    state = trainer_with_a_bad_row(tiny_model_dir, tmp_path, monkeypatch).train()
    queue = state["queue"]
    outcomes = {k: v for k, v in queue["outcomes"].items() if k != "stale"}
    assert queue["done"] and queue["consumed_groups"] == 8 and sum(outcomes.values()) == 8
    assert outcomes.get("filtered") == 1


def test_strict_dataset_stops_the_run_naming_the_row(ray_cluster, tiny_model_dir, tmp_path, monkeypatch):
    trainer = trainer_with_a_bad_row(tiny_model_dir, tmp_path, monkeypatch, strict_dataset=True)
    with pytest.raises(RuntimeError, match=f"row {BAD_ROW}: the prompt is a plain string.*strict_dataset"):
        trainer.train()
