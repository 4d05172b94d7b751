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


def test_resources_the_actors_cannot_get_are_an_error_on_a_local_cluster_and_a_warning_elsewhere(caplog):
    from rlasync.trainers.grpo import check_resources

    requests = {"generation": (1, 0.5, 1.0), "learner": (2, 0.5, 1.0), "rollout": (1, 0.25, 0.0), "queue": (1, 0.1, 0.0)}
    check_resources(requests, {"CPU": 2.0, "GPU": 3.0}, autoscaling=False)  # 1.85 CPUs, 3 GPUs: fits
    with pytest.raises(ValueError, match=r"3 GPUs but the Ray cluster has 1 .*cluster\.learner_num_gpus"):
        check_resources(requests, {"CPU": 2.0, "GPU": 1.0}, autoscaling=False)
    with caplog.at_level("WARNING"):
        check_resources(requests, {"CPU": 1.0}, autoscaling=True)
    assert "1.85 CPUs but the Ray cluster has 1" in caplog.text and "unless the cluster scales up" in caplog.text
