"""`trl.experimental.async_distillation`'s public names, re-exported (the classes live in `rlasync.trainers`,
`rlasync.config` and `rlasync.algorithms.distill`)."""

from rlasync.algorithms.distill.loop import AsyncDistillationLoop
from rlasync.config import AsyncDistillationConfig
from rlasync.trainers import AsyncDistillationTrainer

__all__ = ["AsyncDistillationConfig", "AsyncDistillationLoop", "AsyncDistillationTrainer"]
