"""Re-export: the records moved to `rlasync.records` (a leaf every package may import); this name keeps working."""

from rlasync.records import (
    Rollout,
    RolloutGroup,
    RolloutSample,
    TrainingSequence,
    TurnRecord,
    new_rollout_id,
)

__all__ = ["Rollout", "RolloutGroup", "RolloutSample", "TrainingSequence", "TurnRecord", "new_rollout_id"]
