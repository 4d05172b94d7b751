"""What the rollout-side actors share (not an actor itself): the queue as the loop's prompt source, and hosting a
worker loop (`rlasync.rollout.task_loop.TaskLoopBase`) on the actor's event loop with health and metric draining.

`QueuePromptSource` hands the queue's `rlasync.records.PromptLease` to the loop with its dataset row and the seconds
waited filled in; the queue's "no lease right now" (timeout) is waited through, only `done` ends the loop's stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from typing import Any

from rlasync.records import DROP_REASONS, GroupOutcome, PromptLease

logger = logging.getLogger(__name__)
LEASE_POLL_S = 5.0


class QueuePromptSource:
    """Leases groups of `group_size` rollouts from the queue actor; a lease whose work failed or was filtered is
    dropped there (retrying cannot help), a cancelled one (the loop is stopping) is released to be leased again."""

    def __init__(self, actor: Any, group_size: int) -> None:
        self.actor = actor
        self.group_size = group_size
        self.leases: dict[int, Any] = {}

    async def lease(self) -> PromptLease | None:
        waited = 0.0
        while True:
            answer = await self.actor.queue.next_group.remote(self.group_size, LEASE_POLL_S)
            waited += answer.waited_s
            if answer.lease is not None:
                break
            if answer.done:
                return None
        lease = answer.lease
        self.actor.loop.update_policy_version(answer.policy_version)
        self.leases[lease.group_id] = lease
        return lease._replace(row=self.actor.dataset[lease.row_index], waited_s=waited)

    async def release(self, lease: PromptLease, reason: GroupOutcome) -> None:
        queue_lease = self.leases.pop(lease.group_id, None)
        if queue_lease is None:  # its samples already reached the queue (the sink took the lease): nothing to undo
            return
        if reason in DROP_REASONS:  # "filtered", or "failed": the engine rejected the prompt; retrying cannot help
            await self.actor.queue.drop_group.remote(lease.group_id, str(reason), 0)
        else:  # "cancelled" (the loop is stopping): the prompt is leased again
            await self.actor.queue.release.remote(queue_lease)


class LoopHost:
    """Mixed into a Ray actor whose `__init__` calls `_host(...)` and sets `self.loop` (with `self.items.extend` as
    its metrics callback): `start`, `health`, `drain_metrics`, `stop`. `stale_after_s()` picks the heartbeat limit."""

    loop: Any
    index: int
    args: Any
    dataset: Any
    queue: Any
    items: list[tuple[str, Any]]
    task: asyncio.Task | None = None
    error: str | None = None
    kind = "rollout actor"

    def _host(self, index: int, args: Any, tokenizer: Any, dataset: Any, queue: Any) -> Any:
        """The state every host keeps (call first in `__init__`); returns the tokenizer, loaded if given as a path."""
        logging.basicConfig(level=logging.INFO)
        self.index, self.args, self.dataset, self.queue = index, args, dataset, queue
        self.items = []
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        return tokenizer

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            await self.loop.run()
        except BaseException as exc:  # kept for health(): the driver raises it with its message
            cause = exc
            while cause.__cause__ is not None and isinstance(cause, RuntimeError):
                cause = cause.__cause__
            self.error = f"{type(cause).__name__}: {cause}"
            logger.error("%s %d failed:\n%s", self.kind, self.index, traceback.format_exc())

    def stale_after_s(self) -> float | None:
        return None  # the loop's own default (`args.rollout_worker_timeout`)

    def health(self) -> dict[str, Any]:
        """`error` (a message) when the loop failed; else the heartbeat's age and whether the loop runs."""
        if self.error is None:
            try:
                self.loop.check_health(self.stale_after_s())
            except RuntimeError as exc:
                self.error = str(exc)
        return {"error": self.error, "running": self.loop.is_running, "heartbeat_age_s": time.time() - self.loop.heartbeat}

    def drain_metrics(self) -> list[tuple[str, Any]]:
        items, self.items[:] = list(self.items), []
        return items

    async def stop(self) -> None:
        await self.loop.stop()
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)
