"""`trl.trainer.async_grpo_trainer`'s public names, re-exported: the rollout loop to subclass (`loop_cls`), the
records its hooks see and return, the trainer and its config."""

from rlasync.algorithms.grpo.loop import AsyncRolloutLoop
from rlasync.config import AsyncGRPOConfig
from rlasync.records import Rollout, RolloutGroup, TrainingSequence, TurnRecord
from rlasync.trainers import AsyncGRPOTrainer

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "AsyncRolloutLoop",
    "Rollout",
    "RolloutGroup",
    "TrainingSequence",
    "TurnRecord",
]
