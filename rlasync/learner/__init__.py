"""The learner's core (no Ray; FSDP2 applied from outside the model): `Learner` (one rank: model, precision,
optimizer, `train_step`), the `Objective` interface (the objectives live with their algorithms, rlasync.algorithms),
the step cores, the checkpoint formats, the settings
derived once from the user's config, and the reduction of one step's metrics over ranks."""

from rlasync.learner.learner import Learner
from rlasync.learner.metrics import SUM_ACROSS_RANKS, reduce_across_ranks
from rlasync.learner.parallel import shard_for_training
from rlasync.learner.settings import LearnerSettings
from rlasync.learner.step import OptimizerSettings, build_optimizer

__all__ = [
    "SUM_ACROSS_RANKS",
    "Learner",
    "LearnerSettings",
    "OptimizerSettings",
    "build_optimizer",
    "reduce_across_ranks",
    "shard_for_training",
]
