"""`EngineChannel`: a GenerationActor handle as the rollout loop's engine, many requests per actor call, every
result back through one long-lived stream.

    loop ──generate(ids, sampling)──► EngineChannel ──submit(channel, [(rid, ids, sampling), ...]) (one Ray call per
    event-loop turn)──► GenerationActor (`ChannelHost`) ──results(channel): one streaming call for the channel's
    life, yielding [(rid, ok, TurnRecord | exception), ...] as requests finish──► futures resolved

A rollout actor makes one generation request per rollout turn, often thousands a second across the rollout actors.
One Ray actor call each costs the caller a task submission and the generation actor a task execution competing with
its engine's host side for the interpreter, so the channel gathers the requests made within one turn of the event
loop (up to `max_batch`) into one call. Their results come back through the channel's one stream: the requests that
finish in one engine step are one yield for this rollout actor, whichever calls they came in. (A streaming call per
batch, as before, yielded per batch: requests of different lengths finish spread over the batches they came in, so
a step cost about a yield per finished request, and each call and yield is Ray's work in the generation actor's
process: ~1.1 ms of its CPU per request against 0.13 ms when a batch finished together,
`bench/results/channel_overhead_cpu.json`.)

A request's failure comes back as its own exception (a rejected request stays `RequestRejectedError`, not
retried). The stream failing (the actor died or is unreachable) fails every unanswered request of the channel with
`EngineError` naming the actor, which `EnginePool` retries with backoff on another engine or on the one Ray
restarted (docs/design.md §4); the next request opens a new stream (a new channel id: a restarted actor knows no
channel). A submission that fails fails its own requests the same way; any other failure of a call propagates as it
is. The core never sees Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import uuid
from collections.abc import Sequence
from typing import Any

import ray

from actors.fanout import actor_id
from rlasync.engine.base import EngineError

DEFAULT_MAX_BATCH = 256


class EngineChannel:
    """`generate(prompt_ids, sampling)` -> an awaitable TurnRecord, through `handle.submit` and the channel's stream
    `handle.results`; `stats()` passes through. `calls` / `requests` count submissions and the requests they carried,
    `streams` the result streams opened (one, unless a stream failed).

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
        self.streams = 0
        self._pending: list[tuple[list[int], Any, asyncio.Future[Any]]] = []
        self._unanswered: dict[int, asyncio.Future[Any]] = {}  # request id -> its caller's future
        self._next_id = 0
        self._channel_id: str | None = None  # the open stream's channel (None: open one at the next flush)
        self._collector: asyncio.Task[None] | None = None  # reads that stream (done: its event loop closed, or failed)
        self._tasks: set[asyncio.Task[None]] = set()

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
        if not batch:
            return
        if self._channel_id is None or self._collector is None or self._collector.done():
            try:
                self._open()
            except EngineError as exc:  # the actor is gone: these requests fail retryably
                _fail([future for _, _, future in batch], exc)
                return
        for begin in range(0, len(batch), self.max_batch):
            requests, ids = [], []
            for prompt_ids, sampling, future in batch[begin : begin + self.max_batch]:
                request_id, self._next_id = self._next_id, self._next_id + 1
                self._unanswered[request_id] = future
                requests.append((request_id, prompt_ids, sampling))
                ids.append(request_id)
            try:
                ref = self.handle.submit.remote(self._channel_id, requests)
            except ray.exceptions.RayActorError as exc:  # the handle cannot submit (actor gone)
                self._fail_ids(ids, self._lost(exc))
                continue
            self.calls += 1
            self.requests += len(requests)
            self._track(self._submitted(ref, ids))

    def _open(self) -> None:
        """Open a result stream under a new channel id."""
        self._channel_id = channel_id = uuid.uuid4().hex
        self.streams += 1
        try:
            stream = self.handle.results.options(num_returns="streaming").remote(channel_id)
        except ray.exceptions.RayActorError as exc:  # the submissions fail the same way, each its own requests
            self._channel_id = None
            raise self._lost(exc) from exc
        self._collector = self._track(self._collect(stream, channel_id))

    def _track(self, coroutine: Any) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _submitted(self, ref: Any, ids: list[int]) -> None:
        """A submission's own failure fails its requests (the stream answers the rest)."""
        try:
            await ref
        except ray.exceptions.RayActorError as exc:
            self._fail_ids(ids, self._lost(exc))
        except Exception as exc:  # a task error of the call itself: not retried
            self._fail_ids(ids, exc)

    async def _collect(self, stream: Any, channel_id: str) -> None:
        try:
            async for ref in stream:
                for request_id, ok, value in await ref:
                    future = self._unanswered.pop(request_id, None)
                    if future is not None and not future.done():
                        future.set_result(value) if ok else future.set_exception(value)
        except ray.exceptions.RayActorError as exc:  # ActorDiedError / ActorUnavailableError: the engine died
            error: BaseException = self._lost(exc)
        except Exception as exc:  # the stream broke otherwise (a task error of the call itself): not retried
            error = exc
        else:
            error = EngineError(f"{self.name} closed a generation stream with requests unanswered")
        if self._channel_id == channel_id:  # the next request opens a new stream
            self._channel_id = None
        self._fail_ids(list(self._unanswered), error)

    def _fail_ids(self, ids: Sequence[int], error: BaseException) -> None:
        _fail([f for f in (self._unanswered.pop(i, None) for i in ids) if f is not None], error)

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


