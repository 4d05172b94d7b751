"""Configuration: `AsyncGRPOConfig` (TRL's names and defaults) and its YAML/override loader.

Imports neither torch nor ray.
"""

from rlasync.config.grpo import AsyncGRPOConfig, ClusterConfig
from rlasync.config.load import apply_overrides, build_config, load_config, parse_override, read_yaml

__all__ = ["AsyncGRPOConfig", "ClusterConfig", "apply_overrides", "build_config", "load_config", "parse_override", "read_yaml"]
