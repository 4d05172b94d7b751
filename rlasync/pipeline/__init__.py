"""The pure core of the StalenessQueue actor: prompt leases and epochs, the sample queue, the token allowance.

    PromptDispatcher  which prompt each new group generates; epochs; the resume position (dispatcher.py)
    StalenessQueue    FIFO of scored samples, token-targeted takes, stale samples dropped at take (staleness_queue.py)
    TokenAllowance    generation held to S steps of tokens ahead of training (in-flight work counted at the learned
                      keep rate), synchronous at S = 0 (allowance.py)
    QueueService      the three wired together: what the Ray actor forwards to (service.py)
    RolloutState      rollout_state.json, with the allowance's learned state (resume.py)

Importing this package never loads torch or ray.
"""

from rlasync.pipeline.allowance import (
    BACKPRESSURE_METRIC,
    KEEP_RATE_FLOOR,
    KEEP_RATE_METRIC,
    AcquireResult,
    AllowanceState,
    TokenAllowance,
    initial_tokens_per_step,
)
from rlasync.pipeline.dispatcher import DROP_REASONS, DropReason, GroupOutcome, PromptDispatcher, PromptLease
from rlasync.pipeline.resume import ROLLOUT_STATE_FILENAME, RolloutState, read_rollout_state, write_rollout_state
from rlasync.pipeline.service import NextGroup, QueueService, QueueState
from rlasync.pipeline.staleness_queue import QueueEntry, StalenessQueue, TakeResult

__all__ = [
    "BACKPRESSURE_METRIC",
    "DROP_REASONS",
    "KEEP_RATE_FLOOR",
    "KEEP_RATE_METRIC",
    "ROLLOUT_STATE_FILENAME",
    "AcquireResult",
    "AllowanceState",
    "DropReason",
    "GroupOutcome",
    "NextGroup",
    "PromptDispatcher",
    "PromptLease",
    "QueueEntry",
    "QueueService",
    "QueueState",
    "RolloutState",
    "StalenessQueue",
    "TakeResult",
    "TokenAllowance",
    "initial_tokens_per_step",
    "read_rollout_state",
    "write_rollout_state",
]
