"""Typed rollout settings, derived once from the user's flat TRL-named config (`AsyncGRPOConfig` or
`AsyncDistillationConfig`, which stay the user-facing surface).

The task scheduler and the engine pool take a `RolloutSettings`, never the config; the rollout policies keep the
config object only for the user's hooks (`self.config`). Sampling parameters are the engine's own reading of the
config (`SamplingParams.from_config` / `.for_student`), built once; each request gets its seed with `with_seed`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlasync.config import AsyncDistillationConfig
from rlasync.engine.base import SamplingParams

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

DEFAULT_MAX_REQUEST_ATTEMPTS = 30


@dataclass(frozen=True, slots=True)
class RolloutSettings:
    """What the task scheduler, the engine pool and the built-in policies read.

    group_size:        tasks per lease (GRPO: `num_generations`; distillation: 1)
    max_concurrent:    tasks in flight at most (GRPO: `max_concurrent_rollouts`; distillation: the resolved
                       `max_inflight_tasks`)
    heartbeat_timeout_s: a running loop whose heartbeat is older is reported hung (GRPO: `rollout_worker_timeout`;
                       distillation: `heartbeat_stale_after_s`)
    max_request_attempts: tries of one engine request against transient errors (docs/algorithms.md §2.5)
    sampling:          the generation request's sampling fields
    num_sampler_logprobs: top-K sampler log-probs kept per trained token (GRPO)
    max_tool_calling_iterations: rounds of tool execution per rollout (None: unbounded)
    chat_template_kwargs: extra keyword arguments of the chat template
    log_completions / num_completions_to_print / log_completions_steps: completion printing
    teacher_top_k / teacher_temperature: the teachers' scoring (distillation)
    reward_timeout_s / tool_timeout_s: per-call limits of the user's reward functions and tools (None: none)
    """

    group_size: int
    max_concurrent: int
    sampling: SamplingParams
    heartbeat_timeout_s: float | None = None
    max_request_attempts: int = DEFAULT_MAX_REQUEST_ATTEMPTS
    num_sampler_logprobs: int = 0
    max_tool_calling_iterations: int | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    log_completions: bool = False
    num_completions_to_print: int | None = None
    log_completions_steps: int = 100
    teacher_top_k: int = 0
    teacher_temperature: float = 1.0
    reward_timeout_s: float | None = None
    tool_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"RolloutSettings.group_size={self.group_size}: a lease needs at least one task")
        if self.max_concurrent < 1:
            raise ValueError(f"RolloutSettings.max_concurrent={self.max_concurrent}: must be >= 1")
        if self.teacher_top_k < 0:
            raise ValueError(f"teacher_top_k={self.teacher_top_k} must be >= 0")

    @classmethod
    def from_config(
        cls, config: TrainerConfig, *, max_inflight_tasks: int | None = None, num_ranks: int = 1
    ) -> RolloutSettings:
        """Settings of an `AsyncGRPOConfig` or an `AsyncDistillationConfig` (or a user subclass of either).

        `max_inflight_tasks` (distillation) overrides the config's, e.g. one rollout actor's share; else the config's
        value resolved over `num_ranks` learner ranks (`AsyncDistillationConfig.resolved_max_inflight_tasks`).
        """
        if isinstance(config, AsyncDistillationConfig):
            return cls._distillation(config, max_inflight_tasks, num_ranks)
        return cls(
            group_size=int(config.num_generations),
            max_concurrent=int(config.max_concurrent_rollouts),
            sampling=SamplingParams.from_config(config),
            heartbeat_timeout_s=config.rollout_worker_timeout,
            reward_timeout_s=config.reward_timeout_s,
            tool_timeout_s=config.tool_timeout_s,
            num_sampler_logprobs=int(config.num_sampler_logprobs),
            max_tool_calling_iterations=config.max_tool_calling_iterations,
            chat_template_kwargs=config.chat_template_kwargs,
            log_completions=bool(config.log_completions),
            num_completions_to_print=config.num_completions_to_print,
        )

    @classmethod
    def _distillation(
        cls, config: AsyncDistillationConfig, max_inflight_tasks: int | None, num_ranks: int
    ) -> RolloutSettings:
        if max_inflight_tasks is None:
            if config.max_inflight_tasks == 0:
                raise ValueError("max_inflight_tasks=0: no task could ever run (use -1 for the default)")
            max_inflight_tasks = config.resolved_max_inflight_tasks(num_ranks)
        if max_inflight_tasks < 1:
            raise ValueError(f"max_inflight_tasks={max_inflight_tasks} must be >= 1")
        return cls(
            group_size=1,
            max_concurrent=int(max_inflight_tasks),
            # no log-probs and no candidate sets: the student side is recomputed by the learner
            sampling=SamplingParams.for_student(config),
            heartbeat_timeout_s=config.heartbeat_stale_after_s,
            chat_template_kwargs=config.chat_template_kwargs,
            log_completions=bool(config.log_completions),
            log_completions_steps=int(config.log_completions_steps or 0),
            teacher_top_k=int(config.teacher_top_k),
            teacher_temperature=float(config.teacher_temperature),
        )


__all__ = ["RolloutSettings"]
