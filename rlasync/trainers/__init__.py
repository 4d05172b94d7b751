"""User-facing drivers: `AsyncGRPOTrainer` (the only core package, with `rlasync.cli`, that starts Ray, lazily)."""

from rlasync.trainers.grpo import AsyncGRPOTrainer

__all__ = ["AsyncGRPOTrainer"]
