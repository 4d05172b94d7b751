"""`AsyncDistillationLoop`: the distillation worker loop (docs/algorithms.md §9.1) over rlasync engines.

    PromptSource.lease() ──► route(row) ──► student.generate ──► teacher.score(prompt + completion) ──► sink.put
                              (§9.4)         (no log-probs)       (top-k at teacher_top_k)              (one sample)

No groups, no rewards, no tools, no multi-turn: one leased row → one task → one `DistillationSample`. Up to
`max_inflight_tasks` tasks run at once (`-1` → `max(max_staleness, 1) × samples_per_step`). A lease's `group_id`
is the sample's `prompt_id` (the global prompt counter, GRPO's group id with one rollout per prompt).

It is the distillation policy (`rlasync.algorithms.distill.policy`) assembled with the task scheduler and the engine pool
GRPO's `AsyncRolloutLoop` uses (`rlasync.rollout.scheduler`, `rlasync.rollout.engine_pool`; one task per lease).
It talks only to protocols (`rlasync.rollout.protocols`, the lease is `rlasync.records.PromptLease`): `Engine.generate` / `Engine.score` (student engines 1..E, least loaded first; one teacher engine per
teacher id), `PromptSource.lease()` / `release(lease, reason)`, `sink.put(sample)`; any of them may be sync or
return an awaitable. Transient engine errors (`EngineError`, `TimeoutError`, `ConnectionError`) are retried with
the GRPO backoff (1, 2, 4, 8, 16, 16 … s; `max_request_attempts` tries) and counted in `rollout/vllm_retry_count`
(student and teachers); when the tries run out the error stops the loop. A rejected request
(`RequestRejectedError`) fails only its task: the lease is released with reason "failed"
(`rollout/failed_task_count`). Any other error (e.g. a row with an unknown `teacher_id`) stops the loop: `run()`
re-raises it and `check_health()` raises `RuntimeError` chained to it.

Metrics (`metrics_callback(items)`, `(key, value)` pairs, a rate as `(num, den)`), emitted with each push:
rates `completions/mean_length`, `rollout/score_s` (teacher call latency), `teacher_score_s/<id>` (only with more
than one teacher), `completions/clipped_ratio`; gauges `rollout/duration_s`, `completions/max_length`,
`completions/min_length`, `rollout/backpressure_s` (lease wait + time blocked in `sink.put`), `rollout/inflight`
(other tasks in flight); rate `rollout/generated_tok_s` (completion tokens since the previous push / seconds since
it).

Teacher temperature: `Engine.score` has no temperature parameter today (every engine scores at temperature 1).
The loop passes `temperature=teacher_temperature` to a teacher whose `score` accepts that keyword; for any other
teacher it warns once when `teacher_temperature != 1` and the teacher's log-probs stay at temperature 1 (the
"raw log-probs" case of docs/algorithms.md §9.3: τ then only affects the student side of the loss).

No torch, no ray.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlasync.algorithms.distill.policy import FAILED_TASK_METRIC, DistillationPolicy
from rlasync.algorithms.distill.settings import TeacherSettings, resolve_max_inflight_tasks, rollout_settings
from rlasync.engine.base import Engine, EngineError
from rlasync.records import MetricsCallback
from rlasync.rollout.assembly import ScheduledLoop, class_override, one_config
from rlasync.rollout.protocols import PromptSource, Sink
from rlasync.rollout.scheduler import TaskScheduler

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig


class AsyncDistillationLoop(ScheduledLoop, DistillationPolicy):
    """Generates with the student, scores with the routed teacher, puts one `DistillationSample` per leased row.

    `config` is the user's `AsyncDistillationConfig` (`args=` is accepted as its old name); its settings are
    `rlasync.algorithms.distill.settings.rollout_settings(config, max_inflight_tasks=...)`. `teachers`: one engine (id "default") or teacher
    id -> engine in stable order (the collator's `teacher_id_idx` order). Run with `await loop.run()`; stop with
    `await loop.stop()`.
    """

    retryable_exceptions: tuple[type[BaseException], ...] = (EngineError, TimeoutError, ConnectionError)
    loop_name = "distillation loop"
    heartbeat_interval_s: float = 0.5

    def __init__(
        self,
        *,
        config: TrainerConfig | None = None,
        tokenizer: Any,
        student: Engine | Sequence[Engine],
        teachers: Engine | Mapping[str, Engine],
        prompt_source: PromptSource,
        sink: Sink,
        metrics_callback: MetricsCallback | None = None,
        policy_version: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        max_inflight_tasks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        rng: random.Random | None = None,
        args: TrainerConfig | None = None,
    ) -> None:
        config = one_config(config, args, type(self).__name__)
        settings = rollout_settings(config, max_inflight_tasks=max_inflight_tasks)  # type: ignore[arg-type]
        self._init_engine_pool(
            student,
            max_concurrent=settings.max_concurrent,
            max_attempts=class_override(self, "max_request_attempts", settings.max_request_attempts),
            metrics_callback=metrics_callback,
            stats_interval_s=None,
            clock=clock,
            sleep=sleep,
        )
        self._init_policy(
            config=config,
            tokenizer=tokenizer,
            settings=settings,
            scoring=TeacherSettings.from_config(config),  # type: ignore[arg-type]
            engine_pool=self.engine_pool,
            teachers=teachers,
            eos_token_ids=eos_token_ids,
            clock=clock,
            wall_clock=wall_clock,
            rng=rng,
        )
        self.scheduler = TaskScheduler(
            self,
            prompt_source=prompt_source,
            sink=sink,
            group_size=1,
            max_concurrent=settings.max_concurrent,
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
            heartbeat_interval_s=self.heartbeat_interval_s,
            max_pending_groups=settings.max_concurrent,
            policy_version=policy_version,
            loop_name=self.loop_name,
            counters=self.counters,
            clock=clock,
            wall_clock=wall_clock,
        )

    @property
    def max_inflight_tasks(self) -> int:
        return self.settings.max_concurrent

    @property
    def students(self) -> list[Engine]:
        return self.engine_pool.engines

    @property
    def max_request_attempts(self) -> int:
        """Tries of one student or teacher request against transient engine errors (docs/algorithms.md §2.5)."""
        return self.engine_pool.max_attempts

    @max_request_attempts.setter
    def max_request_attempts(self, value: int) -> None:
        self.engine_pool.max_attempts = int(value)


__all__ = ["FAILED_TASK_METRIC", "AsyncDistillationLoop", "DistillationPolicy", "resolve_max_inflight_tasks"]
