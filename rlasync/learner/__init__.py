"""The learner's core: one optimisation step on tree-packed micro-batches (no Ray; FSDP2 applied from outside), and
the reduction of one step's metrics over ranks."""

from rlasync.learner.metrics import SUM_ACROSS_RANKS, reduce_across_ranks
from rlasync.learner.parallel import shard_for_training
from rlasync.learner.step import LearnerStep, OptimizerSettings, build_optimizer

__all__ = [
    "SUM_ACROSS_RANKS",
    "LearnerStep",
    "OptimizerSettings",
    "build_optimizer",
    "reduce_across_ranks",
    "shard_for_training",
]
