"""User-facing drivers: `AsyncGRPOTrainer` and `AsyncDistillationTrainer` (the only core package, with
`rlasync.cli`, that starts Ray, lazily)."""

from rlasync.trainers.distill import AsyncDistillationTrainer
from rlasync.trainers.grpo import AsyncGRPOTrainer

__all__ = ["AsyncDistillationTrainer", "AsyncGRPOTrainer"]
