"""Configuration: `AsyncGRPOConfig` and `AsyncDistillationConfig` (TRL's names and defaults) and their
YAML/override loader (`load_config(path, overrides, config_class=...)`).

Imports neither torch nor ray.
"""

from rlasync.config.distill import AsyncDistillationConfig
from rlasync.config.grpo import AsyncGRPOConfig, ClusterConfig
from rlasync.config.kernels import KernelSettings
from rlasync.config.load import apply_overrides, build_config, load_config, parse_override, read_yaml

__all__ = [
    "AsyncDistillationConfig",
    "AsyncGRPOConfig",
    "ClusterConfig",
    "KernelSettings",
    "apply_overrides",
    "build_config",
    "load_config",
    "parse_override",
    "read_yaml",
]