class ChannelHost:
    """The generation actor's side: `submit(channel_id, requests)` starts `(request_id, prompt_ids, sampling)`
    requests on `engine`; `results(channel_id)` (an async generator: the channel's stream) yields, as they finish,
    lists of `(request_id, ok, TurnRecord or the exception)` of that channel's requests, each once. The stream
    closing (the caller went away) cancels the channel's requests still running; a submission that arrives for a
    closed channel starts nothing (its caller has failed those requests already). Either call may arrive first.

    Requests start `admit_slice` at a time, with a turn of the event loop between slices: starting one runs its
    engine's synchronous admission (vLLM's input processing), so a batch of hundreds started at once would hold
    the loop for all of them, and a weight sync arriving meanwhile would wait. Finished requests are collected
    through a queue (each result once), not by waiting on every pending one again after each finish."""

    def __init__(self, engine: Any, admit_slice: int = ADMIT_SLICE) -> None:
        self.engine = engine
        self.admit_slice = admit_slice
        self._channels: dict[str, _Channel] = {}

    def _channel(self, channel_id: str) -> _Channel:
        channel = self._channels.get(channel_id)
        if channel is None:
            channel = self._channels[channel_id] = _Channel()
        return channel

    async def submit(self, channel_id: str, requests: Sequence[tuple[int, list[int], Any]]) -> None:
        channel = self._channel(channel_id)
        for start in range(0, len(requests), self.admit_slice):
            if start:
                await asyncio.sleep(0)
            if channel.closed:  # the caller left: nothing more starts
                return
            for request_id, prompt_ids, sampling in requests[start : start + self.admit_slice]:
                task = asyncio.ensure_future(_one(self.engine, request_id, prompt_ids, sampling))
                channel.tasks.add(task)
                task.add_done_callback(functools.partial(channel.deliver, request_id))

    async def results(self, channel_id: str) -> Any:
        channel = self._channel(channel_id)
        try:
            while True:
                yield [await channel.finished.get(), *_drain(channel.finished)]
        finally:
            channel.close()  # stays as a closed entry: a late submission for it starts nothing

    @property
    def open_channels(self) -> int:
        return sum(not channel.closed for channel in self._channels.values())


class _Channel:
    def __init__(self) -> None:
        self.finished: asyncio.Queue[tuple[int, bool, Any]] = asyncio.Queue()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.closed = False

    def deliver(self, request_id: int, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if self.closed:
            return
        if task.cancelled():  # not by us (we cancel only on close): still an answer for its caller
            self.finished.put_nowait(
                (request_id, False, EngineError("the generation request was cancelled in the engine"))
            )
        elif task.exception() is not None:  # a BaseException `_one` does not catch: still this request's answer
            self.finished.put_nowait((request_id, False, task.exception()))
        else:
            self.finished.put_nowait(task.result())

    def close(self) -> None:
        self.closed = True
        for task in list(self.tasks):
            task.cancel()
        self.tasks.clear()
        self.finished = asyncio.Queue()  # what was not sent is dropped


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
