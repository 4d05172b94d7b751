"""`RayEvaluation`: one evaluation during training over the running rollout actors (the step loop's `evaluate`).

    BackgroundEvaluations (rlasync.driver.evaluation) ──evaluate(version)──► RayEvaluation
        ──evaluate(eval dataset ref, row indices, num_generations_eval, version)──► each RolloutActor (its share of
          the rows, dealt round-robin) ──► its loop's policy: the engines it trains with, the RewardActor pool
        ◄── EvalTally per actor, merged ──► `eval/` metrics

The rollout actors run the evaluation next to their training rollouts (an async actor: its loop keeps going); the
driver awaits the ObjectRefs on its event loop, so no Ray-call thread is held while the engines generate.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from actors.fanout import remote_all
from rlasync.rollout.evaluation import EvalTally, split_rows


class RayEvaluation:
    """`evaluate(version) -> eval/ metrics` over the Cluster's current rollout actors (`rollouts()`: elastic pools
    may have resized them); the eval dataset is put in the object store once."""

    def __init__(
        self, rollouts: Any, eval_dataset: Any, num_generations: int, timeout_s: float, *, dataset_ref: Any = None
    ) -> None:
        self.rollouts = rollouts
        self.num_rows = len(eval_dataset)
        self.dataset_ref = dataset_ref if dataset_ref is not None else ray.put(eval_dataset)
        self.num_generations, self.timeout_s = num_generations, timeout_s

    async def __call__(self, version: int) -> dict[str, float]:
        handles = list(self.rollouts())
        shares = split_rows(self.num_rows, len(handles))
        each = [(share, self.num_generations, version) for share in shares]
        refs = remote_all(handles[: len(shares)], "evaluate", self.dataset_ref, each=each)
        tallies = await asyncio.wait_for(asyncio.gather(*refs), self.timeout_s)
        total = EvalTally(policy_version=version)
        for tally in tallies:
            total = total.merge(tally)
        return total.metrics()


__all__ = ["RayEvaluation"]
