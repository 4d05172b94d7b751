"""`RequestBatcher`: merges concurrent scoring requests that arrive within a small wait bound into one forward.

    request (group A, 4 texts) ─┐
    request (group B, 4 texts) ─┼─ wait ≤ max_wait_s (or until max_items are waiting) ─► score(8 texts) in a thread
    request (group C, 4 texts) ─┘        ─► A gets its 4 results, B its 4, C its 4, in the order each sent them

One worker task per event loop takes everything that is waiting, runs the (blocking) score function in a thread so
that new requests keep arriving meanwhile, hands each request its slice of the results, and starts over while
requests are waiting. One forward runs at a time (the model is one device's). A score function that raises fails
every request of that batch with a `RewardModelError` naming the reward, the batch and the cause (chained); the
batcher keeps serving later requests. Each request may name its `source` (e.g. the rollout actor that sent it): the
batch record counts the distinct sources merged. Pure asyncio: no torch, no ray.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlasync.rewards.calling import RewardFunctionError

REQUEST_SOURCE: contextvars.ContextVar[Any] = contextvars.ContextVar("rlasync_reward_request_source", default=None)
"""Who sends the requests made in this context (a RewardActor sets it to the calling rollout actor's name)."""


def set_request_source(source: Any) -> None:
    """Name the sender of the requests made from now on in this context (a RewardActor's `score` call: the rollout
    actor that sent the group). A function, so that code pickled by value (a Ray actor class) need not carry the
    context variable itself."""
    REQUEST_SOURCE.set(source)


class RewardModelError(RewardFunctionError):
    """A reward model failed to score a batch; every request of the batch gets it (the cause is chained)."""


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One merged batch: `items` scored in one call of the score function, from `requests` requests sent by
    `sources` distinct senders (requests without a source count as one sender each), in `seconds`."""

    items: int
    requests: int
    sources: int
    seconds: float


@dataclass(slots=True)
class _Request:
    items: list[Any]
    future: asyncio.Future[list[float]]
    source: Any


class RequestBatcher:
    """Merge concurrent `submit` calls (see the module docstring).

    score:     `score(items) -> list[float]`, one result per item, blocking (run in a worker thread)
    name:      named in errors
    max_wait_s: how long the first waiting request waits for others to join it
    max_items: a batch starts at once when this many items are waiting (a larger request still goes whole)
    on_batch:  called with a `BatchRecord` after every batch (its metrics)
    """

    def __init__(
        self,
        score: Callable[[list[Any]], Sequence[float]],
        *,
        name: str,
        max_wait_s: float,
        max_items: int,
        on_batch: Callable[[BatchRecord], Any] | None = None,
    ) -> None:
        if isinstance(max_wait_s, bool) or not isinstance(max_wait_s, int | float) or not max_wait_s >= 0:
            raise ValueError(f"max_wait_s={max_wait_s!r} must be a number of seconds >= 0 (e.g. 0.01)")
        if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1:
            raise ValueError(f"max_items={max_items!r} must be a positive integer")
        self.score, self.name = score, name
        self.max_wait_s, self.max_items = float(max_wait_s), max_items
        self.on_batch = on_batch
        self._pending: list[_Request] = []
        self._pending_items = 0
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit(self, items: Sequence[Any], source: Any = None) -> list[float]:
        """The results of `items`, in their order, once the batch they joined was scored."""
        items = list(items)
        if not items:
            return []
        loop = asyncio.get_running_loop()
        self._ensure_worker(loop)
        future: asyncio.Future[list[float]] = loop.create_future()
        self._pending.append(_Request(items, future, REQUEST_SOURCE.get() if source is None else source))
        self._pending_items += len(items)
        assert self._wake is not None
        self._wake.set()
        return await future

    def _ensure_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not loop or self._worker is None or self._worker.done():
            if self._loop is not loop:  # a new loop (another process, a test's loop): nothing pending belongs to it
                self._pending, self._pending_items = [], 0
            self._loop, self._wake = loop, asyncio.Event()
            self._worker = loop.create_task(self._run(), name=f"reward model {self.name} batcher")

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
            deadline = time.monotonic() + self.max_wait_s
            while self._pending_items < self.max_items and (left := deadline - time.monotonic()) > 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except TimeoutError:
                    break
            batch, self._pending, self._pending_items = self._pending, [], 0
            await self._score_batch(batch)

    async def _score_batch(self, batch: list[_Request]) -> None:
        batch = [request for request in batch if not request.future.done()]  # cancelled callers drop out
        if not batch:
            return
        items = [item for request in batch for item in request.items]
        started = time.monotonic()
        try:
            results = list(await asyncio.to_thread(self.score, items))
            if len(results) != len(items):
                raise ValueError(f"the score function returned {len(results)} results for {len(items)} items")
        except Exception as exc:
            error = RewardModelError(
                f"reward model '{self.name}' failed to score a batch of {len(items)} completions from "
                f"{len(batch)} request(s): {type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(error)
            return
        seconds = time.monotonic() - started
        start = 0
        for request in batch:
            end = start + len(request.items)
            if not request.future.done():
                request.future.set_result(results[start:end])
            start = end
        if self.on_batch is not None:
            sources = {request.source for request in batch if request.source is not None}
            unnamed = sum(request.source is None for request in batch)
            self.on_batch(BatchRecord(len(items), len(batch), len(sources) + unnamed, seconds))
