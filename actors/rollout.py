"""RolloutActor: one `AsyncRolloutLoop` (or the trainer's `loop_cls`) wired to Ray handles.

    queue actor ──next_group──► QueuePromptSource.lease() (actors/loop_host.py)  (the queue gates admission: OpenAdmission here)
    loop ──generate──► _RemoteEngine ──► GenerationActor handles
    loop ──reward_scorer──► _RewardPool ──► RewardActor handles (when the cluster has any; else the loop scores)
    loop ──put(GroupResult)──► _QueueSink: samples ray.put here, ObjectRefs + metadata to the queue

Reconciles the two lease types: the queue's `rlasync.pipeline.PromptLease` (epoch, row, group_id, position) and
the loop's `PromptLease` (group_id, row_index, row, epoch, waited_s); the queue's "no lease right now" (timeout)
is waited through, only `done` ends the loop's stream. A seed per request and the retries of transient engine
errors are the loop's own. Metrics are buffered as raw items and drained by the driver.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import ray

from actors.loop_host import LoopHost, QueuePromptSource
from rlasync.pipeline import QueueEntry

logger = logging.getLogger(__name__)


class _RemoteEngine:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def generate(self, prompt_ids: list[int], sampling: Any) -> Any:
        return self.handle.generate.remote(prompt_ids, sampling)

    def stats(self) -> Any:
        return self.handle.stats.remote()


class _RewardPool:
    """The loop's `reward_scorer`: each group goes to the next RewardActor (round-robin)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = list(handles)
        self.next = 0

    def __call__(self, **group: Any) -> Any:
        handle = self.handles[self.next % len(self.handles)]
        self.next += 1
        return handle.score.remote(**group)


class _QueueSink:
    def __init__(self, actor: RolloutActor, source: QueuePromptSource) -> None:
        self.actor = actor
        self.source = source

    async def put(self, result: Any) -> None:
        self.source.leases.pop(result.group_id, None)
        if result.dropped:
            await self.actor.queue.drop_group.remote(result.group_id, "zero_std", result.num_rollout_tokens)
            return
        entries = [QueueEntry.for_sample(sample, payload=ray.put(sample)) for sample in result.scored.samples]
        await self.actor.queue.put_group.remote(entries)


@ray.remote
class RolloutActor(LoopHost):
    def __init__(
        self, *, index: int, args: Any, tokenizer: Any, dataset: Any, reward_funcs: list[Any], queue: Any,
        engines: list[Any], loop_cls: type, seed: int = 0, reward_actors: list[Any] | None = None,
        tools: list[Any] | None = None, environment_factory: Any = None,
    ) -> None:
        tokenizer = self._host(index, args, tokenizer, dataset, queue)
        source = QueuePromptSource(self, args.num_generations)
        extra: dict[str, Any] = {}  # only when set: a loop_cls with a narrower __init__ keeps working without them
        if tools:
            extra["tools"] = tools
        if environment_factory is not None:
            extra["environment_factory"] = environment_factory
        self.loop = loop_cls(
            args=args, tokenizer=tokenizer, engine=[_RemoteEngine(h) for h in engines], prompt_source=source,
            sink=_QueueSink(self, source), reward_funcs=reward_funcs, metrics_callback=self.items.extend,
            rng=random.Random(seed * 1_000_003 + index),
            reward_scorer=_RewardPool(reward_actors) if reward_actors else None, **extra,
        )
