"""`ScheduledLoop`: the control surface of a worker loop assembled from a `TaskScheduler`, an `EnginePool` and a
policy (`AsyncRolloutLoop`, `AsyncDistillationLoop`), and the helpers both assemblies use. No torch, no ray."""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rlasync.metrics import MetricSink
from rlasync.records import MetricsCallback
from rlasync.rollout.engine_pool import EnginePool
from rlasync.rollout.protocols import Admission, PromptSource, Sink
from rlasync.rollout.scheduler import TaskScheduler

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig


class ScheduledLoop:
    """The control surface of a worker loop assembled from a `TaskScheduler` (`self.scheduler`) and an
    `EnginePool` (`self.engine_pool`): `run`, `stop`, `check_health`, the heartbeat and the policy version, as
    the rollout actors and tests use them on `AsyncRolloutLoop` and `AsyncDistillationLoop`."""

    scheduler: TaskScheduler[Any]
    engine_pool: EnginePool
    retryable_exceptions: tuple[type[BaseException], ...]

    def _init_engine_pool(
        self,
        engines: Any,
        *,
        max_concurrent: int,
        max_attempts: int,
        metrics_callback: MetricsCallback | None,
        stats_interval_s: float | None,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[Any]],
        controller: Any = None,
    ) -> None:
        """What every assembly starts with: the counters, the metric sink (or the caller's `metrics_callback`) and
        the `EnginePool` over `engines` retrying the loop's `retryable_exceptions`."""
        self.counters: collections.Counter[str] = collections.Counter()
        self.metrics = MetricSink()
        self._metrics_callback = metrics_callback if metrics_callback is not None else self.metrics.update
        self.engine_pool = EnginePool(
            engines,
            max_concurrent=max_concurrent,
            emit=self.emit,  # type: ignore[attr-defined]  (the policy's, mixed in by the assembly)
            counters=self.counters,
            max_attempts=max_attempts,
            retryable_exceptions=self.retryable_exceptions,
            stats_interval_s=stats_interval_s,
            controller=controller,
            clock=clock,
            sleep=sleep,
        )

    async def run(self) -> None:
        """Run until `stop()`, until the prompts are exhausted and every task is done, or a failure (re-raised
        here and by `check_health`)."""
        await self.scheduler.run()

    async def stop(self) -> None:
        """Cancel and await in-flight work, release unfinished leases ("cancelled"); returns when `run()` has ended."""
        await self.scheduler.stop()

    def check_health(self, stale_after_s: float | None = None) -> None:
        """Raise `RuntimeError` if the loop failed or, while running, its heartbeat is older than `stale_after_s`
        (default: the settings' `heartbeat_timeout_s`)."""
        self.scheduler.check_health(stale_after_s)

    def health_report(self) -> dict[str, Any]:
        """What the rollout actor's health adds for the watchdog (docs/algorithms.md §2.1): tasks in flight, the
        oldest unanswered generation request, when each engine last answered (`engines`), the last group failure
        and the policy's own `progress()` (GRPO: the oldest tool call still running)."""
        report: dict[str, Any] = {
            "num_inflight": self.num_inflight,
            "oldest_request": self.engine_pool.oldest_request(),
            "engines": self.engine_pool.answer_report(),
            "last_failure": self.scheduler.last_failure,
        }
        progress = getattr(self.scheduler.policy, "progress", None)
        if callable(progress):
            report.update(progress())
        return report

    def update_policy_version(self, version: int) -> None:
        """The policy version groups started from now on are stamped with."""
        self.scheduler.policy_version = int(version)

    @property
    def policy_version(self) -> int:
        return self.scheduler.policy_version

    @property
    def is_running(self) -> bool:
        return self.scheduler.is_running

    @property
    def heartbeat(self) -> float:
        return self.scheduler.heartbeat

    @property
    def num_inflight(self) -> int:
        """Tasks in flight."""
        return self.scheduler.num_inflight

    @property
    def concurrency_limit(self) -> int:
        return self.scheduler.concurrency_limit

    @property
    def prompt_source(self) -> PromptSource:
        return self.scheduler.prompt_source

    @property
    def sink(self) -> Sink:
        return self.scheduler.sink

    @property
    def admission(self) -> Admission:
        return self.scheduler.admission

    @property
    def engines(self) -> list[Any]:
        return self.engine_pool.engines

    @property
    def controller(self) -> Any:
        return self.engine_pool.controller


def one_config(config: TrainerConfig | None, args: TrainerConfig | None, who: str) -> TrainerConfig:
    """The user's config given to a loop as `config=` (or, its old name, `args=`)."""
    if config is None and args is None:
        raise TypeError(f"{who} needs config= (the trainer config)")
    if config is not None and args is not None and config is not args:
        raise TypeError(f"{who}: give the config once, as config= (args= is its old name)")
    return config if config is not None else args


def class_override(obj: Any, name: str, default: int) -> int:
    """A subclass's class-level int for `name` (e.g. `max_generation_attempts = 5`) where the loop exposes `name`
    as a property over its engine pool; else `default`."""
    for cls in type(obj).__mro__:
        value = cls.__dict__.get(name)
        if isinstance(value, property):
            return default
        if value is not None:
            return int(value)
    return default


__all__ = ["ScheduledLoop", "class_override", "one_config"]
