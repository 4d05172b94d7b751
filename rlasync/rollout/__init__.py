"""Rollouts: group scoring, the adaptive concurrency cap and the rollout loop (`AsyncRolloutLoop`).

The records live in `rlasync.records` (re-exported here). Importing this package never loads torch or ray.
"""

from rlasync.records import (
    PromptLease,
    Rollout,
    RolloutGroup,
    RolloutSample,
    TrainingSequence,
    TurnRecord,
    new_rollout_id,
)
from rlasync.rollout.concurrency import ConcurrencyController
from rlasync.rollout.loop import (
    Admission,
    AsyncRolloutLoop,
    GroupResult,
    GroupSink,
    OpenAdmission,
    PromptSource,
    RolloutContext,
    build_training_sequences,
)

__all__ = [
    "Admission",
    "AsyncRolloutLoop",
    "ConcurrencyController",
    "GroupResult",
    "GroupSink",
    "OpenAdmission",
    "PromptLease",
    "PromptSource",
    "Rollout",
    "RolloutContext",
    "RolloutGroup",
    "RolloutSample",
    "TrainingSequence",
    "TurnRecord",
    "build_training_sequences",
    "new_rollout_id",
]
