"""On-policy distillation's `Algorithm` spec: one sample per prompt (a "group" of one), the student generating
and the TeacherScorers scoring, the distillation objective on plain padding-free rows. Imports no torch (the
objective and the loss load on use)."""

from __future__ import annotations

from typing import Any

from rlasync.algorithms.distill.loop import AsyncDistillationLoop
from rlasync.algorithms.spec import Algorithm
from rlasync.config.distill import AsyncDistillationConfig
from rlasync.engine.base import SamplingParams


def loss_settings(config: AsyncDistillationConfig) -> Any:
    """The distillation loss fields of the config (`DistillLossConfig`)."""
    from rlasync.algorithms.distill.loss import DistillLossConfig

    return DistillLossConfig.from_config(config)


def group_size(config: AsyncDistillationConfig) -> int:
    """One sample per leased prompt."""
    return 1


DISTILL = Algorithm(
    name="distill",
    config_cls=AsyncDistillationConfig,
    loop_cls=AsyncDistillationLoop,
    objective="rlasync.algorithms.distill.objective:DistillationObjective",
    loss=loss_settings,
    group_size=group_size,
    engine_arg="student",
    sink="samples",
    teachers=True,
    rollout_name="distillation rollout actor",
    queue_name="rlasync-distill-queue",
    trainer="rlasync.trainers.distill:AsyncDistillationTrainer",
    hang_setting="heartbeat_stale_after_s",
    trainer_names=("distillation",),
    step_batcher="rlasync.algorithms.distill.batching:TokenBudgetBatcher",
    sampling=SamplingParams.for_student,
)

__all__ = ["DISTILL", "group_size", "loss_settings"]
