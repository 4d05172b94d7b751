"""Run files: what `rlasync train RUN.yaml` reads.

A run file is a config (every `AsyncGRPOConfig` field, the `cluster` section included) plus three keys:

    model: smollm2-135m-instruct          # id, path or alias (anything `load_model` accepts)
    dataset: {name: arithmetic, size: 2000, seed: 0, max_operand: 9}
    reward_funcs: [rlasync.rewards:last_number_reward]   # import strings "module:attribute", or reward model folders

`trainer:` names the algorithm (rlasync.algorithms.registry: its name or one of its `trainer_names`; GRPO is the
default): its spec gives the config class and the trainer. On-policy distillation: `trainer: distillation` makes
the rest an `AsyncDistillationConfig` (docs/algorithms.md §10.3) and the driver `AsyncDistillationTrainer`;
`reward_funcs` is then not used (an algorithm with teachers), and an optional `teacher_model` (a path / alias, or
`{teacher_id: path}`) hosts the teachers locally instead of reaching `teacher_server_urls`.

`load_run(path, overrides)` applies dotted `key=value` overrides to the whole file (so `--set dataset.size=64`
and `--set model=path/to/model` work too). Nothing here imports torch or ray; building the dataset imports
`datasets` on use.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlasync.algorithms import registry
from rlasync.algorithms.spec import Algorithm
from rlasync.config.base import TrainerConfig
from rlasync.config.load import apply_overrides, build_config, read_yaml
from rlasync.data.from_spec import DATASET_NAMES as DATASETS  # rlasync.data.build_dataset builds them

RUN_KEYS = ("model", "dataset", "reward_funcs", "trainer", "teacher_model")
DEFAULT_TRAINER = "grpo"


@dataclass
class RunFile:
    """A loaded run file: the model, the dataset spec, reward import strings and the config (of the `trainer`
    algorithm's config class; with teachers, the optional local `teacher_model`)."""

    model: str
    config: TrainerConfig
    dataset: dict[str, Any] = field(default_factory=dict)
    reward_funcs: list[str] = field(default_factory=list)
    trainer: str = DEFAULT_TRAINER
    teacher_model: str | dict[str, str] | None = None

    @property
    def algorithm(self) -> Algorithm:
        return registry.get(self.trainer)

    def build_reward_funcs(self) -> list[Any]:
        """The functions of the import strings; a reward model's folder stays a string (the trainer loads it as a
        `RewardModel`, docs/rewards.md §2)."""
        return [name if _is_folder(name) else import_object(name) for name in self.reward_funcs]

    def build_trainer(self, train_dataset: Any) -> Any:
        """The algorithm's trainer over `train_dataset` (reward functions and local teachers when the file sets
        them)."""
        extra: dict[str, Any] = {}
        if self.reward_funcs:
            extra["reward_funcs"] = self.build_reward_funcs()
        if self.teacher_model is not None:
            extra["teacher_model"] = self.teacher_model
        if not self.algorithm.trainer:
            raise ValueError(
                f"trainer: {self.trainer} names no trainer class (its Algorithm spec's `trainer` is empty)"
            )
        trainer_cls = import_object(self.algorithm.trainer)
        return trainer_cls(model=self.model, args=self.config, train_dataset=train_dataset, **extra)


def load_run(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    config_class: type[TrainerConfig] | None = None,
) -> RunFile:
    """Read a run file, apply overrides, validate the config and the run keys (errors name the key)."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, overrides)
    where = f"{path}: " if path is not None else ""
    model = data.pop("model", None)
    dataset = data.pop("dataset", None)
    rewards = data.pop("reward_funcs", None)
    trainer = data.pop("trainer", DEFAULT_TRAINER)
    teacher_model = data.pop("teacher_model", None)
    if not isinstance(trainer, str) or trainer not in registry.names():
        raise ValueError(
            f"{where}trainer={trainer!r}: use one of {registry.names()} ({DEFAULT_TRAINER} is the default)"
        )
    algorithm = registry.get(trainer)
    if teacher_model is not None and not algorithm.teachers:
        hint = " or ".join(f"`trainer: {(*s.trainer_names, s.name)[0]}`" for s in registry.specs() if s.teachers)
        raise ValueError(f"{where}`teacher_model:` is set but trainer {trainer} has no teachers: add {hint}")
    config = build_config(data, config_class or algorithm.config_cls)
    if not isinstance(model, str) or not model:
        raise ValueError(f"{where}`model:` is missing: give a hub id, a local path or an alias (smollm2-135m-instruct)")
    if dataset is None:
        raise ValueError(f"{where}`dataset:` is missing, e.g. {{name: arithmetic, size: 1000, seed: 0}}")
    if not isinstance(dataset, Mapping) or "name" not in dataset:
        raise ValueError(f"{where}`dataset:` must be a mapping with a `name` (one of {DATASETS}), got {dataset!r}")
    if dataset["name"] not in DATASETS:
        raise ValueError(f"{where}dataset.name={dataset['name']!r}: use one of {DATASETS}")
    if algorithm.teachers:
        if rewards:
            raise ValueError(f"{where}`reward_funcs:` is not used by trainer: {trainer} (the teacher is the signal)")
        if teacher_model is not None and not isinstance(teacher_model, str | Mapping):
            raise ValueError(f"{where}`teacher_model:` must be a path / alias or a {{teacher_id: path}} mapping")
        if isinstance(teacher_model, Mapping):
            teacher_model = dict(teacher_model)
        return RunFile(model=model, config=config, dataset=dict(dataset), trainer=trainer, teacher_model=teacher_model)
    if isinstance(rewards, str):
        rewards = [rewards]
    if not rewards or not all(isinstance(r, str) and (":" in r or _is_folder(r)) for r in rewards):
        raise ValueError(
            f"{where}`reward_funcs:` must list import strings 'module:function', e.g. "
            f"[rlasync.rewards:last_number_reward], or folders of reward models, got {rewards!r}"
        )
    return RunFile(model=model, config=config, dataset=dict(dataset), reward_funcs=list(rewards), trainer=trainer)


def import_object(text: str) -> Any:
    """`"package.module:attribute"` -> the attribute (a reward function, a loop class, ...)."""
    module_name, sep, attribute = text.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{text!r}: write an import string as 'module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{text!r}: cannot import module {module_name!r}: {exc}") from exc
    try:
        obj = module
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(f"{text!r}: module {module_name!r} has no attribute {attribute!r}") from None
    return obj


def _is_folder(name: str) -> bool:
    """A `reward_funcs:` entry naming an existing folder (a reward model's) rather than a function to import."""
    return os.path.isdir(os.path.expanduser(name))
