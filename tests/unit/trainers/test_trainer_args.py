"""AsyncGRPOTrainer construction errors (no Ray started): bad datasets and reward sources name the problem."""

import pytest

from rlasync.config import AsyncGRPOConfig
from rlasync.rewards import last_number_reward
from rlasync.trainers import AsyncGRPOTrainer


def rows(**columns):
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_dict(columns)


def make(dataset, reward_funcs=last_number_reward, tmp_path=None):
    args = AsyncGRPOConfig(output_dir=str(tmp_path) if tmp_path else "unused", max_steps=1)
    return AsyncGRPOTrainer(model="some/model", reward_funcs=reward_funcs, args=args, train_dataset=dataset)


def test_dataset_without_prompt_column_is_named():
    with pytest.raises(ValueError, match="prompt") as info:
        make(rows(question=["What is 1 + 1?"], answer=["2"]))
    assert "question" in str(info.value)  # the columns it does have


def test_plain_text_prompts_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="conversational"):
        make(rows(prompt=["What is 1 + 1?"], answer=["2"]))


def test_missing_dataset_and_reward_source():
    good = rows(prompt=[[{"role": "user", "content": "What is 1 + 1?"}]], answer=["2"])
    with pytest.raises(ValueError, match="train_dataset"):
        make(None)
    with pytest.raises(ValueError, match="reward"):
        make(good, reward_funcs=None)
    with pytest.raises(ValueError, match="not callable"):
        make(good, reward_funcs=["rlasync.rewards:last_number_reward"])


def test_rlasync_exports_the_trainer_lazily():
    import rlasync

    assert rlasync.AsyncGRPOTrainer is AsyncGRPOTrainer and rlasync.AsyncGRPOConfig is AsyncGRPOConfig
