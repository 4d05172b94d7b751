"""Typed rollout settings: the part every rollout loop shares, derived once from the user's flat TRL-named config.

Each algorithm reads its own fields into one (`rlasync.algorithms.grpo.settings`,
`rlasync.algorithms.distill.settings`). The task scheduler and the engine pool take a `RolloutSettings`, never the
config; the rollout policies keep the config object only for the user's hooks (`self.config`). Sampling parameters
are the engine's own reading of the config, built once; each request gets its seed with `with_seed`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlasync.engine.base import SamplingParams

DEFAULT_MAX_REQUEST_ATTEMPTS = 30


@dataclass(frozen=True, slots=True)
class RolloutSettings:
    """What the task scheduler, the engine pool and the built-in policies read.

    group_size:        tasks per lease (`num_generations`; one for an algorithm with one sample per prompt)
    max_concurrent:    tasks in flight at most (`max_concurrent_rollouts`, or the algorithm's own budget)
    heartbeat_timeout_s: a running loop whose heartbeat is older is reported hung (`rollout_worker_timeout`, or the
                       algorithm's own setting)
    max_request_attempts: tries of one engine request against transient errors (docs/algorithms.md §2.5)
    sampling:          the generation request's sampling fields
    num_sampler_logprobs: top-K sampler log-probs kept per trained token
    max_tool_calling_iterations: rounds of tool execution per rollout (None: unbounded)
    chat_template_kwargs: extra keyword arguments of the chat template
    log_completions / num_completions_to_print / log_completions_steps: completion printing
    reward_timeout_s / tool_timeout_s: per-call limits of the user's reward functions and tools (None: none)
    reward_weights:    one weight per reward function in a rollout's reward (TRL's `reward_weights`; None: 1 each)
    scale_rewards:     "group" (advantages divided by the group's reward std) or "none" (centred only); TRL's field
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
    reward_timeout_s: float | None = None
    tool_timeout_s: float | None = None
    reward_weights: tuple[float, ...] | None = None
    scale_rewards: str = "group"

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"RolloutSettings.group_size={self.group_size}: a lease needs at least one task")
        if self.max_concurrent < 1:
            raise ValueError(f"RolloutSettings.max_concurrent={self.max_concurrent}: must be >= 1")


__all__ = ["RolloutSettings"]
