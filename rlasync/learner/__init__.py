"""The learner's core: one optimisation step on tree-packed micro-batches (no Ray; FSDP2 applied from outside)."""

from rlasync.learner.parallel import shard_for_training
from rlasync.learner.step import LearnerStep, OptimizerSettings, build_optimizer

__all__ = ["LearnerStep", "OptimizerSettings", "build_optimizer", "shard_for_training"]
