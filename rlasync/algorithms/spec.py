"""`Algorithm`: what one training algorithm is made of, named once (in the spirit of torchtitan's `TrainSpec`).

    trainer ──algorithm──► RunSpec ──► Cluster: spawn_rewards?  spawn_teachers?  LearnerSettings (objective, loss)
                                                RolloutActor(loop_cls, group size, engines under `engine_arg`,
                                                             reward scorer?, teachers?, sink "groups" | "samples")

The Cluster, the settings and the trainers ask the spec; nothing below the algorithms (queue, driver, rollout
scheduler, engine pool, learner core, packing, weights) tests which algorithm runs. The registry of the specs is
`rlasync.algorithms.registry`; an algorithm defined elsewhere (a test, a user package) is one `register(...)` call.

The objective may be given as a class or as a "module:Class" string resolved on use: the trainers import the
registry before a run starts and must not load torch (a learner objective imports it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from peft import PeftConfig

    from rlasync.config.base import TrainerConfig
    from rlasync.learner.settings import LearnerSettings

SinkKind = Literal["groups", "samples"]
"""What a rollout loop puts: a `GroupResult` of scored groups ("groups") or one sample per lease ("samples")."""


@dataclass(frozen=True)
class Algorithm:
    """One algorithm (picklable; a rollout actor gets it by reference, or by value when defined in a test).

    name:          the registry key (and the default `trainer:` name of a run file)
    config_cls:    the user's config class (`AsyncGRPOConfig`, `AsyncDistillationConfig`, ...)
    loop_cls:      the default rollout loop (a trainer's `loop_cls` subclasses it)
    objective:     the learner objective class (an `rlasync.learner.objectives.Objective`), or "module:Class"
    loss:          the objective's loss settings from the user's config (`LearnerSettings.loss`)
    group_size:    rollouts per lease, from the config (GRPO: `num_generations`; distillation: 1)
    engine_arg:    the keyword the loop takes its generation engines under ("engine"; distillation "student")
    sink:          what the loop puts ("groups" or "samples")
    reward_actors: the loop may score through the RewardActor pool (`cluster.num_reward_actors`)
    teachers:      the loop gets the TeacherScorers (`teachers=`, teacher id -> engine)
    rollout_name / queue_name / hang_setting: the rollout actors' name in errors, the queue actor's name, and
                   the config field that holds the hang limit (seconds; `hang_timeout(config)` reads it)
    trainer_names: the names a run file's `trainer:` may use for it (besides `name`)
    trainer:       "module:Class" of its trainer (what `rlasync train RUN.yaml` builds; "" for none)
    step_batcher:  "module:Class" of the token-budget batcher its objective plans rows with: the queue composes
                   each step with it (`rlasync.packing.step_plan`, docs/algorithms.md §4.5.1)
    sampling:      the rollouts' `SamplingParams` from the config (None: not known ahead): the generation engines
                   compile their sampler for it while the cluster starts (`TorchEngine.warm_up`), not at the
                   first requests
    """

    name: str
    config_cls: type
    loop_cls: type
    objective: type | str
    loss: Callable[[TrainerConfig], Any]
    group_size: Callable[[TrainerConfig], int]
    engine_arg: str = "engine"
    sink: SinkKind = "groups"
    reward_actors: bool = False
    teachers: bool = False
    rollout_name: str = "rollout actor"
    queue_name: str = "rlasync-staleness-queue"
    hang_setting: str = "rollout_worker_timeout"
    trainer_names: Sequence[str] = ()
    trainer: str = ""
    step_batcher: str = "rlasync.packing.planner:TokenBudgetBatcher"
    sampling: Callable[[TrainerConfig], Any] | None = None

    def __post_init__(self) -> None:
        if self.sink not in ("groups", "samples"):
            raise ValueError(f"Algorithm {self.name!r}: sink={self.sink!r}, use 'groups' or 'samples'")

    def hang_timeout(self, config: TrainerConfig) -> float | None:
        """The hang limit of a run of `config`: its `hang_setting` field."""
        return getattr(config, self.hang_setting)

    def objective_cls(self) -> type:
        """The learner objective class (a "module:Class" string imported here)."""
        if not isinstance(self.objective, str):
            return self.objective
        module, _, name = self.objective.partition(":")
        return getattr(importlib.import_module(module), name)

    def learner_settings(
        self,
        config: TrainerConfig,
        *,
        token_budget: int,
        max_steps: int | None = None,
        teacher_ids: Sequence[str] | None = None,
        peft_config: PeftConfig | None = None,
        optimizer_overrides: dict[str, Any] | None = None,
    ) -> LearnerSettings:
        """The `LearnerSettings` every learner rank gets: this algorithm's objective class and loss settings."""
        from rlasync.learner.settings import LearnerSettings

        return LearnerSettings.from_config(
            config,
            objective=self.objective_cls(),
            loss=self.loss(config),
            token_budget=token_budget,
            max_steps=max_steps,
            teacher_ids=list(teacher_ids) if teacher_ids else None,
            peft_config=peft_config,
            optimizer_overrides=optimizer_overrides,
        )


__all__ = ["Algorithm", "SinkKind"]
