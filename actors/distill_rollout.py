"""DistillRolloutActor: one `AsyncDistillationLoop` (docs/algorithms.md §9.1) wired to Ray handles.

    queue actor ──next_group(1)──► QueuePromptSource.lease() (actors/loop_host.py)   (a distillation "group" is one sample)
    loop ──generate──► EngineChannel (many requests per call) ──► GenerationActor handles (the student; they receive the weight syncs)
    loop ──score──► _RemoteTeacher ──► TeacherScorer handle of the row's teacher id
    loop ──put(DistillationSample)──► QueueSampleSink: the sample ray.put here, its ObjectRef + metadata to the queue

The queue gates admission (max_staleness × tokens per step) exactly as for GRPO; `group_id` = `prompt_id`. The
queue's "no lease right now" (timeout) is waited through, only `done` ends the stream. A failed task's lease is
dropped ("failed"), a cancelled one released. Metrics are buffered as raw items and drained by the driver.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import ray

from actors.engine_channel import EngineChannel
from actors.loop_host import LoopHost, QueueSampleSink
from actors.restart import RestartableLoop
from rlasync.distill import AsyncDistillationLoop

logger = logging.getLogger(__name__)


class _RemoteTeacher:
    """A TeacherScorer handle as an engine with `score(token_ids, prompt_length, top_k, temperature)`."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def score(self, token_ids: list[int], prompt_length: int, top_k: int, temperature: float = 1.0) -> Any:
        return self.handle.score.remote(token_ids, prompt_length, top_k, temperature)


@ray.remote
class DistillRolloutActor(RestartableLoop, LoopHost):
    kind = "distillation rollout actor"

    def __init__(
        self,
        *,
        index: int,
        config: Any,
        tokenizer: Any,
        dataset: Any,
        queue: Any,
        students: list[Any],
        teachers: dict[str, Any],
        loop_cls: type[AsyncDistillationLoop] = AsyncDistillationLoop,
        seed: int = 0,
        max_inflight_tasks: int | None = None,
    ) -> None:
        tokenizer = self._host(index, config, tokenizer, dataset, queue, group_size=1)  # a "group" is one sample
        self.loop = loop_cls(
            config=config,
            tokenizer=tokenizer,
            student=[EngineChannel(h, f"student engine {i}") for i, h in enumerate(students)],
            teachers={teacher_id: _RemoteTeacher(handle) for teacher_id, handle in teachers.items()},
            prompt_source=self.source,
            sink=QueueSampleSink(queue, self.source),
            metrics_callback=self.items.extend,
            rng=random.Random(seed * 1_000_003 + index),
            max_inflight_tasks=max_inflight_tasks,
        )
