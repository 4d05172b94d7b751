"""`trl.experimental.async_distillation`'s public names, re-exported (the classes live in `rlasync.trainers`,
`rlasync.config` and `rlasync.distill`)."""

from rlasync.config import AsyncDistillationConfig
from rlasync.distill.loop import AsyncDistillationLoop
from rlasync.trainers import AsyncDistillationTrainer

__all__ = ["AsyncDistillationConfig", "AsyncDistillationLoop", "AsyncDistillationTrainer"]
