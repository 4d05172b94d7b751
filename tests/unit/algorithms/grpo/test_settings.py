"""GRPO's rollout settings, read once from an AsyncGRPOConfig; the spec's group size is the same reading."""

from rlasync.algorithms.grpo.settings import rollout_settings
from rlasync.algorithms.grpo.spec import GRPO
from rlasync.config import AsyncGRPOConfig
from rlasync.engine.base import SamplingParams


def test_rollout_settings_from_a_grpo_config():
    config = AsyncGRPOConfig(
        num_generations=4,
        max_concurrent_rollouts=6,
        num_sampler_logprobs=3,
        max_completion_length=9,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        rollout_worker_timeout=12.0,
        max_tool_calling_iterations=2,
        log_completions=True,
    )
    settings = rollout_settings(config)
    assert (settings.group_size, settings.max_concurrent, settings.heartbeat_timeout_s) == (4, 6, 12.0)
    assert settings.max_tool_calling_iterations == 2 and settings.log_completions
    params = settings.sampling.with_seed(11)
    assert params == SamplingParams.from_config(config, seed=11)  # the engine's own reading of the config
    assert GRPO.group_size(config) == settings.group_size == 4
