"""RewardActor: runs the reward functions for the rollout actors (one pool, round-robin).

    RolloutActor loop ──score(prompts, completions, completion_ids, reward_kwargs)──► RewardActor
                      ◄── RewardTable (one column per function) ──

Advantages, zero-std dropping and the samples stay in the rollout loop (its `compute_advantages` hook), so a
pool only moves the reward computation (math verification, model-based rewards, sandboxes) off the rollout
actors. A function that raises, returns the wrong length or a non-number raises `RewardFunctionError` here; the
rollout loop surfaces it like a local failure.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import ray

from rlasync.rewards import RewardTable, call_reward_funcs


@ray.remote
class RewardActor:
    def __init__(self, *, reward_funcs: list[Any]) -> None:
        logging.basicConfig(level=logging.INFO)
        self.reward_funcs = list(reward_funcs)
        self.num_groups = 0
        self._incarnation = uuid.uuid4().hex  # a new one when Ray restarts this actor

    async def score(
        self, *, prompts: Any, completions: Any, completion_ids: Any, reward_kwargs: dict[str, Any]
    ) -> RewardTable:
        self.num_groups += 1
        return await call_reward_funcs(
            self.reward_funcs,
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids,
            reward_kwargs=reward_kwargs,
        )

    def incarnation(self) -> str:
        """The token this incarnation's constructor drew: the driver sees a Ray restart by it changing
        (actors/cluster_faults.py `RestartWatch`)."""
        return self._incarnation

    def stats(self) -> dict[str, int]:
        return {"groups_scored": self.num_groups}
