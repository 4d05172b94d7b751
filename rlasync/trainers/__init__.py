"""User-facing trainers: `AsyncGRPOTrainer` and `AsyncDistillationTrainer`. Each checks its arguments and builds a
`rlasync.driver.RunSpec`; `train()` hands it to `actors.cluster.launch`, the one way from the core to Ray."""

from rlasync.trainers.distill import AsyncDistillationTrainer
from rlasync.trainers.grpo import AsyncGRPOTrainer

__all__ = ["AsyncDistillationTrainer", "AsyncGRPOTrainer"]
