"""TRL's import paths, so that a TRL user switches by changing `trl` to `rlasync` in the import line.

    from rlasync.trainer.async_grpo_trainer import AsyncRolloutLoop, Rollout, RolloutGroup, TurnRecord

The classes live in their own packages (`rlasync.algorithms.grpo`, `rlasync.records`, `rlasync.trainers`); these modules
only re-export them and import lazily (importing `rlasync.trainer` loads no trainer).
"""
