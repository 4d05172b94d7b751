"""DistillRolloutActor: one `AsyncDistillationLoop` (SPEC §9.1) wired to Ray handles.

    queue actor ──next_group(1)──► _QueuePromptSource.lease()   (a distillation "group" is one sample)
    loop ──generate──► _RemoteStudent ──► GenerationActor handles (the student; they receive the weight syncs)
    loop ──score──► _RemoteTeacher ──► TeacherScorer handle of the row's teacher id
    loop ──put(DistillationSample)──► _QueueSink: the sample ray.put here, its ObjectRef + metadata to the queue

The queue gates admission (max_staleness × tokens per step) exactly as for GRPO; `group_id` = `prompt_id`. The
queue's "no lease right now" (timeout) is waited through, only `done` ends the stream. A failed task's lease is
dropped ("failed"), a cancelled one released. Metrics are buffered as raw items and drained by the driver.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import traceback
from typing import Any

import ray

from rlasync.distill import AsyncDistillationLoop
from rlasync.pipeline import QueueEntry
from rlasync.rollout.loop import PromptLease

logger = logging.getLogger(__name__)
LEASE_POLL_S = 5.0


class _RemoteStudent:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def generate(self, prompt_ids: list[int], sampling: Any) -> Any:
        return self.handle.generate.remote(prompt_ids, sampling)


class _RemoteTeacher:
    """A TeacherScorer handle as an engine with `score(token_ids, prompt_length, top_k)`."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def score(self, token_ids: list[int], prompt_length: int, top_k: int) -> Any:
        return self.handle.score.remote(token_ids, prompt_length, top_k)


class _RemoteTemperedTeacher(_RemoteTeacher):
    """The same, for a teacher engine that scores at a temperature (the loop then passes `teacher_temperature`)."""

    def score(self, token_ids: list[int], prompt_length: int, top_k: int, temperature: float = 1.0) -> Any:  # type: ignore[override]
        return self.handle.score.remote(token_ids, prompt_length, top_k, temperature)


class _QueuePromptSource:
    def __init__(self, actor: DistillRolloutActor) -> None:
        self.actor = actor
        self.leases: dict[int, Any] = {}

    async def lease(self) -> PromptLease | None:
        waited = 0.0
        while True:
            answer = await self.actor.queue.next_group.remote(1, LEASE_POLL_S)
            waited += answer.waited_s
            if answer.lease is not None:
                break
            if answer.done:
                return None
        lease = answer.lease
        self.actor.loop.update_policy_version(answer.policy_version)
        self.leases[lease.group_id] = lease
        return PromptLease(lease.group_id, lease.row_index, self.actor.dataset[lease.row_index], lease.epoch, waited)

    async def release(self, lease: PromptLease, reason: str) -> None:
        queue_lease = self.leases.pop(lease.group_id)
        if reason == "failed":  # the engine rejected the request: retrying cannot help
            await self.actor.queue.drop_group.remote(lease.group_id, reason, 0)
        else:  # "cancelled" (the loop is stopping): the prompt is leased again
            await self.actor.queue.release.remote(queue_lease)


class _QueueSink:
    def __init__(self, actor: DistillRolloutActor, source: _QueuePromptSource) -> None:
        self.actor = actor
        self.source = source

    async def put(self, sample: Any) -> None:
        self.source.leases.pop(sample.prompt_id, None)
        await self.actor.queue.put_group.remote([QueueEntry.for_sample(sample, payload=ray.put(sample))])


@ray.remote
class DistillRolloutActor:
    def __init__(
        self, *, index: int, args: Any, tokenizer: Any, dataset: Any, queue: Any, students: list[Any],
        teachers: dict[str, Any], tempered: dict[str, bool] | None = None, seed: int = 0,
        loop_cls: type[AsyncDistillationLoop] = AsyncDistillationLoop, max_inflight_tasks: int | None = None,
    ) -> None:  # fmt: skip
        logging.basicConfig(level=logging.INFO)
        self.index = index
        self.args = args
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.dataset = dataset
        self.queue = queue
        self.items: list[tuple[str, Any]] = []
        tempered = tempered or {}
        source = _QueuePromptSource(self)
        self.loop = loop_cls(
            args=args, tokenizer=tokenizer, student=[_RemoteStudent(h) for h in students],
            teachers={
                teacher_id: (_RemoteTemperedTeacher if tempered.get(teacher_id) else _RemoteTeacher)(handle)
                for teacher_id, handle in teachers.items()
            },
            prompt_source=source, sink=_QueueSink(self, source), metrics_callback=self.items.extend,
            rng=random.Random(seed * 1_000_003 + index), max_inflight_tasks=max_inflight_tasks,
        )  # fmt: skip
        self.task: asyncio.Task | None = None
        self.error: str | None = None

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            await self.loop.run()
        except BaseException as exc:  # kept for health(): the driver raises it with its message
            self.error = f"{type(exc).__name__}: {exc}"
            logger.error("distillation rollout actor %d failed:\n%s", self.index, traceback.format_exc())

    def health(self) -> dict[str, Any]:
        """`error` (a message) when the loop failed; else the heartbeat's age and whether the loop runs."""
        if self.error is None:
            try:
                self.loop.check_health(float(getattr(self.args, "heartbeat_stale_after_s", 300.0)))
            except RuntimeError as exc:
                self.error = str(exc)
        return {
            "error": self.error,
            "running": self.loop.is_running,
            "heartbeat_age_s": time.time() - self.loop.heartbeat,
        }

    def drain_metrics(self) -> list[tuple[str, Any]]:
        items, self.items[:] = list(self.items), []
        return items

    async def stop(self) -> None:
        await self.loop.stop()
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)
