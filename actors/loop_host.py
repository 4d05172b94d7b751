"""What the rollout-side actors share (not an actor itself): the queue as the loop's prompt source and sink, and
hosting a worker loop (`AsyncRolloutLoop` / `AsyncDistillationLoop`, both a `rlasync.rollout.scheduler`
`ScheduledLoop`) on the actor's event loop with health and metric draining.

`QueuePromptSource` hands the queue's `rlasync.records.PromptLease` to the loop with its dataset row and the seconds
waited filled in; the queue's "no lease right now" (timeout) is waited through, only `done` ends the loop's stream.
The sinks send samples to the queue (it `ray.put`s them and keeps the ObjectRefs + metadata) or drop a zero-std group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
import uuid
from typing import TYPE_CHECKING, Any

from actors.fanout import actor_id
from actors.group_payload import pack_group
from rlasync.data.prompts import leased_row_problem
from rlasync.metrics.process_cpu import ProcessCpu
from rlasync.pipeline import QueueEntry
from rlasync.records import DROP_REASONS, GroupOutcome, PromptLease

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

logger = logging.getLogger(__name__)
LEASE_POLL_S = 5.0
DROP_FLUSH_S = 0.05  # a finished group (kept or dropped) no lease carried within this long is sent by itself


class QueuePromptSource:
    """Leases groups of `group_size` rollouts from the queue actor; a lease whose work failed or was filtered is
    dropped there (retrying cannot help), a cancelled one (the loop is stopping) is released to be leased again.

    A finished group, kept (`keep`: its samples, packed) or dropped after its work (`drop`: zero reward spread, most
    groups of a nearly solved task), rides on the next `next_group` call, which its free slot makes at once: one
    queue call per group instead of two (the queue actor's process spends ~0.7 ms of CPU a call,
    `bench/queue_actor_load.py`). What no lease carried within `DROP_FLUSH_S` goes by itself (`hand_over`), and
    every group at once after the prompt stream ended, so none is held back from the queue's accounting (a composed
    step waits for its groups' outcomes)."""

    def __init__(self, actor: Any, group_size: int) -> None:
        self.actor = actor
        self.group_size = group_size
        # the queue releases this owner's leases if the actor dies; the token tells a restarted incarnation apart
        self.owner = f"{actor.kind} {actor.index}#{uuid.uuid4().hex[:8]}"
        self.leases: dict[int, PromptLease] = {}
        self.failures: dict[int, tuple[str, str]] = {}  # group id -> (cause, one-line detail) of a failed group
        self.warned_rows: set[int] = set()
        self.drops: list[tuple[int, str, int, str | None, str | None]] = []  # `drop`s no call has carried yet
        self.kept: list[tuple[list[Any], bytes | None]] = []  # `keep`s (put_group's arguments) no call has carried
        self.done = False  # the queue said the prompt stream ended: no lease follows, groups go at once
        self._flusher: asyncio.Task | None = None

    async def lease(self) -> PromptLease | None:
        self._raise_failed_flush()
        waited = 0.0
        while True:
            drops, kept = self._take_held()
            answer = await self.actor.queue.next_group.remote(self.group_size, LEASE_POLL_S, self.owner, drops, kept)
            waited += answer.waited_s
            if answer.lease is not None and not await self._usable(answer.lease):
                continue  # a bad row, dropped and counted: lease the next one
            if answer.lease is not None:
                break
            if answer.done:
                self.done = True
                await self.flush()
                return None
        lease = answer.lease
        self.actor.loop.update_policy_version(answer.policy_version)
        self.leases[lease.group_id] = lease
        return lease._replace(row=self._row(lease), waited_s=waited)

    def _row(self, lease: PromptLease) -> Any:
        """The lease's row: carried by the lease (a streaming dataset), else indexed."""
        return lease.row if lease.row else self.actor.dataset[lease.row_index]

    def report_failure(self, lease: PromptLease, cause: str, detail: str) -> None:
        """Why the group about to be released as "failed" failed: counted by cause at the queue (the watchdog)."""
        self.failures[lease.group_id] = (cause, detail)

    async def _usable(self, lease: PromptLease) -> bool:
        """Every row is checked as it is leased (rlasync.data.prompts.leased_row_problem): a bad one is dropped as
        "filtered" and named once in a warning, or, with `strict_dataset`, stops the loop."""
        problem = leased_row_problem(self._row(lease), lease.row_index)
        if problem is None:
            return True
        if self.actor.config.strict_dataset:
            raise ValueError(f"{problem} (strict_dataset=True stops the run at a bad row; False drops and counts it)")
        if lease.row_index not in self.warned_rows:
            self.warned_rows.add(lease.row_index)
            logger.warning("dropping dataset row %d (counted as filtered): %s", lease.row_index, problem)
        await self.actor.queue.drop_group.remote(lease.group_id, str(GroupOutcome.FILTERED), 0)
        return False

    async def drop(
        self, group_id: int, reason: str, num_tokens: int = 0, cause: str | None = None, detail: str | None = None
    ) -> None:
        """Drop a leased group at the queue: with the next lease's call (class docstring), at once when none
        follows. A failed send of an earlier batch is raised here."""
        self._raise_failed_flush()
        drop = (group_id, reason, num_tokens, cause, detail)
        if self.done:
            await self.actor.queue.drop_group.remote(*drop)
            return
        self.drops.append(drop)
        self._flush_soon()

    async def keep(self, entries: list[Any], packed: bytes | None) -> None:
        """Queue a kept group (`put_group`'s arguments, `actors.group_payload.pack_group`): with the next lease's
        call (class docstring), at once when none follows. A failed send of an earlier batch is raised here."""
        self._raise_failed_flush()
        if self.done:
            await self.actor.queue.put_group.remote(entries, packed)
            return
        self.kept.append((entries, packed))
        self._flush_soon()

    def _flush_soon(self) -> None:
        if self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(DROP_FLUSH_S)
        await self.flush()

    async def flush(self) -> None:
        """Send the finished groups no lease has carried (one call)."""
        drops, kept = self._take_held()
        if drops or kept:
            await self.actor.queue.hand_over.remote(drops, kept)

    def _take_held(self) -> tuple[list[Any], list[Any]]:
        """The drops and kept groups no call has carried yet, handed to the caller's call."""
        (drops, self.drops), (kept, self.kept) = (self.drops, []), (self.kept, [])
        return drops, kept

    def _raise_failed_flush(self) -> None:
        flusher = self._flusher
        if flusher is None or not flusher.done():
            return
        self._flusher = None
        if not flusher.cancelled() and flusher.exception() is not None:
            raise RuntimeError(f"handing groups to the queue failed: {flusher.exception()!r}") from flusher.exception()

    async def release(self, lease: PromptLease, reason: GroupOutcome) -> None:
        queue_lease = self.leases.pop(lease.group_id, None)
        cause, detail = self.failures.pop(lease.group_id, (None, None))
        if queue_lease is None:  # its samples already reached the queue (the sink took the lease): nothing to undo
            return
        if reason in DROP_REASONS:  # "filtered", or "failed": the engine rejected the prompt; retrying cannot help
            await self.actor.queue.drop_group.remote(lease.group_id, str(reason), 0, cause, detail)
        else:  # "cancelled" (the loop is stopping): the prompt is leased again
            await self.actor.queue.release.remote(queue_lease)

    def taken(self, group_id: int) -> None:
        """The group reached the sink: its lease is the queue's business from now on."""
        self.leases.pop(group_id, None)


