"""rlasync: asynchronous RL post-training for LLMs on Ray actors.

Importing the package is cheap: heavy modules (torch, transformers, ray) load only when their
submodules are used.
"""

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: `from rlasync import AsyncGRPOTrainer, AsyncGRPOConfig`
    if name == "AsyncGRPOTrainer":
        from rlasync.trainers import AsyncGRPOTrainer

        return AsyncGRPOTrainer
    if name == "AsyncDistillationTrainer":
        from rlasync.trainers import AsyncDistillationTrainer

        return AsyncDistillationTrainer
    if name == "AsyncGRPOConfig":
        from rlasync.config import AsyncGRPOConfig

        return AsyncGRPOConfig
    if name == "AsyncDistillationConfig":
        from rlasync.config import AsyncDistillationConfig

        return AsyncDistillationConfig
    if name == "RewardModel":
        from rlasync.rewards.model import RewardModel

        return RewardModel
    raise AttributeError(f"module 'rlasync' has no attribute {name!r}")
