"""The asyncio plumbing every worker loop shares (the GRPO rollout loop and the distillation loop).

A worker loop runs tasks on one event loop: it wakes when a task finishes, when `stop()` is called or every
`heartbeat_interval_s`, handles what finished, starts what it may, and records a heartbeat each pass. A failure is
kept and re-raised by `check_health()` (the actor's health probe); `stop()` cancels what is in flight and returns once
`run()` has ended. Subclasses provide `_loop()` (one pass per wake-up), `_cancel_everything()`, the `setup()`/`close()`
hooks and `_after_close()` for their own resources.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rlasync.metrics import MetricValue

logger = logging.getLogger(__name__)
R = TypeVar("R")
RETRY_METRIC = "rollout/vllm_retry_count"


class TaskLoopBase:
    """`run` / `stop` / `check_health` and the wake-up machinery of a worker loop (see the module docstring)."""

    heartbeat_interval_s: float = 0.5
    retryable_exceptions: tuple[type[BaseException], ...] = ()
    loop_name = "worker loop"  # in errors and logs: "the <loop_name> failed", "the <loop_name>'s heartbeat ..."

    args: Any
    counters: collections.Counter[str]
    _sleep: Callable[[float], Awaitable[Any]]
    _metrics_callback: Callable[[list[tuple[str, MetricValue]]], Any]

    def _init_task_loop(self, wall_clock: Callable[[], float]) -> None:
        self._wall_clock = wall_clock
        self.heartbeat = wall_clock()
        self._done: collections.deque[asyncio.Task[Any]] = collections.deque()
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._stop_requested = False
        self._running = False
        self._failure: BaseException | None = None

    # ---- hooks --------------------------------------------------------------------------------------------

    async def setup(self) -> None:
        """Create resources on the loop's event loop (called by `run()` before anything else)."""

    async def close(self) -> None:
        """Release what `setup` created (called by `run()` on the way out, also after an error)."""

    def _after_close(self) -> None:
        """Release the loop's own resources after `close()` (also when it raised)."""

    async def _loop(self) -> None:
        raise NotImplementedError

    async def _cancel_everything(self) -> None:
        raise NotImplementedError

    # ---- control ------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until `stop()`, until the work is exhausted and every task is done, or a failure (re-raised here and
        by `check_health`)."""
        if self._running:
            raise RuntimeError(f"{type(self).__name__}.run() is already running")
        self._running = True
        self._stopped.clear()
        try:
            await self.setup()
            try:
                await self._loop()
            finally:
                await self._cancel_everything()
                try:
                    await self.close()
                finally:
                    self._after_close()
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
        """Stop: cancel and await in-flight work, release unfinished leases ("cancelled"); returns when `run()` has
        ended. A stopped loop stays stopped."""
        self._stop_requested = True
        self._wake.set()
        if self._running:
            await self._stopped.wait()

    def check_health(self, stale_after_s: float | None = None) -> None:
        """Raise `RuntimeError` if the loop failed (chained to the error) or, while running, its heartbeat is older
        than `stale_after_s` (default `args.rollout_worker_timeout`)."""
        if self._failure is not None:
            raise RuntimeError(
                f"the {self.loop_name} failed: {type(self._failure).__name__}: {self._failure}"
            ) from self._failure
        if stale_after_s is None:
            stale_after_s = getattr(self.args, "rollout_worker_timeout", None)
        if self._running and stale_after_s is not None:
            age = self._wall_clock() - self.heartbeat
            if age > stale_after_s:
                raise RuntimeError(
                    f"the {self.loop_name}'s heartbeat is {age:.0f} s old (> {stale_after_s} s): the loop is hung"
                )

    @property
    def is_running(self) -> bool:
        return self._running

    # ---- wake-ups and tasks -------------------------------------------------------------------------------

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

    def _emit(self, items: list[tuple[str, MetricValue]]) -> None:
        if items:
            self._metrics_callback(items)

    async def _retrying(self, what: str, call: Callable[[], Awaitable[R]], max_attempts: int) -> R:
        """`call()` with `retryable_exceptions` retried up to `max_attempts` tries with `retry_backoff_s` (SPEC §2.5);
        each retry is logged, counted in `counters["<first word of what>_retries"]` and as `rollout/vllm_retry_count`.
        Other errors (a rejected request) and the last failure propagate."""
        attempt = 0
        while True:
            try:
                return await call()
            except self.retryable_exceptions as exc:
                if attempt + 1 >= max_attempts:
                    raise
                delay = retry_backoff_s(attempt)
                logger.warning(
                    "%s request failed (%s: %s); retry %d in %.0f s", what, type(exc).__name__, exc, attempt + 1, delay
                )
                self.counters[f"{what.split()[0]}_retries"] += 1
                self._emit([(RETRY_METRIC, 1.0)])
                attempt += 1
                await self._sleep(delay)


def retry_backoff_s(attempt: int) -> float:
    """Seconds to wait before retry number `attempt` (0-based): 1, 2, 4, 8, 16, 16, ... (SPEC §2.5)."""
    return float(min(2 ** min(attempt, 4), 16))


def tokenizer_eos_ids(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's EOS and pad ids: a completion ending on one of them was not clipped."""
    ids = {getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None)}
    return frozenset(int(token) for token in ids if token is not None)


async def resolve(value: Any) -> Any:
    """Await `value` if it is awaitable (a coroutine, a future, a Ray ObjectRef); else return it."""
    return await value if inspect.isawaitable(value) else value