class QueueGroupSink:
    """The GRPO loop's sink: a `GroupResult`'s samples go to the queue (by value: the queue owns them), a zero-std group is dropped."""

    def __init__(self, queue: Any, source: QueuePromptSource) -> None:
        self.queue = queue
        self.source = source

    async def put(self, result: Any) -> None:
        self.source.taken(result.group_id)
        if result.dropped:  # with the next lease's call (QueuePromptSource.drop)
            scored = result.scored
            await self.source.drop(
                result.group_id,
                str(GroupOutcome.ZERO_STD),
                result.num_rollout_tokens,
                scored.drop_cause,
                scored.drop_detail(),
            )
            return
        # by value (packed): the queue actor ray.puts them, so it owns them and they outlive this actor; with the
        # next lease's call (QueuePromptSource.keep)
        await self.source.keep(*pack_group(result.scored.samples))


class QueueSampleSink:
    """The distillation loop's sink: one `DistillationSample` (its group is its prompt) to the queue."""

    def __init__(self, queue: Any, source: QueuePromptSource) -> None:
        self.queue = queue
        self.source = source

    async def put(self, sample: Any) -> None:
        self.source.taken(sample.prompt_id)
        await self.queue.put_group.remote([QueueEntry.for_sample(sample, payload=sample)])


