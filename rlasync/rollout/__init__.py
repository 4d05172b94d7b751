"""Rollout records (and, later, the rollout loop). Importing this package never loads torch or ray."""

from rlasync.rollout.records import (
    Rollout,
    RolloutGroup,
    RolloutSample,
    TrainingSequence,
    TurnRecord,
    new_rollout_id,
)

__all__ = ["Rollout", "RolloutGroup", "RolloutSample", "TrainingSequence", "TurnRecord", "new_rollout_id"]
