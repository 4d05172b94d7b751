"""Evaluation during training end to end (CPU, tiny random Llama, the session's Ray cluster): with an eval_dataset
and eval_steps=2, a 4-step run logs eval/reward at steps 2 and 4 (scored in the RewardActor pool), fires
on_evaluate with transformers' names, its steps are not slower by more than an evaluation's own generation time,
and trainer.evaluate() works after train(). The same run prints one log_completions table per logging step."""

import json

import pytest

from tests.integration.tiny_runs import digit_reward, tiny_grpo_config

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("pickle_by_value")]


class Evaluated:
    def __init__(self):
        self.calls = []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.calls.append((state.global_step, dict(metrics)))


def test_evaluation_during_training_and_after(ray_cluster, tiny_model_dir, tmp_path, capsys):
    from rlasync import AsyncGRPOTrainer
    from rlasync.data import arithmetic_dataset

    config = tiny_grpo_config(
        tmp_path,
        max_steps=4,
        num_generations_eval=2,
        eval_strategy="steps",
        eval_steps=2,
        learning_rate=1e-6,  # AsyncGRPOConfig's default, not the tiny runs' 1e-2
        max_staleness=4,  # AsyncGRPOConfig's default, not the tiny runs' 2
        log_completions=True,  # and one completions table per logging step, from the rollout actors' samples
        num_completions_to_print=2,
        cluster={"num_reward_actors": 1},
    )
    seen = Evaluated()
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=digit_reward,
        args=config,
        train_dataset=arithmetic_dataset(64, seed=0),
        eval_dataset=arithmetic_dataset(6, seed=1),
        callbacks=[seen],
    )
    trainer.train()
    out = capsys.readouterr().out
    # one table per logging step that scored completions (the rollout actors may already have generated the last
    # step's samples in an earlier window: a window that scored none prints nothing), never one per group
    tables = [step for step in (1, 2, 3, 4) if f"step {step}" in out]
    assert tables[:1] == [1] and len(tables) >= 2 and out.count("advantage") == len(tables), out[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/reward" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for record in evals:
        assert record["eval/num_prompts"] == 6 and record["eval/num_completions"] == 12  # num_generations_eval=2
        assert 0.0 <= record["eval/rewards/digit_reward/mean"] <= 1.0
        assert record["eval/completions/mean_length"] > 0 and record["eval/generation_s"] > 0
        assert record["eval/policy_version"] >= 1
    assert [step for step, _ in seen.calls][0] >= 2 and len(seen.calls) == 2
    assert all("eval_reward" in metrics and "eval_rewards/digit_reward/mean" in metrics for _, metrics in seen.calls)

    # the steps after an evaluation started are not slower by more than that evaluation's own generation time
    step_s = {r["step"]: r["perf/step_s"] for r in records if "perf/step_s" in r}
    generation_s = evals[0]["eval/generation_s"]
    baseline = step_s[2]  # step 2's time holds no evaluation (it starts after step 2)
    assert max(step_s[3], step_s[4]) <= baseline + generation_s + 2.0, (step_s, generation_s)

    # after train(): evaluate() runs in this process on the final checkpoint, transformers' names and prefix
    metrics = trainer.evaluate()
    assert metrics["eval_num_prompts"] == 6 and "eval_reward" in metrics and metrics["eval_policy_version"] == 5
    other = trainer.evaluate(eval_dataset=arithmetic_dataset(2, seed=2), metric_key_prefix="test")
    assert other["test_num_prompts"] == 2 and "test_rewards/digit_reward/mean" in other
    assert trainer.state.log_history[-1]["test_num_prompts"] == 2 and len(seen.calls) == 4
