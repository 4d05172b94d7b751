"""`EngineChannel`: a GenerationActor handle as the rollout loop's engine, many requests per actor call.

    loop ──generate(ids, sampling)──► EngineChannel ──generate_stream([...]) (one Ray call per event-loop turn)──►
    GenerationActor ──yields [(index, ok, TurnRecord | exception), ...] as requests finish──► futures resolved

A rollout actor makes one generation request per rollout turn, often hundreds a second. One Ray actor call each
costs the caller a task submission (the largest share of a rollout actor's time in a profile on one H200) and
the generation actor a task execution competing with its engine thread for the interpreter. The channel gathers
the requests made within one turn of the event loop (up to `max_batch`) into one streaming call; the generation
actor yields every result that is ready as a list, so a finished request never waits for the rest of its batch.

A request's failure comes back as its own exception (a rejected request stays `RequestRejectedError`, not
retried); the stream itself failing (the actor died or is unreachable) fails every unanswered request of it with
`EngineError` naming the actor, which `EnginePool` retries with backoff on another engine or on the one Ray
restarted (docs/design.md §4); any other failure of the call propagates as it is. The core never sees Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import ray

from actors.fanout import actor_id
from rlasync.engine.base import EngineError

DEFAULT_MAX_BATCH = 256


class EngineChannel:
    """`generate(prompt_ids, sampling)` -> an awaitable TurnRecord, through `handle.generate_stream`; `stats()`
    passes through. `calls` / `requests` count actor calls and the requests they carried.

    `counts_preemptions=False` reports the engine's preemption counter as 0: every rollout actor reads the same
    engines, and each reports the increase it saw since its own previous look (`rollout/vllm_preemption_count`,
    summed over the window), so only one of them (the first) counts them, or N rollout actors would report N x."""

    def __init__(
        self,
        handle: Any,
        name: str = "generation actor",
        max_batch: int = DEFAULT_MAX_BATCH,
        counts_preemptions: bool = True,
    ) -> None:
        self.handle = handle
        self.name = name
        self.max_batch = max_batch
        self.counts_preemptions = counts_preemptions
        self.calls = 0
        self.requests = 0
        self._pending: list[tuple[list[int], Any, asyncio.Future[Any]]] = []
        self._collectors: set[asyncio.Task[None]] = set()

    def generate(self, prompt_ids: list[int], sampling: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((list(prompt_ids), sampling, future))
        return future

    async def stats(self) -> Any:
        try:
            stats = await self.handle.stats.remote()
        except ray.exceptions.RayActorError as exc:  # the engine died: the pool keeps its cap and retries later
            raise self._lost(exc) from exc
        if not self.counts_preemptions and getattr(stats, "num_preemptions", 0):
            stats = dataclasses.replace(stats, num_preemptions=0)
        return stats

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        batch = [entry for entry in batch if not entry[2].cancelled()]
        for begin in range(0, len(batch), self.max_batch):
            part = batch[begin : begin + self.max_batch]
            futures = [future for _, _, future in part]
            try:
                stream = self.handle.generate_stream.options(num_returns="streaming").remote(
                    [(ids, sampling) for ids, sampling, _ in part]
                )
            except ray.exceptions.RayActorError as exc:  # the handle cannot submit (actor gone)
                _fail(futures, self._lost(exc))
                continue
            self.calls += 1
            self.requests += len(part)
            task = asyncio.ensure_future(self._collect(stream, futures))
            self._collectors.add(task)
            task.add_done_callback(self._collectors.discard)

    async def _collect(self, stream: Any, futures: Sequence[asyncio.Future[Any]]) -> None:
        try:
            async for ref in stream:
                for index, ok, value in await ref:
                    future = futures[index]
                    if not future.done():
                        future.set_result(value) if ok else future.set_exception(value)
        except ray.exceptions.RayActorError as exc:  # ActorDiedError / ActorUnavailableError: the engine died
            _fail(futures, self._lost(exc))
        except Exception as exc:  # the stream broke otherwise (a task error of the call itself): not retried
            _fail(futures, exc)
        else:
            _fail(futures, EngineError(f"{self.name} closed a generation stream without answering every request"))

    def _lost(self, exc: BaseException) -> EngineError:
        """The retryable error of a request the engine's death (or an unreachable actor) failed. The actor id stays
        in the text: when the retries run out, the driver names the dead engine from it."""
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "no detail"
        error = EngineError(
            f"{self.name} ({actor_id(self.handle, default='?')}) did not answer: {type(exc).__name__} ({detail})"
        )
        error.__cause__ = exc
        return error


def _fail(futures: Sequence[asyncio.Future[Any]], error: BaseException) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(error)


ADMIT_SLICE = 16


async def stream_results(engine: Any, requests: Sequence[tuple[list[int], Any]], admit_slice: int = ADMIT_SLICE) -> Any:
    """The generation actor's side: run `requests` on `engine` and yield, as they finish, lists of
    `(index, ok, TurnRecord or the exception)`; closing the generator (the caller went away) cancels the rest.

    Requests start `admit_slice` at a time, with a turn of the event loop between slices: starting one runs its
    engine's synchronous admission (vLLM's input processing), so a batch of hundreds started at once would hold
    the loop for all of them, and a weight sync arriving meanwhile would wait. Finished requests are collected
    through a queue (each result once), not by waiting on every pending one again after each finish."""
    finished: asyncio.Queue[tuple[int, bool, Any]] = asyncio.Queue()
    tasks: list[asyncio.Task[Any]] = []

    def deliver(index: int, task: asyncio.Task[Any]) -> None:
        if task.cancelled():  # not by us (we cancel only on the way out): still an answer for its caller
            finished.put_nowait((index, False, EngineError("the generation request was cancelled in the engine")))
        elif task.exception() is not None:  # a BaseException `_one` does not catch: still this request's answer
            finished.put_nowait((index, False, task.exception()))
        else:
            finished.put_nowait(task.result())

    delivered = 0
    try:
        for start in range(0, len(requests), admit_slice):
            if start:
                await asyncio.sleep(0)
            for index in range(start, min(start + admit_slice, len(requests))):
                ids, sampling = requests[index]
                task = asyncio.ensure_future(_one(engine, index, ids, sampling))
                task.add_done_callback(functools.partial(deliver, index))
                tasks.append(task)
            if not finished.empty():  # what finished meanwhile goes out now
                ready = _drain(finished)
                delivered += len(ready)
                yield ready
        while delivered < len(requests):
            ready = [await finished.get(), *_drain(finished)]
            delivered += len(ready)
            yield ready
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


def _drain(queue: asyncio.Queue[Any]) -> list[Any]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def _one(engine: Any, index: int, prompt_ids: list[int], sampling: Any) -> tuple[int, bool, Any]:
    try:
        return index, True, await engine.generate(prompt_ids, sampling)
    except Exception as exc:  # sent back to that request's caller, not raised into the stream
        return index, False, exc
