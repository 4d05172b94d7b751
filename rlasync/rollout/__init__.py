"""Rollout records, group scoring, the adaptive concurrency cap and the rollout loop.

Importing this package never loads torch or ray. The loop and the controller are loaded on first access
(`rlasync.rollout.AsyncRolloutLoop`), so that `rlasync.engine` (which uses the records) can import this package
without a cycle.
"""

from typing import Any

from rlasync.rollout.records import (
    Rollout,
    RolloutGroup,
    RolloutSample,
    TrainingSequence,
    TurnRecord,
    new_rollout_id,
)

_LAZY = {
    "AsyncRolloutLoop": "rlasync.rollout.loop",
    "Admission": "rlasync.rollout.loop",
    "GroupResult": "rlasync.rollout.loop",
    "GroupSink": "rlasync.rollout.loop",
    "OpenAdmission": "rlasync.rollout.loop",
    "PromptLease": "rlasync.rollout.loop",
    "PromptSource": "rlasync.rollout.loop",
    "RolloutContext": "rlasync.rollout.loop",
    "build_training_sequences": "rlasync.rollout.loop",
    "ConcurrencyController": "rlasync.rollout.concurrency",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rlasync.rollout' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


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
