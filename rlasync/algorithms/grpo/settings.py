"""GRPO's rollout settings: the common `RolloutSettings` read from an `AsyncGRPOConfig` (or a user subclass):
groups of `num_generations`, at most `max_concurrent_rollouts` rollouts in flight, the sampler's top-K log-probs,
the tool and reward limits, the reward weights, completion printing."""

from __future__ import annotations

from rlasync.config.grpo import AsyncGRPOConfig
from rlasync.engine.base import SamplingParams
from rlasync.rollout.settings import RolloutSettings


def group_size(config: AsyncGRPOConfig) -> int:
    """Rollouts per prompt: `num_generations`, read here only (the spec's group size, what a RolloutActor leases,
    and the loop's settings)."""
    return int(config.num_generations)


def rollout_settings(config: AsyncGRPOConfig) -> RolloutSettings:
    """The loop's settings, derived once from the config."""
    return RolloutSettings(
        group_size=group_size(config),
        max_concurrent=int(config.max_concurrent_rollouts),
        sampling=SamplingParams.from_config(config),
        heartbeat_timeout_s=config.rollout_worker_timeout,
        reward_timeout_s=config.reward_timeout_s,
        tool_timeout_s=config.tool_timeout_s,
        reward_weights=None if config.reward_weights is None else tuple(config.reward_weights),
        scale_rewards=config.scale_rewards,
        num_sampler_logprobs=int(config.num_sampler_logprobs),
        max_tool_calling_iterations=config.max_tool_calling_iterations,
        chat_template_kwargs=config.chat_template_kwargs,
        log_completions=bool(config.log_completions),
        num_completions_to_print=config.num_completions_to_print,
    )


__all__ = ["group_size", "rollout_settings"]
