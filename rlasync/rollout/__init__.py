"""Rollouts: the rollout loop (`AsyncRolloutLoop`) and its three parts — the task scheduler (`TaskScheduler`), the
engine pool (`EnginePool`) and the GRPO rollout policy (`RolloutPolicy`, the user hooks) — with their typed
settings (`RolloutSettings`), group scoring and the adaptive concurrency cap.

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
from rlasync.rollout.engine_pool import EnginePool
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
from rlasync.rollout.policy import RolloutPolicy
from rlasync.rollout.scheduler import TaskScheduler
from rlasync.rollout.settings import RolloutSettings

__all__ = [
    "Admission",
    "AsyncRolloutLoop",
    "ConcurrencyController",
    "EnginePool",
    "GroupResult",
    "GroupSink",
    "OpenAdmission",
    "PromptLease",
    "PromptSource",
    "Rollout",
    "RolloutContext",
    "RolloutGroup",
    "RolloutPolicy",
    "RolloutSample",
    "RolloutSettings",
    "TaskScheduler",
    "TrainingSequence",
    "TurnRecord",
    "build_training_sequences",
    "new_rollout_id",
]
