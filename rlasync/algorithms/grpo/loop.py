"""`AsyncRolloutLoop`: the asyncio loop that turns prompts into scored groups (TRL's `AsyncRolloutLoop`).

It is three parts assembled: the GRPO rollout policy with the user hooks (`rlasync.algorithms.grpo.policy`), the task
scheduler that runs `num_generations` tasks per lease (`rlasync.rollout.scheduler`) and the engine pool
(`rlasync.rollout.engine_pool`: engine choice, retries, load statistics). Subclass it and override the hooks.

    PromptSource.lease() ──► filter_prompt ──► G × generate_one ──► TrainingSequences ──► score_group ──► GroupSink.put
           ▲  (after Admission.acquire)          │ generate_one_turn      (per rollout)     (rewards,        │
           │                                     ▼                                          advantages)      ▼
           └── release(lease, reason) ◄── failed / filtered / cancelled          Admission.finish_group(G, tokens, queued)

One loop runs in one event loop (a rollout actor, or a test with fakes). It talks only to protocols:

| collaborator      | the loop calls                                   | a Ray actor wires             |
|-------------------|--------------------------------------------------|-------------------------------|
| `Engine` (1..E)   | `generate(prompt_ids, sampling)`, `stats()`      | GenerationActor handles       |
| `PromptSource`    | `lease()`, `release(lease, reason)`              | the dispatcher in the queue   |
| `Admission`       | `acquire(G)`, `finish_group`, `cancel_group`     | `OpenAdmission` (the queue's  |
|                   |                                                  | `next_group` gates instead)   |
| `GroupSink`       | `put(GroupResult)` (dropped groups included)     | the StalenessQueue            |

Any of these methods may be sync or return an awaitable (Ray ObjectRefs are awaitable). The in-process
`rlasync.pipeline.TokenAllowance` is an `Admission` as it is; a prompt source that gates admission itself (the
queue actor's `next_group`) reports its wait in `PromptLease.waited_s` and pairs with `OpenAdmission`.

What waits for what (each iteration writes the heartbeat, handles finished tasks, polls engine stats every
`engine_stats_interval_s`, then dispatches):

| step                 | runs when                                                  | blocks                          |
|----------------------|------------------------------------------------------------|---------------------------------|
| start a group        | a slot is free and no group has undispatched rollouts      | only its own task (admission,   |
|                      |                                                            | lease): the loop keeps going    |
| dispatch a rollout   | in flight < min(max_concurrent_rollouts, concurrency cap)  | nothing                         |
|                      | and fewer than `max_pending_scores` groups being scored    |                                 |
| score a group        | its G rollouts are done                                    | its own task (rewards, put)     |

A group's G rollouts share the policy version read when its first rollout is dispatched. A rollout that
fails with a `group_failure_exceptions` error (a rejected request) fails its group: the other rollouts are
cancelled and the lease is released with reason "failed". Any other exception stops the loop; `run()`
re-raises it and `check_health()` raises `RuntimeError` chained to it. `stop()` cancels every task and
releases the leases of unfinished groups with reason "cancelled".

Metrics go to `metrics_callback(items)` as `(key, value)` pairs (value a float or a `(num, den)` rate pair),
keys as in docs/algorithms.md §8.2/8.3: per rollout `rollout/duration_s`, `rollout/turns_mean|max`,
`rollout/samples_per_rollout`, `completions/mean_length|max_length|min_length|clipped_ratio`,
`completions/mean_terminated_length|max_…|min_…`; per group `rollout/concurrency`, `rollout/score_s`,
`rollout/generated_tokens_per_s`, `completions/duplicate_frac` and `score_group`'s items; per start
`rollout/backpressure_s`; counters `rollout/vllm_retry_count`, `rollout/filtered_prompt_count`,
`rollout/failed_group_count`; engine gauges from `ConcurrencyController`. With tools (docs/algorithms.md §3.1/§3.2, see
`rlasync.rollout.tools`): per rollout `tools/loop_exhausted_frac`, counter `rollout/context_exhausted_count`
(a conversation that outgrew the engine), per tool call `tools/<name>/call_count|failure_count`,
`tools/unknown_name_count`, `tools/parse_failure_count`, rates `tools/latency_s`, `tools/<name>/latency_s`,
`tools/parallel_calls_mean`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlasync.algorithms.grpo.policy import GroupSink, RewardScorer, RolloutContext, RolloutPolicy
from rlasync.algorithms.grpo.settings import rollout_settings
from rlasync.engine.base import EngineError
from rlasync.records import GroupOutcome, MetricsCallback, PromptLease
from rlasync.rewards.calling import RewardFunc
from rlasync.rollout.assembly import ScheduledLoop, class_override, one_config
from rlasync.rollout.concurrency import ConcurrencyController
from rlasync.rollout.engine_pool import retry_backoff_s
from rlasync.rollout.environments import EnvironmentFactory
from rlasync.rollout.groups import GroupResult
from rlasync.rollout.protocols import Admission, OpenAdmission, PromptSource
from rlasync.rollout.scheduler import TaskScheduler
from rlasync.rollout.sequences import build_training_sequences, reconciliation_tally

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

ReleaseReason = GroupOutcome
"""Kept name: a lease comes back without a scored group as one of `RELEASE_REASONS`: `filtered` (rejected by
`filter_prompt`: consumed for the epoch), `failed` (a rollout failed, e.g. a rejected request), `cancelled` (the
loop stopped first)."""


class AsyncRolloutLoop(ScheduledLoop, RolloutPolicy):
    """Generates and scores groups of `config.num_generations` rollouts until stopped or out of prompts.

    Subclass and override the hooks (`setup`, `close`, `filter_prompt`, `generate_one`, `generate_one_turn`,
    `compute_advantages`, `render`, `parse_response`, `build_sequences`); a trainer subclass selects the
    subclass with `loop_cls`. Run with `await loop.run()`; stop with `await loop.stop()`. `config` is the user's
    `AsyncGRPOConfig` (`args=` is accepted as its old name); the hooks read it as `self.config` (or `self.args`).
    """

    retryable_exceptions: tuple[type[BaseException], ...] = (EngineError, TimeoutError, ConnectionError)
    loop_name = "rollout loop"
    heartbeat_interval_s: float = 0.5
    engine_stats_interval_s: float = 5.0
    max_pending_scores: int = 16
    """Groups being scored or handed to the sink at once; beyond it no new rollout is dispatched."""

    def __init__(
        self,
        *,
        config: TrainerConfig | None = None,
        tokenizer: Any,
        engine: Any | Sequence[Any],
        prompt_source: PromptSource,
        sink: GroupSink,
        reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
        admission: Admission | None = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory] | None = None,
        metrics_callback: MetricsCallback | None = None,
        policy_version: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        controller: ConcurrencyController | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        rng: random.Random | None = None,
        reward_scorer: RewardScorer | None = None,
        args: TrainerConfig | None = None,
    ) -> None:
        config = one_config(config, args, type(self).__name__)
        settings = rollout_settings(config)  # type: ignore[arg-type]
        self._init_engine_pool(
            engine,
            max_concurrent=settings.max_concurrent,
            max_attempts=class_override(self, "max_generation_attempts", settings.max_request_attempts),
            metrics_callback=metrics_callback,
            stats_interval_s=self.engine_stats_interval_s,
            controller=controller,
            clock=clock,
            sleep=sleep,
        )
        self._init_policy(
            config=config,
            tokenizer=tokenizer,
            settings=settings,
            engine_pool=self.engine_pool,
            reward_funcs=reward_funcs,
            tools=tools,
            environment_factory=environment_factory,
            eos_token_ids=eos_token_ids,
            clock=clock,
            rng=rng,
            reward_scorer=reward_scorer,
        )
        self.scheduler = TaskScheduler(
            self,
            prompt_source=prompt_source,
            sink=sink,
            group_size=settings.group_size,
            max_concurrent=settings.max_concurrent,
            admission=admission if admission is not None else OpenAdmission(),
            engine_pool=self.engine_pool,
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
            heartbeat_interval_s=self.heartbeat_interval_s,
            max_pending_groups=self.max_pending_scores,
            policy_version=policy_version,
            loop_name=self.loop_name,
            counters=self.counters,
            clock=clock,
            wall_clock=wall_clock,
        )

    @property  # type: ignore[override]
    def max_generation_attempts(self) -> int:
        """Tries of one generation request against transient engine errors (docs/algorithms.md §2.5)."""
        return self.engine_pool.max_attempts

    @max_generation_attempts.setter
    def max_generation_attempts(self, value: int) -> None:
        self.engine_pool.max_attempts = int(value)


__all__ = [
    "Admission",
    "AsyncRolloutLoop",
    "GroupResult",
    "GroupSink",
    "OpenAdmission",
    "PromptLease",
    "PromptSource",
    "ReleaseReason",
    "RolloutContext",
    "build_training_sequences",
    "reconciliation_tally",
    "retry_backoff_s",
]
