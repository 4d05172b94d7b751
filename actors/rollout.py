"""RolloutActor: one `AsyncRolloutLoop` (or the trainer's `loop_cls`) wired to Ray handles.

    queue actor ──next_group──► QueuePromptSource.lease() (actors/loop_host.py)  (the queue gates admission: OpenAdmission here)
    loop ──generate──► EngineChannel (actors/engine_channel.py: many requests per call) ──► GenerationActor handles
    loop ──reward_scorer──► _RewardPool ──► RewardActor handles (when the cluster has any; else the loop scores)
    loop ──put(GroupResult)──► QueueGroupSink: samples ray.put here, ObjectRefs + metadata to the queue

The lease is `rlasync.records.PromptLease` on both sides; the queue's "no lease right now" (timeout) is waited
through, only `done` ends the loop's stream. A seed per request and the retries of transient engine errors are the
loop's own. Metrics are buffered as raw items and drained by the driver.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import ray

from actors.engine_channel import EngineChannel
from actors.loop_host import LoopHost, QueueGroupSink
from actors.restart import RestartableLoop

logger = logging.getLogger(__name__)


class _RewardPool:
    """The loop's `reward_scorer`: each group goes to the next RewardActor (round-robin)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = list(handles)
        self.next = 0

    def __call__(self, **group: Any) -> Any:
        handle = self.handles[self.next % len(self.handles)]
        self.next += 1
        return handle.score.remote(**group)


@ray.remote
class RolloutActor(RestartableLoop, LoopHost):
    def __init__(
        self,
        *,
        index: int,
        config: Any,
        tokenizer: Any,
        dataset: Any,
        queue: Any,
        engines: list[Any],
        reward_funcs: list[Any],
        reward_actors: list[Any] | None = None,
        loop_cls: type,
        seed: int = 0,
        tools: list[Any] | None = None,
        environment_factory: Any = None,
    ) -> None:
        tokenizer = self._host(index, config, tokenizer, dataset, queue, group_size=config.num_generations)
        extra: dict[str, Any] = {}  # only when set: a loop_cls with a narrower __init__ keeps working without them
        if tools:
            extra["tools"] = tools
        if environment_factory is not None:
            extra["environment_factory"] = environment_factory
        self.loop = loop_cls(
            config=config,
            tokenizer=tokenizer,
            engine=[EngineChannel(h, f"generation actor {i}") for i, h in enumerate(engines)],
            prompt_source=self.source,
            sink=QueueGroupSink(queue, self.source),
            reward_funcs=reward_funcs,
            metrics_callback=self.items.extend,
            rng=random.Random(seed * 1_000_003 + index),
            reward_scorer=_RewardPool(reward_actors) if reward_actors else None,
            **extra,
        )
