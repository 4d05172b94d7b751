"""A reward model in a real run (docs/rewards.md §2; Ray local cluster, tiny random Llama policy, tiny random Llama
reward model with its own tokenizer): `reward_funcs=[folder, direct_rm]` trains 2 steps, the trainer starts a
RewardActor for it, and every logged window's `rewards/<rm>/mean` equals that of `direct_rm`, a plain function that
scores the same completions by calling the saved model directly (`model(**tokenizer(text))`, one text at a time, on
the text the reward model's chat template renders); the batch metrics show groups from both rollout actors merged
into one batch. The two functions are weighted (`reward_weights`, TRL's field): every window's `reward` is the
weighted sum of the two columns' means (both score every completion), the columns themselves unweighted."""

import json

import pytest

from tests.integration.tiny_runs import tiny_grpo_config
from tests.unit.rewards.test_reward_model import save_tiny_reward_model

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("pickle_by_value")]

_LOADED = {}


def direct_rm(prompts, completions, rm_dir, **kwargs):
    """The reference reward: the saved reward model called directly, unbatched, on each rendered text."""
    import torch
    from transformers.models.auto.modeling_auto import AutoModelForSequenceClassification
    from transformers.models.auto.tokenization_auto import AutoTokenizer

    folder = rm_dir[0]
    if folder not in _LOADED:
        model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
        _LOADED[folder] = (model, AutoTokenizer.from_pretrained(folder))
    model, tokenizer = _LOADED[folder]
    rewards = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions, strict=True):
            text = tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False)
            inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
            rewards.append(model(**inputs).logits[0, 0].item())
    return rewards


def test_a_reward_model_folder_trains_and_scores_as_a_direct_call(ray_cluster, tiny_model_dir, tmp_path):
    from rlasync import AsyncGRPOTrainer
    from rlasync.data import arithmetic_dataset

    rm_dir = save_tiny_reward_model(tmp_path / "tiny_rm")
    config = tiny_grpo_config(
        tmp_path / "run",
        max_steps=2,
        reward_timeout_s=120.0,
        reward_weights=[0.5, 2.0],
        cluster={"num_rollout_actors": 2},
    )
    rows = arithmetic_dataset(64, seed=0).add_column("rm_dir", [rm_dir] * 64)
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=[rm_dir, direct_rm], args=config, train_dataset=rows)
    assert config.cluster.num_reward_actors == 1  # started for the reward model
    assert trainer.train()["global_step"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scored = [record for record in records if "rewards/tiny_rm/mean" in record]
    assert scored, records
    for record in scored:  # both columns score every completion of the same groups: equal window means
        assert record["rewards/tiny_rm/mean"] == pytest.approx(record["rewards/direct_rm/mean"], abs=1e-4), record
        weighted = 0.5 * record["rewards/tiny_rm/mean"] + 2.0 * record["rewards/direct_rm/mean"]
        assert record["reward"] == pytest.approx(weighted, abs=1e-4), record  # the RewardActor's table, weighted
    batches = [record for record in records if "rewards/tiny_rm/batch_size" in record]
    assert batches and all(record["rewards/tiny_rm/batch_size"] >= 4 for record in batches)  # a group is 4 texts
    assert max(record["rewards/tiny_rm/batch_sources_max"] for record in batches) >= 2, batches
    assert max(record["rewards/tiny_rm/batch_requests"] for record in batches) > 1
    assert all(record["rewards/tiny_rm/scored_per_s"] > 0 for record in batches)
