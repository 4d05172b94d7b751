"""TRL's positional order for both trainers: a TRL 1.16 constructor call, positional or not, binds the same
parameters in rlasync. rlasync's additions (`loop_cls`, the distillation `teacher_model`) are keyword-only, and
TRL's `rollout_worker` / `weight_transfer` are accepted at TRL's default and refused otherwise."""

import inspect

import pytest
import torch

from rlasync.config import AsyncDistillationConfig, AsyncGRPOConfig
from rlasync.rewards import last_number_reward
from rlasync.trainers import AsyncDistillationTrainer, AsyncGRPOTrainer

# Read with `ast` from the trl-1.16.0 wheel (no TRL code is vendored): the `__init__` parameters after `self`, in
# order, of trl/experimental/async_grpo/async_grpo_trainer.py::AsyncGRPOTrainer and
# trl/experimental/async_distillation/async_distillation_trainer.py::AsyncDistillationTrainer. None is keyword-only.
TRL_1_16 = {
    AsyncGRPOTrainer: (
        "model",
        "reward_funcs",
        "args",
        "train_dataset",
        "processing_class",
        "callbacks",
        "optimizers",
        "peft_config",
        "tools",
        "environment_factory",
        "rollout_worker",
        "weight_transfer",
    ),
    AsyncDistillationTrainer: (
        "model",
        "args",
        "train_dataset",
        "processing_class",
        "callbacks",
        "optimizers",
        "peft_config",
        "rollout_worker",
        "weight_transfer",
    ),
}
TRL_MODULES = {
    AsyncGRPOTrainer: "trl.experimental.async_grpo",
    AsyncDistillationTrainer: "trl.experimental.async_distillation",
}


def positional(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


@pytest.mark.parametrize("cls", list(TRL_1_16), ids=lambda c: c.__name__)
def test_trl_parameters_come_first_in_trl_order(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert positional(cls) == TRL_1_16[cls]  # exactly TRL's, nothing of ours in between or after
    extra = [p for p in params if p.name not in TRL_1_16[cls]]
    assert extra and all(p.kind is p.KEYWORD_ONLY for p in extra), [(p.name, p.kind) for p in extra]
    # every TRL parameter except `model` has a default, as in TRL
    assert all(p.default is not p.empty for p in params if p.name != "model")
    # a full positional TRL call binds each value to the parameter of the same name
    bound = inspect.signature(cls.__init__).bind(None, *TRL_1_16[cls]).arguments
    assert all(bound[name] == name for name in TRL_1_16[cls])


@pytest.mark.parametrize("cls", list(TRL_1_16), ids=lambda c: c.__name__)
def test_matches_installed_trl(cls):
    """Against the installed TRL when present (the dev machine has no TRL: then the stored lists above rule)."""
    pytest.importorskip("trl")
    module = pytest.importorskip(TRL_MODULES[cls])
    theirs = list(inspect.signature(getattr(module, cls.__name__).__init__).parameters)[1:]
    assert positional(cls) == tuple(theirs)


def dataset():
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 1 + 1?"}]], "answer": ["2"]})


def test_grpo_positional_call_binds_optimizers_and_tokenizer(tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=1)
    tok = object()
    trainer = AsyncGRPOTrainer("some/model", last_number_reward, args, dataset(), tok, None, (torch.optim.SGD, None))
    assert trainer.optimizer_overrides == {"optimizer_cls": torch.optim.SGD}
    assert trainer.processing_class is tok and trainer.loop_cls is AsyncGRPOTrainer.loop_cls


def test_distillation_positional_call_reads_the_tokenizer_as_processing_class(tmp_path):
    args = AsyncDistillationConfig(
        output_dir=str(tmp_path), max_steps=1, teacher_server_urls={"t": "http://localhost:1"}
    )
    tok = object()
    trainer = AsyncDistillationTrainer("some/model", args, dataset(), tok)
    assert trainer.processing_class is tok and list(trainer.teachers) == ["t"]


@pytest.mark.parametrize("name", ["rollout_worker", "weight_transfer"])
def test_trl_worker_hooks_refused_unless_default(name):
    with pytest.raises(ValueError, match=f"{name}=object.*not supported.*{name}=None"):
        AsyncGRPOTrainer("some/model", last_number_reward, **{name: object()})
    with pytest.raises(ValueError, match=f"{name}=object.*not supported"):
        AsyncDistillationTrainer("some/model", **{name: object()})
