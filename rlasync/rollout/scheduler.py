"""`TaskScheduler`: lease → admit → run N tasks → collect → hand over, for any rollout policy.

    Admission.acquire(N) ──► PromptSource.lease() ──► policy.admit ──► N × policy.run_task ──► policy.collect
           ▲                        │ None: exhausted      │ None: filtered     (one per slot)     (score / build)
           │                        ▼                      ▼                                          │
           └── cancel_group ◄── release(lease, outcome) ◄── failed / filtered / cancelled      sink.put(item)
                                                                                  Admission.finish_group(N, tokens, queued)

GRPO runs N = `num_generations` tasks per lease (one rollout each), distillation N = 1 (one sample). One scheduler
runs on one event loop (a rollout actor, or a test with fakes). It wakes when a task finishes, when `stop()` is
called or every `heartbeat_interval_s`; each pass writes the heartbeat, handles what finished, polls the engine
pool's stats and dispatches:

| step              | runs when                                                      | blocks                         |
|-------------------|----------------------------------------------------------------|--------------------------------|
| start a group     | a slot is free and no group has undispatched tasks             | only its own task (admission,  |
|                   |                                                                | lease, `admit`)                |
| dispatch a task   | in flight < min(max_concurrent, engine pool cap) and fewer     | nothing                        |
|                   | than `max_pending_groups` groups being collected or handed over|                                |
| collect + hand over | the group's N tasks are done                                 | its own task                   |

A group's tasks share the policy version read when its first task is dispatched. A task (or the group's `collect`) failing with an
error the policy calls a group failure (a rejected request, a reward function past its timeout) fails its group:
its other tasks are cancelled, the lease is released as "failed" and counted (`counters["groups_failed"]`, the
policy's `failure_metric`, the policy's `failure_cause` and a one-line message to the prompt source's optional
`report_failure`), with one warning per row and cause. Any other error
stops the scheduler: `run()` re-raises it and `check_health()` raises `RuntimeError` chained to it. `stop()`
cancels every task, releases the leases of unfinished groups as "cancelled" and returns once `run()` has ended.
A policy whose `hand_over_holds_slots` is true counts groups being handed over as in flight (a blocked sink then
holds generation back: distillation).

Collaborators are the protocols of `rlasync.rollout.protocols`; any of their methods may be sync or return an
awaitable (Ray ObjectRefs are).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rlasync.records import GroupOutcome, PromptLease
from rlasync.rollout.engine_pool import EnginePool, resolve
from rlasync.rollout.protocols import Admission, OpenAdmission, PromptSource, Sink, TaskPolicy

logger = logging.getLogger(__name__)
G = TypeVar("G")


@dataclass(eq=False)
class _Group(Generic[G]):
    """A leased prompt on its way to the sink."""

    lease: PromptLease
    state: G
    size: int
    results: list[Any]
    policy_version: int = -1
    num_dispatched: int = 0
    num_done: int = 0
    failed: bool = False
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)


class TaskScheduler(Generic[G]):
    """Runs a `TaskPolicy` over leases until stopped or out of prompts (see the module docstring).

    group_size / max_concurrent: tasks per lease / in flight at most (`RolloutSettings`); `engine_pool` (optional)
    is polled for stats each pass and its `cap` lowers the concurrency limit; `heartbeat_timeout_s` is
    `check_health`'s default.
    """

    loop_name = "worker loop"

    def __init__(
        self,
        policy: TaskPolicy[G],
        *,
        prompt_source: PromptSource,
        sink: Sink,
        group_size: int,
        max_concurrent: int,
        admission: Admission | None = None,
        engine_pool: EnginePool | None = None,
        heartbeat_timeout_s: float | None = None,
        heartbeat_interval_s: float = 0.5,
        max_pending_groups: int = 16,
        policy_version: int = 0,
        loop_name: str | None = None,
        counters: collections.Counter[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self.prompt_source, self.sink = prompt_source, sink
        self.admission: Admission = admission if admission is not None else OpenAdmission()
        self.engine_pool = engine_pool
        self.group_size, self.max_concurrent = group_size, max_concurrent
        self.heartbeat_timeout_s, self.heartbeat_interval_s = heartbeat_timeout_s, heartbeat_interval_s
        self.max_pending_groups = max_pending_groups
        self.policy_version = int(policy_version)
        self.loop_name = loop_name or self.loop_name
        self.counters = counters if counters is not None else collections.Counter()
        self._clock, self._wall_clock = clock, wall_clock
        self.heartbeat = wall_clock()
        self._done: collections.deque[asyncio.Task[Any]] = collections.deque()
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._stop_requested = self._running = self._exhausted = False
        self._failure: BaseException | None = None
        self._groups: set[_Group[G]] = set()  # leased and not yet handed over or released
        self._dispatching: _Group[G] | None = None
        self._starter: asyncio.Task[_Group[G] | None] | None = None
        self._tasks: dict[asyncio.Task[Any], tuple[_Group[G], int]] = {}
        self._hand_overs: dict[asyncio.Task[Any], _Group[G]] = {}
        self._warned: set[tuple[int, str]] = set()  # (row, cause) already warned about
        self.last_failure: str | None = None

    # ---- control ------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until `stop()`, until the prompts are exhausted and every group is done, or a failure (re-raised
        here and by `check_health`). The policy's `setup()` runs first, `close()` and `after_close()` last."""
        if self._running:
            raise RuntimeError(f"the {self.loop_name} is already running")
        self._running = True
        self._stopped.clear()
        try:
            await self.policy.setup()
            try:
                await self._loop()
            finally:
                await self._cancel_everything()
                try:
                    await self.policy.close()
                finally:
                    self.policy.after_close()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._failure = exc
            logger.error("%s failed: %s: %s", self.loop_name, type(exc).__name__, exc)
            raise
        finally:
            self._running = False
            self._stopped.set()

    async def stop(self) -> None:
        """Cancel and await in-flight work, release unfinished leases ("cancelled"); returns when `run()` has
        ended. A stopped scheduler stays stopped."""
        self._stop_requested = True
        self._wake.set()
        if self._running:
            await self._stopped.wait()

    def check_health(self, stale_after_s: float | None = None) -> None:
        """Raise `RuntimeError` if the scheduler failed (chained to the error) or, while running, its heartbeat is
        older than `stale_after_s` (default `heartbeat_timeout_s`)."""
        if self._failure is not None:
            raise RuntimeError(
                f"the {self.loop_name} failed: {type(self._failure).__name__}: {self._failure}"
            ) from self._failure
        stale_after_s = self.heartbeat_timeout_s if stale_after_s is None else stale_after_s
        if self._running and stale_after_s is not None:
            age = self._wall_clock() - self.heartbeat
            if age > stale_after_s:
                raise RuntimeError(
                    f"the {self.loop_name}'s heartbeat is {age:.0f} s old (> {stale_after_s} s): the loop is hung"
                )

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def num_inflight(self) -> int:
        """Tasks in flight (with `hand_over_holds_slots`: groups being handed over count too)."""
        held = len(self._hand_overs) if self.policy.hand_over_holds_slots else 0
        return len(self._tasks) + held

    @property
    def concurrency_limit(self) -> int:
        cap = self.engine_pool.cap if self.engine_pool is not None else None
        return self.max_concurrent if cap is None else min(self.max_concurrent, cap)

    # ---- the loop -----------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            self.heartbeat = self._wall_clock()
            await self._handle_finished()
            if self._stop_requested:
                return
            if self.engine_pool is not None:
                await self.engine_pool.observe(self.counters["tasks_completed"])
            self._dispatch()
            if self._exhausted and not (self._tasks or self._hand_overs or self._starter):
                return
            await self._wait_for_news()

    async def _wait_for_news(self) -> None:
        """Until a task finishes, `stop()` is called, or the heartbeat interval passes."""
        if not self._wake.is_set():
            try:
                async with asyncio.timeout(self.heartbeat_interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
        self._wake.clear()

    def _spawn(self, coroutine: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coroutine)
        task.add_done_callback(self._on_task_done)
        return task

    def _on_task_done(self, task: asyncio.Task[Any]) -> None:
        self._done.append(task)
        self._wake.set()

    def _dispatch(self) -> None:
        """Start tasks while slots are free; start the next group when the current one is dispatched."""
        while not self._stop_requested:
            if len(self._hand_overs) >= self.max_pending_groups or self.num_inflight >= self.concurrency_limit:
                return
            group = self._dispatching
            if group is not None and not group.failed and group.num_dispatched < group.size:
                self._dispatch_task(group)
                continue
            self._dispatching = None
            if self._starter is None and not self._exhausted:
                self._starter = self._spawn(self._start_group())
            return

    def _dispatch_task(self, group: _Group[G]) -> None:
        if group.num_dispatched == 0:
            group.policy_version = self.policy_version
        index = group.num_dispatched
        group.num_dispatched += 1
        task = self._spawn(self.policy.run_task(group.state, index, group.policy_version))
        self._tasks[task] = (group, index)
        group.tasks.add(task)

    async def _start_group(self) -> _Group[G] | None:
        """Admission, then the next lease the policy admits; None when the prompt source is exhausted."""
        size = self.group_size
        admitted = await resolve(self.admission.acquire(size))
        waited_s = float(getattr(admitted, "waited_s", admitted))
        lease = None
        try:
            while True:
                lease = await resolve(self.prompt_source.lease())
                if lease is None:
                    await resolve(self.admission.cancel_group(size))
                    return None
                lease = PromptLease.coerce(lease)
                waited_s += lease.waited_s
                state = await self.policy.admit(lease, waited_s)
                if state is None:
                    filtered, lease = lease, None
                    await resolve(self.prompt_source.release(filtered, GroupOutcome.FILTERED))
                    self.counters["prompts_filtered"] += 1
                    self.policy.emit([("rollout/filtered_prompt_count", 1.0)])
                    continue
                group = _Group(lease, state, size, [None] * size)
                self._groups.add(group)
                return group
        except BaseException:
            if lease is not None:
                await self._release_quietly(lease, GroupOutcome.CANCELLED)
            await self._cancel_admission_quietly(size)
            raise

    # ---- finished tasks -----------------------------------------------------------------------------------

    async def _handle_finished(self) -> None:
        while self._done:
            task = self._done.popleft()
            if task is self._starter:
                self._starter = None
                group = task.result()  # an error here stops the loop
                if group is None:
                    self._exhausted = True
                else:
                    self._dispatching = group
            elif task in self._tasks:
                await self._on_task_done_handled(task)
            elif task in self._hand_overs:
                del self._hand_overs[task]
                task.result()  # an error while collecting or handing over stops the loop

    async def _on_task_done_handled(self, task: asyncio.Task[Any]) -> None:
        group, index = self._tasks.pop(task)
        group.tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            if not self.policy.is_group_failure(error):
                raise error
            if not group.failed:
                await self._fail_group(group, error)
            return
        if group.failed:
            return
        group.results[index] = task.result()
        group.num_done += 1
        self.counters["tasks_completed"] += 1
        self.policy.record(group.state, index, group.results[index])
        if group.num_done == group.size:
            self._hand_overs[self._spawn(self._hand_over(group))] = group

    async def _fail_group(self, group: _Group[G], error: BaseException) -> None:
        """Drop the group for good ("failed", consumed: never leased again in this epoch) with one warning per row
        and cause (no traceback: a remote error's is cut off), and the cause and message to the prompt source."""
        group.failed = True
        for task in group.tasks:
            task.cancel()
        self._groups.discard(group)
        lease = group.lease
        classify = getattr(self.policy, "failure_cause", None)
        cause = classify(error) if classify is not None else "error"
        detail = f"row {lease.row_index}: {short_error(error)}"
        self.last_failure = detail
        warned = (lease.row_index, cause)
        log = logger.debug if warned in self._warned else logger.warning
        self._warned.add(warned)
        log("group %d failed and is dropped (%s): %s", lease.group_id, cause, detail)
        self.counters["groups_failed"] += 1
        self.policy.emit([(self.policy.failure_metric, 1.0)])
        report = getattr(self.prompt_source, "report_failure", None)
        if report is not None:
            await resolve(report(lease, cause, detail))
        await resolve(self.prompt_source.release(lease, GroupOutcome.FAILED))
        await resolve(self.admission.cancel_group(group.size))

    async def _hand_over(self, group: _Group[G]) -> None:
        try:
            collected = await self.policy.collect(group.state, group.results, group.policy_version)
        except Exception as error:  # e.g. a reward function that timed out: only its group fails
            if not self.policy.is_group_failure(error):
                raise
            await self._fail_group(group, error)
            return
        put_started = self._clock()
        await resolve(self.sink.put(collected.item))
        put_s = self._clock() - put_started
        self._groups.discard(group)
        self.counters["groups_handed_over"] += 1
        await resolve(self.admission.finish_group(group.size, collected.num_tokens, queued=collected.queued))
        self.policy.handed_over(group.state, collected, put_s, self.num_inflight)

    # ---- stopping -----------------------------------------------------------------------------------------

    async def _release_quietly(self, lease: PromptLease, reason: GroupOutcome) -> None:
        """Best-effort release while stopping: a failure is logged, not raised over the original error."""
        try:
            await resolve(self.prompt_source.release(lease, reason))
        except Exception as exc:
            logger.warning("could not release group %d (%s): %s", lease.group_id, reason, exc)

    async def _cancel_admission_quietly(self, num_rollouts: int) -> None:
        try:
            await resolve(self.admission.cancel_group(num_rollouts))
        except Exception as exc:
            logger.warning("admission.cancel_group failed while stopping: %s", exc)

    async def _cancel_everything(self) -> None:
        """Cancel and await every task; release the leases of unfinished groups as "cancelled"."""
        tasks = [*self._tasks, *self._hand_overs, *([self._starter] if self._starter else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for group in list(self._groups):
            await self._release_quietly(group.lease, GroupOutcome.CANCELLED)
            await self._cancel_admission_quietly(group.size)
        self._groups.clear()
        self._tasks.clear()
        self._hand_overs.clear()
        self._starter = None
        self._dispatching = None
        self._done.clear()


def short_error(error: BaseException, limit: int = 300) -> str:
    """`Type: message` of `error` on one line: a remote (Ray) error is unwrapped to its cause and its traceback
    dropped, so a log line or a watchdog reason stays one line."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        error = cause
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[-1] if lines and "Traceback" in str(error) else (lines[0] if lines else "")
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["TaskScheduler", "short_error"]
