"""GRPO's `Algorithm` spec: groups of `num_generations` rollouts scored by reward functions (or the RewardActor
pool), the GRPO objective on tree-packed rows. Imports no torch (the objective and the loss load on use)."""

from __future__ import annotations

from typing import Any

from rlasync.algorithms.grpo.loop import AsyncRolloutLoop
from rlasync.algorithms.grpo.settings import group_size
from rlasync.algorithms.spec import Algorithm
from rlasync.config.grpo import AsyncGRPOConfig
from rlasync.engine.base import SamplingParams


def loss_settings(config: AsyncGRPOConfig) -> Any:
    """The GRPO loss fields of the config (`rlasync.algorithms.grpo.loss_config.LossConfig`)."""
    from rlasync.algorithms.grpo.loss_config import LossConfig

    return LossConfig.from_config(config)


GRPO = Algorithm(
    name="grpo",
    config_cls=AsyncGRPOConfig,
    loop_cls=AsyncRolloutLoop,
    objective="rlasync.algorithms.grpo.objective:GrpoObjective",
    loss=loss_settings,
    group_size=group_size,
    engine_arg="engine",
    sink="groups",
    reward_actors=True,
    rollout_name="rollout actor",
    queue_name="rlasync-staleness-queue",
    trainer="rlasync.trainers.grpo:AsyncGRPOTrainer",
    hang_setting="rollout_worker_timeout",
    sampling=SamplingParams.from_config,
)

__all__ = ["GRPO", "group_size", "loss_settings"]
