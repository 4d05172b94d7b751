"""RewardActor: runs the reward functions for the rollout actors (one pool, round-robin).

    RolloutActor loop ──score(prompts, completions, completion_ids, reward_kwargs)──► RewardActor
                      ◄── RewardTable (one column per function) ──

Advantages, zero-std dropping and the samples stay in the rollout loop (its `compute_advantages` hook), so a
pool only moves the reward computation (math verification, model-based rewards, sandboxes) off the rollout
actors. It is an async actor: groups from every rollout actor are scored concurrently on its event loop, so a reward
model (`rlasync.rewards.RewardModel`, loaded here once, on the actor's GPU share `cluster.reward_num_gpus`) merges
the groups that arrive within its `max_wait_s` into one batch. A function that raises, returns the wrong length or
a non-number raises `RewardFunctionError` here; the rollout loop surfaces it like a local failure.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import ray

from rlasync.rewards import RewardTable, call_reward_funcs
from rlasync.rewards.model import RewardModel, set_request_source


@ray.remote
class RewardActor:
    def __init__(self, *, reward_funcs: list[Any]) -> None:
        logging.basicConfig(level=logging.INFO)
        self.reward_funcs = list(reward_funcs)
        for func in self.reward_funcs:
            if isinstance(func, RewardModel):
                func.prepare()  # its imports, before any group's threads run (the model loads on its first group)
        self.num_groups = 0
        self._incarnation = uuid.uuid4().hex  # a new one when Ray restarts this actor

    async def score(
        self,
        *,
        prompts: Any,
        completions: Any,
        completion_ids: Any,
        reward_kwargs: dict[str, Any],
        source: str | None = None,
    ) -> RewardTable:
        self.num_groups += 1
        set_request_source(source)  # this call's own context: a reward model's batcher counts the senders it merges
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
