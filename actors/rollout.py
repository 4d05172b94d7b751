"""RolloutActor: one rollout loop (the trainer's `loop_cls`: an `AsyncRolloutLoop`, an `AsyncDistillationLoop`,
or any algorithm's) wired to Ray handles. One actor serves every algorithm; the algorithm's spec
(rlasync.algorithms.spec.Algorithm, read by the Cluster) says which parts the loop gets:

    queue actor ──next_group(group_size)──► QueuePromptSource.lease() (actors/loop_host.py)  (the queue gates admission)
    loop ──generate──► EngineChannel (actors/engine_channel.py: many requests per call) ──► GenerationActor handles
                       (under the loop's `engine_arg` keyword: "engine", or distillation's "student")
    loop ──reward_scorer──► _RewardPool ──► RewardActor handles (`reward_actors`, when the cluster has any)
    loop ──score──► _RemoteTeacher ──► TeacherScorer handle of the row's teacher id (`teachers`)
    loop ──put──► QueueGroupSink (sink "groups": a GroupResult's samples ray.put here, ObjectRefs + metadata to the
                  queue) or QueueSampleSink (sink "samples": one sample per lease)

The lease is `rlasync.records.PromptLease` on both sides; the queue's "no lease right now" (timeout) is waited
through, only `done` ends the loop's stream. A seed per request and the retries of transient engine errors are the
loop's own. Metrics are buffered as raw items and drained by the driver.
"""

from __future__ import annotations

import logging
import random
import sys
from typing import TYPE_CHECKING, Any

import ray

from actors.engine_channel import EngineChannel
from actors.loop_host import LoopHost, QueueGroupSink, QueueSampleSink
from actors.restart import RestartableLoop

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

logger = logging.getLogger(__name__)

SINKS = {"groups": QueueGroupSink, "samples": QueueSampleSink}


class _RewardPool:
    """The loop's `reward_scorer`: each group goes to the next RewardActor (round-robin), named by its sender (a
    reward model's batches count the rollout actors they merge); the metrics its reward functions reported
    (`RewardTable.metrics`, e.g. a reward model's batch sizes) go to `emit`, the loop's metric buffer."""

    def __init__(self, handles: list[Any], source: str | None = None, emit: Any = None) -> None:
        self.handles = list(handles)
        self.next = 0
        self.source = source
        self.emit = emit

    def __call__(self, **group: Any) -> Any:
        handle = self.handles[self.next % len(self.handles)]
        self.next += 1
        ref = handle.score.remote(**group, source=self.source)
        return ref if self.emit is None else self._reported(ref)

    async def _reported(self, ref: Any) -> Any:
        table = await ref
        if table.metrics:
            self.emit(list(table.metrics))
        return table


class _RemoteTeacher:
    """A TeacherScorer handle as an engine with `score(token_ids, prompt_length, top_k, temperature)`."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def score(self, token_ids: list[int], prompt_length: int, top_k: int, temperature: float = 1.0) -> Any:
        return self.handle.score.remote(token_ids, prompt_length, top_k, temperature)


@ray.remote
class RolloutActor(RestartableLoop, LoopHost):
    def __init__(
        self,
        *,
        index: int,
        config: TrainerConfig,
        tokenizer: Any,
        dataset: Any,
        queue: Any,
        engines: list[Any],
        loop_cls: type,
        group_size: int,
        loop_kwargs: dict[str, Any] | None = None,
        engine_arg: str = "engine",
        sink: str = "groups",
        reward_actors: list[Any] | None = None,
        teachers: dict[str, Any] | None = None,
        seed: int = 0,
        actor_name: str = "rollout actor",
    ) -> None:
        if sink not in SINKS:
            raise ValueError(f"RolloutActor sink={sink!r}: use one of {sorted(SINKS)}")
        from actors.fanout import resolve_named

        if config.cluster.gil_switch_interval_s:
            sys.setswitchinterval(config.cluster.gil_switch_interval_s)
        self.kind = actor_name  # names this actor's leases at the queue and its log lines
        tokenizer = self._host(index, config, tokenizer, dataset, queue, group_size=group_size)
        # given by name (the Cluster's `Named`: no handle among a restartable actor's arguments), or as handles
        engines, reward_actors, teachers = (resolve_named(x) for x in (engines, reward_actors, teachers))
        counts = index == 0  # one rollout actor counts the engines' preemptions (EngineChannel)
        channels = [EngineChannel(h, f"generation actor {i}", counts_preemptions=counts) for i, h in enumerate(engines)]
        parts: dict[str, Any] = {engine_arg: channels}
        if reward_actors:
            parts["reward_scorer"] = _RewardPool(reward_actors, source=f"{actor_name} {index}", emit=self.items.extend)
        if teachers is not None:
            parts["teachers"] = {teacher_id: _RemoteTeacher(handle) for teacher_id, handle in teachers.items()}
        self.loop = loop_cls(
            config=config,
            tokenizer=tokenizer,
            prompt_source=self.source,
            sink=SINKS[sink](self.queue, self.source),
            metrics_callback=self.items.extend,
            rng=random.Random(seed * 1_000_003 + index),
            **parts,
            **(loop_kwargs or {}),
        )
        if config.cluster.engine_placement == "home":
            self.place_engines(index, config.cluster.num_rollout_actors)
