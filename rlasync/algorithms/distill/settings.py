"""The distillation loop's typed settings: the common `RolloutSettings` (one task per lease, the in-flight task
budget, the student's sampling) and the teachers' scoring (`TeacherSettings`), derived once from an
`AsyncDistillationConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from rlasync.config.distill import AsyncDistillationConfig
from rlasync.engine.base import SamplingParams
from rlasync.rollout.settings import RolloutSettings


@dataclass(frozen=True, slots=True)
class TeacherSettings:
    """teacher_top_k: candidates kept per position (K); teacher_temperature: the teachers' scoring temperature."""

    teacher_top_k: int = 0
    teacher_temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.teacher_top_k < 0:
            raise ValueError(f"teacher_top_k={self.teacher_top_k} must be >= 0")

    @classmethod
    def from_config(cls, config: AsyncDistillationConfig) -> TeacherSettings:
        return cls(teacher_top_k=int(config.teacher_top_k), teacher_temperature=float(config.teacher_temperature))


def rollout_settings(
    config: AsyncDistillationConfig, *, max_inflight_tasks: int | None = None, num_ranks: int = 1
) -> RolloutSettings:
    """The loop's `RolloutSettings`: one task per lease, at most `max_inflight_tasks` (e.g. one rollout actor's
    share; else the config's value resolved over `num_ranks` learner ranks,
    `AsyncDistillationConfig.resolved_max_inflight_tasks`) in flight."""
    if max_inflight_tasks is None:
        if config.max_inflight_tasks == 0:
            raise ValueError("max_inflight_tasks=0: no task could ever run (use -1 for the default)")
        max_inflight_tasks = config.resolved_max_inflight_tasks(num_ranks)
    if max_inflight_tasks < 1:
        raise ValueError(f"max_inflight_tasks={max_inflight_tasks} must be >= 1")
    return RolloutSettings(
        group_size=1,
        max_concurrent=int(max_inflight_tasks),
        # no log-probs and no candidate sets: the student side is recomputed by the learner
        sampling=SamplingParams.for_student(config),
        heartbeat_timeout_s=config.heartbeat_stale_after_s,
        chat_template_kwargs=config.chat_template_kwargs,
        log_completions=bool(config.log_completions),
        log_completions_steps=int(config.log_completions_steps or 0),
    )


def resolve_max_inflight_tasks(config: AsyncDistillationConfig, num_ranks: int = 1) -> int:
    """`config.max_inflight_tasks`, or for a negative value `max(max_staleness, 1) × samples_per_step`
    (docs/algorithms.md §10; `samples_per_step` = `per_device_train_batch_size × gradient_accumulation_steps ×
    num_ranks`)."""
    return rollout_settings(config, num_ranks=num_ranks).max_concurrent


__all__ = ["TeacherSettings", "resolve_max_inflight_tasks", "rollout_settings"]
