"""The rollout runtime every algorithm's loop is assembled from: the task scheduler (`TaskScheduler`), the engine
pool (`EnginePool`), the protocols a policy talks to, the typed settings (`RolloutSettings`), group scoring, tools,
environments, training sequences and the adaptive concurrency cap. The loops and policies themselves live with their
algorithms (GRPO's `AsyncRolloutLoop`: `rlasync.algorithms.grpo.loop`); nothing here names one.

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
from rlasync.rollout.groups import GroupResult
from rlasync.rollout.protocols import Admission, OpenAdmission, PromptSource
from rlasync.rollout.scheduler import TaskScheduler
from rlasync.rollout.sequences import build_training_sequences
from rlasync.rollout.settings import RolloutSettings

__all__ = [
    "Admission",
    "ConcurrencyController",
    "EnginePool",
    "GroupResult",
    "OpenAdmission",
    "PromptLease",
    "PromptSource",
    "Rollout",
    "RolloutGroup",
    "RolloutSample",
    "RolloutSettings",
    "TaskScheduler",
    "TrainingSequence",
    "TurnRecord",
    "build_training_sequences",
    "new_rollout_id",
]