class FromQueue:
    """The `dataset` of a rollout actor's constructor that says: fetch the rows the queue actor holds
    (`QueueActor.hold_dataset`), rather than take an object ref (which makes Ray log an error at every start of a
    restartable actor)."""

    def __repr__(self) -> str:
        return "FROM_QUEUE"


FROM_QUEUE = FromQueue()


class LoopHost:
    """Mixed into a Ray actor whose `__init__` calls `_host(...)` and sets `self.loop` (with `self.items.extend` as
    its metrics callback): `start`, `health`, `drain_metrics`, `drain_completions`, `evaluate`, `stop`; for elastic pools `set_engines`,
    `engine_report` and `owner` (docs/design.md §4)."""

    loop: Any
    index: int
    config: TrainerConfig
    dataset: Any
    queue: Any
    items: list[tuple[str, Any]]
    task: asyncio.Task | None = None
    error: str | None = None
    kind = "rollout actor"

    def _host(
        self, index: int, config: TrainerConfig, tokenizer: Any, dataset: Any, queue: Any, group_size: int
    ) -> Any:
        """The state every host keeps (call first in `__init__`): sets `self.source` (the queue's leases of
        `group_size`) and returns the tokenizer, loaded if given as a path. `queue` may be given by name (`Named`),
        `dataset` as `FROM_QUEUE`: the rows the queue actor holds."""
        logging.basicConfig(level=logging.INFO)
        from actors.fanout import resolve_named

        queue = resolve_named(queue)
        # FROM_QUEUE (a copy after crossing Ray): fetched by `start()`, awaited (a blocking `ray.get` here, in an async
        # actor's constructor, would make Ray warn that it blocks the event loop)
        self.index, self.config, self.dataset, self.queue = index, config, dataset, queue
        self.items = []
        self.cpu = ProcessCpu()  # how busy this process is between two drains (near 1.0: bound by its GIL)
        self.source = QueuePromptSource(self, group_size)
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        return tokenizer

    async def start(self) -> None:
        if isinstance(self.dataset, FromQueue):  # the rows the queue actor holds, once per incarnation
            [ref] = await self.queue.dataset.remote()
            self.dataset = await ref
        if self.task is None:  # two starts at once (a step's and a health check's `ensure_running`): one loop
            self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            try:
                await self.loop.run()
            except BaseException:
                with contextlib.suppress(Exception):  # best effort: the loop's own error is the one to report
                    await self.source.flush()
                raise
            await self.source.flush()  # the groups finished since the last lease
        except BaseException as exc:  # kept for health(): the driver raises it with its message
            cause = exc
            while cause.__cause__ is not None and isinstance(cause, RuntimeError):
                cause = cause.__cause__
            self.error = f"{type(cause).__name__}: {cause}"
            logger.error("%s %d failed:\n%s", self.kind, self.index, traceback.format_exc())

    def health(self) -> dict[str, Any]:
        """`error` (a message) when the loop failed; else the heartbeat's age and whether the loop runs (the loop's
        settings give the heartbeat limit); plus the loop's `health_report()` for the watchdog (`num_inflight`,
        `oldest_request`, `oldest_tool_call`, `last_failure`)."""
        if self.error is None:
            try:
                self.loop.check_health()
            except RuntimeError as exc:
                self.error = str(exc)
        report = getattr(self.loop, "health_report", None)  # tasks in flight, the oldest request and tool call
        return {
            "error": self.error,
            "running": self.loop.is_running,
            "heartbeat_age_s": time.time() - self.loop.heartbeat,
            **(report() if callable(report) else {}),
        }

    def set_engines(self, handles: list[Any], labels: list[str]) -> None:
        """Make the loop's engine pool exactly these GenerationActors: new ones join (each in an `EngineChannel`),
        missing ones get no new request while their requests in flight finish (`engine_report` counts them)."""
        from actors.engine_channel import EngineChannel

        pool = self.loop.engine_pool
        known = {actor_id(channel): channel for channel in pool.engines}
        wanted = {actor_id(handle) for handle in handles}
        added = [
            EngineChannel(h, label, counts_preemptions=self.index == 0)  # one rollout actor counts them
            for h, label in zip(handles, labels, strict=True)
            if actor_id(h) not in known
        ]
        pool.add_engines(added)
        removed = [channel for key, channel in known.items() if key not in wanted]
        pool.remove_engines(removed)
        self.channels = {**getattr(self, "channels", {}), **known, **{actor_id(c): c for c in added}}
        if added or removed:
            logger.info(
                "%s %d: engines %s joined, %s left",
                self.kind,
                self.index,
                [c.name for c in added],
                [c.name for c in removed],
            )

    def place_engines(self, member: int | None, members: int = 1) -> None:
        """This actor as rollout actor `member` of `members`: its loop sends to its home engines
        (`EnginePool.place`; None: to every engine). Set at start and again when the rollout pool is resized."""
        pool = getattr(self.loop, "engine_pool", None)
        if pool is not None:
            pool.place(member if member is None or member < members else None, members)

    def engine_report(self, ids: list[str]) -> dict[str, tuple[int, int]]:
        """`{actor id: (requests answered, requests in flight)}` of these engines in this loop's pool (also of
        engines removed from it)."""
        pool, channels = self.loop.engine_pool, getattr(self, "channels", {})
        channels = {**channels, **{actor_id(c): c for c in pool.engines}}
        return {key: (pool.served(channels[key]), pool.inflight_on(channels[key])) for key in ids if key in channels}

    def owner(self) -> str:
        """The owner name the queue holds this actor's leases under (`release_owner`)."""
        return self.source.owner

    async def evaluate(self, dataset: Any, indices: list[int], num_generations: int, policy_version: int) -> Any:
        """Evaluate the rows `indices` of the held-out `dataset` with this loop's policy, next to its training
        rollouts (rlasync.rollout.evaluation: the same engines and reward path); returns an `EvalTally`."""
        from rlasync.rollout.evaluation import evaluate_rows, indexed_rows

        if not callable(getattr(self.loop, "reward_group", None)):
            raise TypeError(f"{type(self.loop).__name__} cannot evaluate: eval_dataset needs a GRPO rollout loop")
        return await evaluate_rows(
            self.loop, indexed_rows(dataset, indices), num_generations=num_generations, policy_version=policy_version
        )

    def drain_completions(self) -> list[Any]:
        """`log_completions`: the sample of completions scored since the last drain (`CompletionRow`s; none when
        the loop keeps no sample)."""
        samples = getattr(self.loop, "completion_samples", None)
        return samples.drain() if samples is not None else []

    def drain_metrics(self) -> list[tuple[str, Any]]:
        """The loop's metric items since the last drain, folded per key where that changes no window
        (`compress_items`: thousands a step late in a GRPO run, most from dropped groups), and
        `rollout/actor_cpu_frac_max`: this process's CPU seconds per second since then (over the rollout actors, the
        busiest one's)."""
        from rlasync.metrics.reduce import compress_items

        items, self.items[:] = list(self.items), []
        return [*compress_items(items), ("rollout/actor_cpu_frac_max", self.cpu.take())]

    async def stop(self) -> None:
        await self.loop.stop()
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)
