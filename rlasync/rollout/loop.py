"""`AsyncRolloutLoop`: the asyncio loop that turns prompts into scored groups (TRL's `AsyncRolloutLoop`).

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
keys as in SPEC §8.2/8.3: per rollout `rollout/duration_s`, `rollout/turns_mean|max`,
`rollout/samples_per_rollout`, `completions/mean_length|max_length|min_length|clipped_ratio`,
`completions/mean_terminated_length|max_…|min_…`; per group `rollout/concurrency`, `rollout/score_s`,
`rollout/generated_tokens_per_s`, `completions/duplicate_frac` and `score_group`'s items; per start
`rollout/backpressure_s`; counters `rollout/vllm_retry_count`, `rollout/filtered_prompt_count`,
`rollout/failed_group_count`; engine gauges from `ConcurrencyController`. With tools (SPEC §3.1/§3.2, see
`rlasync.rollout.tools`): per rollout `tools/loop_exhausted_frac`, counter `rollout/context_exhausted_count`
(a conversation that outgrew the engine), per tool call `tools/<name>/call_count|failure_count`,
`tools/unknown_name_count`, `tools/parse_failure_count`, rates `tools/latency_s`, `tools/<name>/latency_s`,
`tools/parallel_calls_mean`.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from rlasync.data.prompts import PROMPT_COLUMN, render_prompt, row_prompt
from rlasync.engine.base import Engine, EngineError, RequestRejectedError, SamplingParams
from rlasync.metrics import MetricSink, MetricValue
from rlasync.records import (
    GroupOutcome,
    MetricsCallback,
    PromptLease,
    Rollout,
    RolloutGroup,
    TrainingSequence,
    TurnRecord,
)
from rlasync.rewards.calling import RewardFunc
from rlasync.rollout.completions_log import print_group
from rlasync.rollout.concurrency import ConcurrencyController
from rlasync.rollout.environments import (
    ENVIRONMENT_COLUMN,
    EnvironmentFactory,
    EnvironmentSpec,
    append_to_last_message,
    probe_environments,
    reset_kwargs,
)
from rlasync.rollout.scoring import ScoredGroup, default_compute_advantages, score_group
from rlasync.rollout.task_loop import TaskLoopBase, resolve, retry_backoff_s, tokenizer_eos_ids
from rlasync.rollout.tools import PARSE_FAILURE_METRIC, call_tool, execute_tool_calls, tools_by_name
from rlasync.rollout.tools import parse_response as parse_tool_response

logger = logging.getLogger(__name__)

ReleaseReason = GroupOutcome
"""Kept name: a lease comes back without a scored group as one of `RELEASE_REASONS`: `filtered` (rejected by
`filter_prompt`: consumed for the epoch), `failed` (a rollout failed, e.g. a rejected request), `cancelled` (the
loop stopped first)."""

FINISH_STOP = "stop"
NOT_REWARD_KWARGS = frozenset({PROMPT_COLUMN, "completion", "completion_ids"})
"""Dataset columns not passed to the reward functions (every other column is, repeated G times)."""
SEED_BITS = 63


@dataclass(frozen=True, slots=True)
class RolloutContext:
    """What the loop knows about the rollout being generated, readable from `generate_one` and the hooks it
    calls through `AsyncRolloutLoop.rollout_context()` (the dataset row is not an argument of `generate_one`)."""

    row: Mapping[str, Any]
    row_index: int
    group_id: int
    tools: Sequence[Callable[..., Any]] | None = None
    """The tools of this rollout (standalone tools plus its environment's methods)."""
    environment: Any = None
    """The environment instance serving this rollout (None without environments)."""


_ROLLOUT_CONTEXT: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar(
    "rlasync_rollout_context", default=None
)


class PromptSource(Protocol):
    def lease(self) -> PromptLease | tuple[int, int, Mapping[str, Any], int] | None | Awaitable[Any]:
        """The next prompt, or None when the stream is exhausted (the loop then finishes its groups and ends)."""
        ...

    def release(self, lease: PromptLease, reason: ReleaseReason) -> None | Awaitable[None]:
        """`lease` will produce no scored group, for `reason`."""
        ...


class Admission(Protocol):
    """The gate in front of every new group: the token allowance of SPEC §2.3.3 (`rlasync.pipeline.TokenAllowance`
    has this shape). Every successful `acquire` is followed by exactly one `finish_group` or `cancel_group`."""

    def acquire(self, num_rollouts: int) -> Any:
        """Wait until a group of `num_rollouts` rollouts may start and count it in flight; return the seconds
        waited (a float, or an object with `waited_s`), possibly as an awaitable."""
        ...

    def finish_group(self, num_rollouts: int, num_tokens: int, queued: bool = True) -> None | Awaitable[None]:
        """The group was scored: `num_tokens` raw tokens of its samples were queued (`queued=False`: it was
        dropped, and `num_tokens` are its rollouts' tokens, for the per-rollout estimate only)."""
        ...

    def cancel_group(self, num_rollouts: int) -> None | Awaitable[None]:
        """The group ended without a result (failed, cancelled, or no prompt was left)."""
        ...


class OpenAdmission:
    """Admits every group at once (no token allowance here)."""

    async def acquire(self, num_rollouts: int) -> float:
        return 0.0

    def finish_group(self, num_rollouts: int, num_tokens: int, queued: bool = True) -> None:
        return None

    def cancel_group(self, num_rollouts: int) -> None:
        return None


@dataclass(frozen=True, slots=True)
class GroupResult:
    """A scored group, as handed to the sink (dropped groups too: the sink accounts for them)."""

    lease: PromptLease
    policy_version: int
    scored: ScoredGroup
    num_rollout_tokens: int = 0
    """Raw tokens of every training sequence of the group's rollouts, dropped or not (the per-rollout token
    estimate of the allowance needs them even for a dropped group)."""

    @property
    def group_id(self) -> int:
        return self.lease.group_id

    @property
    def row_index(self) -> int:
        return self.lease.row_index

    @property
    def epoch(self) -> int:
        return self.lease.epoch

    @property
    def dropped(self) -> bool:
        return self.scored.dropped

    @property
    def num_tokens(self) -> int:
        """Raw tokens of the samples to train on (0 for a dropped group)."""
        return sum(len(sample) for sample in self.scored.samples)


class RewardScorer(Protocol):
    """Scores one group's completions with the reward functions somewhere else (e.g. a RewardActor) and returns
    their `RewardTable`; advantages, dropping and samples stay in the loop (its `compute_advantages` hook)."""

    def __call__(
        self, *, prompts: Any, completions: Any, completion_ids: Any, reward_kwargs: Mapping[str, Any]
    ) -> Any: ...


class GroupSink(Protocol):
    def put(self, result: GroupResult) -> None | Awaitable[None]: ...


class _RolloutOutcome(NamedTuple):
    """What a rollout task returns: the rollout, its duration, its environment reward (`(class name, value)`)
    and the prompt it was generated from when an environment's reset extended the group's prompt."""

    rollout: Rollout
    duration_s: float
    env_reward: tuple[str, float | None] | None = None
    prompt: list[dict[str, Any]] | None = None


@dataclass(eq=False)
class _GroupState:
    """A leased prompt on its way to the sink."""

    lease: PromptLease
    prompt: list[dict[str, Any]]
    rollouts: list[Rollout | None]
    sequences: list[list[TrainingSequence] | None]
    policy_version: int = -1
    num_dispatched: int = 0
    num_done: int = 0
    failed: bool = False
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    rollout_prompts: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Per rollout index, the prompt it was generated from when an environment's reset extended it."""
    env_rewards: dict[int, tuple[str, float | None]] = field(default_factory=dict)
    """Per rollout index, `(environment class name, get_reward())` for environments that own a reward."""

    @property
    def size(self) -> int:
        return len(self.rollouts)


class AsyncRolloutLoop(TaskLoopBase):
    """Generates and scores groups of `args.num_generations` rollouts until stopped or out of prompts.

    Subclass and override the hooks (`setup`, `close`, `filter_prompt`, `generate_one`, `generate_one_turn`,
    `compute_advantages`, `render`, `parse_response`, `build_sequences`); a trainer subclass selects the
    subclass with `loop_cls`. Run with `await loop.run()`; stop with `await loop.stop()`.
    """

    drop_zero_std_groups: bool = True
    """Drop groups whose rewards carry no signal (SPEC §2.6.3); they still reach the sink, without samples."""
    provides_rollout_rewards: bool = False
    """Set in a subclass whose `generate_one` sets `Rollout.reward`: it is then a reward source on its own."""
    group_failure_exceptions: tuple[type[BaseException], ...] = (RequestRejectedError,)
    """Errors of a rollout that fail its group (lease released as "failed") instead of stopping the loop."""
    retryable_exceptions: tuple[type[BaseException], ...] = (EngineError, TimeoutError, ConnectionError)
    max_generation_attempts: int = 30
    loop_name = "rollout loop"
    engine_stats_interval_s: float = 5.0
    max_pending_scores: int = 16
    """Groups being scored or handed to the sink at once; beyond it no new rollout is dispatched."""

    def __init__(
        self,
        *,
        args: Any,
        tokenizer: Any,
        engine: Engine | Sequence[Engine],
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
    ) -> None:
        self.args = args
        self.reward_scorer = reward_scorer
        self.tokenizer = tokenizer
        self.engines: list[Engine] = list(engine) if isinstance(engine, Sequence) else [engine]
        if not self.engines:
            raise ValueError("AsyncRolloutLoop needs at least one engine")
        self.prompt_source = prompt_source
        self.sink = sink
        self.reward_funcs = _as_reward_funcs(reward_funcs)
        self.environments: dict[str | None, EnvironmentSpec] = probe_environments(environment_factory)
        if not self.reward_funcs and not self.provides_rollout_rewards and not self.has_environment_rewards:
            raise ValueError(
                "No reward source provided: pass reward_funcs, an environment_factory whose class defines "
                "get_reward, or subclass AsyncRolloutLoop with a generate_one that sets Rollout.reward and "
                "provides_rollout_rewards = True"
            )
        self.admission: Admission = admission if admission is not None else OpenAdmission()
        self.tools = list(tools) if tools else None
        tools_by_name(self.tools)  # duplicate or unnamed tools fail here, not mid-rollout
        for spec in self.environments.values():
            tools_by_name([*(self.tools or []), *spec.class_tools()])
        self._tool_executor: ThreadPoolExecutor | None = None
        self.metrics = MetricSink()
        self._metrics_callback = metrics_callback if metrics_callback is not None else self.metrics.update
        self.policy_version = policy_version
        self.eos_token_ids = frozenset(eos_token_ids) if eos_token_ids is not None else tokenizer_eos_ids(tokenizer)
        self.controller = controller
        self._init_task_loop(wall_clock)
        self._clock, self._sleep = clock, sleep
        self._rng = rng if rng is not None else random.Random()
        self.counters: collections.Counter[str] = collections.Counter()

        self._engine_load = [0] * len(self.engines)
        self._next_engine = 0
        self._groups: set[_GroupState] = set()  # leased and not yet put or released
        self._dispatching: _GroupState | None = None
        self._starter: asyncio.Task[_GroupState | None] | None = None
        self._rollout_tasks: dict[asyncio.Task[Any], tuple[_GroupState, int]] = {}
        self._score_tasks: dict[asyncio.Task[Any], _GroupState] = {}
        self._exhausted = False
        self._next_stats_at = -float("inf")
        self._stats_available = True
        self._generated_tokens_unreported = 0
        self._rate_window_start = clock()

    # ---- hooks --------------------------------------------------------------------------------------------

    def filter_prompt(self, row_index: int, row: Mapping[str, Any], epoch: int) -> bool:
        """Whether to generate for this prompt (once per lease). A rejected prompt is released with reason
        "filtered": it counts as consumed for the epoch (the prompt source decides what an epoch of nothing
        but rejections means; it sees every loop's leases)."""
        return True

    async def generate_one(self, prompt: list[dict[str, Any]], tools: Sequence[Any] | None, group_id: int) -> Rollout:
        """One whole rollout of `prompt`; every sampling request it made must be in `Rollout.turns`.

        Default without tools: a single turn (render, one `generate_one_turn`, the output decoded as the assistant
        message). With tools: the multi-turn tool loop of SPEC §3.1 (`generate_with_tools`).
        """
        if tools:
            return await self.generate_with_tools(prompt, tools)
        prompt_ids = self.render(prompt, tools)
        turn = await self.generate_one_turn(prompt_ids)
        message = self.parse_response(turn.output_ids, prompt_ids)
        return Rollout(completion=[message], completion_ids=list(turn.output_ids), turns=[turn])

    async def generate_with_tools(self, prompt: list[dict[str, Any]], tools: Sequence[Any]) -> Rollout:
        """The multi-turn tool loop (SPEC §3.1): generate, run the tool calls of the answer, repeat.

        Each turn re-renders the whole conversation (tools in the template) and is bounded by
        `max_completion_length` on its own. The loop ends on an answer without tool calls, after
        `args.max_tool_calling_iterations` rounds of tool execution (None: unbounded; 0: the first answer's calls
        are not run; the rollout then counts in `tools/loop_exhausted_frac`), or when the conversation no longer
        fits the engine (a rejected request after the first turn ends it cleanly; counted in
        `rollout/context_exhausted_count`). `completion_ids` are the generated tokens of every turn; tool outputs
        appear in the completion messages and in later prompts, never as trained tokens.
        """
        table = tools_by_name(tools)
        max_iterations = getattr(self.args, "max_tool_calling_iterations", None)
        messages = list(prompt)
        completion: list[dict[str, Any]] = []
        completion_ids: list[int] = []
        turns: list[TurnRecord] = []
        iterations = num_calls = num_failures = 0
        exhausted = False
        while True:
            prompt_ids = self.render(messages, tools)
            try:
                turn = await self.generate_one_turn(prompt_ids)
            except RequestRejectedError as exc:
                if not turns:
                    raise  # the prompt itself does not fit: the group fails as for a single turn
                logger.debug("conversation ends after %d turns: %s", len(turns), exc)
                self._emit([("rollout/context_exhausted_count", 1.0)])
                break
            message = self.parse_response(turn.output_ids, prompt_ids)
            completion.append(message)
            messages.append(message)
            completion_ids += turn.output_ids
            turns.append(turn)
            calls = message.get("tool_calls") or []
            if not calls:
                break
            if max_iterations is not None and iterations >= max_iterations:
                exhausted = True  # the requested tools are not run
                break
            results = await execute_tool_calls(calls, table, self.tool_executor())
            self._emit(results.metrics)
            completion += results.messages
            messages += results.messages
            num_calls += results.num_calls
            num_failures += results.num_failures
            iterations += 1
        self._emit([("tools/loop_exhausted_frac", (float(exhausted), 1.0))])
        return Rollout(
            completion=completion,
            completion_ids=completion_ids,
            turns=turns,
            tool_call_count=num_calls,
            tool_failure_count=num_failures,
        )

    def tool_executor(self) -> ThreadPoolExecutor:
        """The thread pool sync tools (and environment resets/rewards) run on: `max(1, max_concurrent_rollouts)`
        threads, created on first use and shut down when `run()` ends."""
        if self._tool_executor is None:
            size = max(1, int(getattr(self.args, "max_concurrent_rollouts", 1) or 1))
            self._tool_executor = ThreadPoolExecutor(size, thread_name_prefix="rlasync-tool")
        return self._tool_executor

    @property
    def has_environment_rewards(self) -> bool:
        """Whether some environment class defines `get_reward` (a reward column of its own)."""
        return any(spec.owns_reward for spec in self.environments.values())

    def environment_for(self, row: Mapping[str, Any], row_index: int = -1) -> EnvironmentSpec | None:
        """The environment serving `row`: the only one, or (several) the one named by its `environment` column;
        `ValueError` when the row names none of them. None without environments."""
        if not self.environments:
            return None
        if list(self.environments) == [None]:
            return self.environments[None]
        name = row.get(ENVIRONMENT_COLUMN)
        spec = self.environments.get(name) if isinstance(name, str) else None
        if spec is None:
            where = f"row {row_index}" if row_index >= 0 else "a dataset row"
            raise ValueError(
                f"{where}: environment {name!r} is not among the environments {sorted(map(str, self.environments))} "
                f"of environment_factory; with a dict of factories every row needs an {ENVIRONMENT_COLUMN!r} column "
                "naming one of its keys"
            )
        return spec

    def rollout_context(self) -> RolloutContext | None:
        """The context of the rollout being generated in the calling task (None outside a rollout task)."""
        return _ROLLOUT_CONTEXT.get()

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One sampling request with a fresh 63-bit seed; transient engine errors are retried with backoff
        (SPEC §2.5), a rejected request is not."""
        sampling = SamplingParams.from_config(self.args, seed=self._rng.getrandbits(SEED_BITS))
        return await self._retrying(
            "generation", lambda: self._generate_on_engine(prompt_ids, sampling), self.max_generation_attempts
        )

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """`[G]` advantages of a scored group (`group.rewards` is set); default: GRPO's group normalisation."""
        return default_compute_advantages(group)

    def render(self, messages: list[dict[str, Any]], tools: Sequence[Any] | None = None) -> list[int]:
        """The prompt ids of a conversation: the chat template with the generation prompt appended."""
        return render_prompt(self.tokenizer, messages, getattr(self.args, "chat_template_kwargs", None), tools)

    def parse_response(self, output_ids: list[int], prompt_ids: list[int]) -> dict[str, Any]:
        """The assistant message of one turn's output: plain decoded text when the rollout has no tools; with
        tools, also its `tool_calls` (`rlasync.rollout.tools.parse_response`; unparseable blocks are counted in
        `tools/parse_failure_count` and stay in the text)."""
        context = _ROLLOUT_CONTEXT.get()
        tools = context.tools if context is not None else self.tools
        if not tools:
            return {"role": "assistant", "content": self.tokenizer.decode(output_ids, skip_special_tokens=True)}
        parsed = parse_tool_response(self.tokenizer, output_ids, prompt_ids, tools)
        if parsed.parse_failures:
            self._emit([(PARSE_FAILURE_METRIC, float(parsed.parse_failures))])
        return parsed.message

    def build_sequences(self, rollout: Rollout) -> list[TrainingSequence]:
        """The training sequences of one rollout (one per single-turn rollout)."""
        return build_training_sequences(
            rollout.turns, rollout.rollout_id, getattr(self.args, "num_sampler_logprobs", 0)
        )

    # ---- control ------------------------------------------------------------------------------------------

    def update_policy_version(self, version: int) -> None:
        """The policy version groups started from now on are stamped with."""
        self.policy_version = int(version)

    def _after_close(self) -> None:
        self._shutdown_tool_executor()

    def _shutdown_tool_executor(self) -> None:
        if self._tool_executor is not None:
            self._tool_executor.shutdown(wait=False, cancel_futures=True)
            self._tool_executor = None

    @property
    def num_inflight(self) -> int:
        """Rollouts in flight."""
        return len(self._rollout_tasks)

    @property
    def concurrency_limit(self) -> int:
        cap = self.controller.cap if self.controller is not None else self.args.max_concurrent_rollouts
        return min(self.args.max_concurrent_rollouts, cap)

    # ---- the loop -----------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            self.heartbeat = self._wall_clock()
            await self._handle_finished_tasks()
            if self._stop_requested:
                return
            await self._observe_engines()
            self._dispatch()
            if self._exhausted and not (self._rollout_tasks or self._score_tasks or self._starter):
                return
            await self._wait_for_news()

    def _dispatch(self) -> None:
        """Start rollouts while slots are free; start the next group when the current one is dispatched."""
        while not self._stop_requested:
            if len(self._score_tasks) >= self.max_pending_scores or self.num_inflight >= self.concurrency_limit:
                return
            group = self._dispatching
            if group is not None and not group.failed and group.num_dispatched < group.size:
                self._dispatch_rollout(group)
                continue
            self._dispatching = None
            if self._starter is None and not self._exhausted:
                self._starter = self._spawn(self._start_group())
            return

    def _dispatch_rollout(self, group: _GroupState) -> None:
        if group.num_dispatched == 0:
            group.policy_version = self.policy_version
        index = group.num_dispatched
        group.num_dispatched += 1
        prompt = [dict(message) for message in group.prompt]
        task = self._spawn(self._timed_rollout(prompt, group.lease))
        self._rollout_tasks[task] = (group, index)
        group.tasks.add(task)

    async def _timed_rollout(self, prompt: list[dict[str, Any]], lease: PromptLease) -> _RolloutOutcome:
        """One rollout in its own task; the task's `RolloutContext` carries the row to the hooks.

        With environments (SPEC §3.4): an instance from the row's environment pool is reset with the row (its
        observation appended to the last prompt message), serves its methods as tools next to the standalone
        ones, and after the rollout gives `get_reward()` before going back to the pool. An instance whose rollout
        failed or was cancelled is dropped (a tool thread may still be using it).
        """
        started = self._clock()
        spec = self.environment_for(lease.row, lease.row_index)
        if spec is None:
            _ROLLOUT_CONTEXT.set(RolloutContext(lease.row, lease.row_index, lease.group_id, self.tools))
            rollout = await self._checked_generate_one(prompt, self.tools, lease.group_id)
            return _RolloutOutcome(rollout, self._clock() - started)
        environment = spec.acquire()
        reset_started = self._clock()
        kwargs = reset_kwargs(lease.row, multi_environment=spec.key is not None)
        observation = await call_tool(environment.reset, kwargs, self.tool_executor())
        self._emit([("env/reset_s", (self._clock() - reset_started, 1.0))])
        if observation is not None:
            prompt = append_to_last_message(prompt, observation)
        tools = [*(self.tools or []), *spec.tools(environment)] or None
        _ROLLOUT_CONTEXT.set(RolloutContext(lease.row, lease.row_index, lease.group_id, tools, environment))
        rollout = await self._checked_generate_one(prompt, tools, lease.group_id)
        env_reward = None
        if spec.owns_reward:
            reward_started = self._clock()
            value = await call_tool(environment.get_reward, {}, self.tool_executor())
            self._emit([("env/reward_s", (self._clock() - reward_started, 1.0))])
            env_reward = (spec.name, None if value is None else float(value))
        spec.release(environment)
        return _RolloutOutcome(rollout, self._clock() - started, env_reward, prompt)

    async def _checked_generate_one(
        self, prompt: list[dict[str, Any]], tools: Sequence[Any] | None, group_id: int
    ) -> Rollout:
        rollout = await self.generate_one(prompt, tools, group_id)
        if not isinstance(rollout, Rollout):
            raise TypeError(f"generate_one must return a Rollout, got {type(rollout).__name__}")
        return rollout

    async def _start_group(self) -> _GroupState | None:
        """Admission, then the next prompt that passes `filter_prompt`; None when the source is exhausted."""
        size = self.args.num_generations
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
                if not await resolve(self.filter_prompt(lease.row_index, lease.row, lease.epoch)):
                    filtered, lease = lease, None
                    await resolve(self.prompt_source.release(filtered, GroupOutcome.FILTERED))
                    self.counters["prompts_filtered"] += 1
                    self._emit([("rollout/filtered_prompt_count", 1.0)])
                    continue
                prompt = row_prompt(lease.row, lease.row_index)
                group = _GroupState(lease, prompt, [None] * size, [None] * size)
                self._groups.add(group)
                self._emit([("rollout/backpressure_s", waited_s)])
                return group
        except BaseException:
            if lease is not None:
                await self._release_quietly(lease, GroupOutcome.CANCELLED)
            await self._cancel_admission_quietly(size)
            raise

    # ---- finished tasks -----------------------------------------------------------------------------------

    async def _handle_finished_tasks(self) -> None:
        while self._done:
            task = self._done.popleft()
            if task is self._starter:
                self._starter = None
                group = task.result()  # an error here stops the loop
                if group is None:
                    self._exhausted = True
                else:
                    self._dispatching = group
            elif task in self._rollout_tasks:
                await self._on_rollout_done(task)
            elif task in self._score_tasks:
                del self._score_tasks[task]
                task.result()  # an error while scoring or putting stops the loop

    async def _on_rollout_done(self, task: asyncio.Task[Any]) -> None:
        group, index = self._rollout_tasks.pop(task)
        group.tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            if not isinstance(error, self.group_failure_exceptions):
                raise error
            if not group.failed:
                await self._fail_group(group, error)
            return
        if group.failed:
            return
        outcome = task.result()
        if outcome.prompt is not None:
            group.rollout_prompts[index] = outcome.prompt
        if outcome.env_reward is not None:
            group.env_rewards[index] = outcome.env_reward
        self._record_rollout(group, index, outcome.rollout, outcome.duration_s)
        if group.num_done == group.size:
            self._score_tasks[self._spawn(self._score_and_put(group))] = group

    async def _fail_group(self, group: _GroupState, error: BaseException) -> None:
        group.failed = True
        for task in group.tasks:
            task.cancel()
        self._groups.discard(group)
        logger.warning(
            "group %d (row %d) failed and is released: %s: %s",
            group.lease.group_id,
            group.lease.row_index,
            type(error).__name__,
            error,
        )
        self.counters["groups_failed"] += 1
        self._emit([("rollout/failed_group_count", 1.0)])
        await resolve(self.prompt_source.release(group.lease, GroupOutcome.FAILED))
        await resolve(self.admission.cancel_group(group.size))

    def _record_rollout(self, group: _GroupState, index: int, rollout: Rollout, duration_s: float) -> None:
        sequences = self.build_sequences(rollout)
        group.rollouts[index] = rollout
        group.sequences[index] = sequences
        group.num_done += 1
        self.counters["rollouts_completed"] += 1
        self._generated_tokens_unreported += sum(len(turn.output_ids) for turn in rollout.turns)
        self._emit(self._rollout_metrics(rollout, sequences, duration_s))

    def _rollout_metrics(
        self, rollout: Rollout, sequences: list[TrainingSequence], duration_s: float
    ) -> list[tuple[str, MetricValue]]:
        length = float(len(rollout.completion_ids))
        num_turns = float(len(rollout.turns))
        items: list[tuple[str, MetricValue]] = [
            ("rollout/duration_s", duration_s),
            ("rollout/turns_mean", (num_turns, 1.0)),
            ("rollout/turns_max", num_turns),
            ("rollout/samples_per_rollout", (float(len(sequences)), 1.0)),
            ("completions/mean_length", (length, 1.0)),
            ("completions/max_length", length),
            ("completions/min_length", length),
        ]
        forks, transitions, drift_total, drift_max = reconciliation_tally(rollout.turns)
        if transitions:
            items += [
                ("rollout/fork_frac", (float(forks), float(transitions))),
                ("rollout/drift_tokens_mean", (float(drift_total), float(transitions))),
                ("rollout/drift_tokens_max", float(drift_max)),
            ]
        if rollout.completion_ids:
            clipped = self._is_clipped(rollout)
            items.append(("completions/clipped_ratio", (float(clipped), 1.0)))
            if not clipped:
                items += [
                    ("completions/mean_terminated_length", length),
                    ("completions/max_terminated_length", length),
                    ("completions/min_terminated_length", length),
                ]
        return items

    def _is_clipped(self, rollout: Rollout) -> bool:
        """Whether the rollout did not end on EOS: the last turn's finish reason when the engine gave one,
        else its last generated token."""
        last_turn = rollout.turns[-1] if rollout.turns else None
        if last_turn is not None and last_turn.finish_reason is not None:
            return last_turn.finish_reason != FINISH_STOP
        return rollout.completion_ids[-1] not in self.eos_token_ids

    # ---- scoring ------------------------------------------------------------------------------------------

    async def _score_and_put(self, group: _GroupState) -> None:
        rollout_group = self._rollout_group(group)
        started = self._clock()
        reward_funcs, columns = self.reward_funcs, None
        if self.reward_scorer is not None:  # reward functions run elsewhere (a RewardActor): their table comes back
            table = await resolve(
                self.reward_scorer(
                    prompts=rollout_group.prompts,
                    completions=rollout_group.completions,
                    completion_ids=rollout_group.completions_ids,
                    reward_kwargs=rollout_group.reward_kwargs,
                )
            )
            reward_funcs, columns = [], list(zip(table.names, table.values))
        scored = await score_group(
            rollout_group,
            reward_funcs,
            compute_advantages=self.compute_advantages,
            extra_columns=columns,
            drop_zero_std_groups=self.drop_zero_std_groups,
        )
        score_s = self._clock() - started
        if getattr(self.args, "log_completions", False):
            print_group(
                rollout_group.prompts[0] if rollout_group.prompts else "", rollout_group.completions,
                [None if r != r else float(r) for r in scored.rewards], scored.advantages.tolist(),
                group_id=rollout_group.group_id, policy_version=rollout_group.policy_version,
                limit=getattr(self.args, "num_completions_to_print", None),
            )  # fmt: skip
        rollout_tokens = sum(
            len(seq.input_ids) for sequences in rollout_group.completions_sequences for seq in sequences
        )
        result = GroupResult(group.lease, group.policy_version, scored, num_rollout_tokens=rollout_tokens)
        await resolve(self.sink.put(result))
        self._groups.discard(group)
        self.counters["groups_scored"] += 1
        self.counters["groups_dropped"] += int(scored.dropped)
        if scored.dropped:
            await resolve(self.admission.finish_group(group.size, rollout_tokens, queued=False))
        else:
            await resolve(self.admission.finish_group(group.size, result.num_tokens, queued=True))
        self._emit(self._group_metrics(rollout_group, scored, score_s))

    def _rollout_group(self, group: _GroupState) -> RolloutGroup:
        rollouts = [rollout for rollout in group.rollouts if rollout is not None]
        size = len(rollouts)
        rewards = [rollout.reward for rollout in rollouts]
        reward_kwargs = {
            name: [value] * size for name, value in group.lease.row.items() if name not in NOT_REWARD_KWARGS
        }
        return RolloutGroup(
            prompts=[group.rollout_prompts.get(index, group.prompt) for index in range(size)],
            completions=[rollout.completion for rollout in rollouts],
            completions_ids=[list(rollout.completion_ids) for rollout in rollouts],
            completions_sequences=[list(sequences or []) for sequences in group.sequences],
            group_id=group.lease.group_id,
            policy_version=group.policy_version,
            row_index=group.lease.row_index,
            tool_call_counts=[rollout.tool_call_count for rollout in rollouts],
            tool_failure_counts=[rollout.tool_failure_count for rollout in rollouts],
            env_rewards=[group.env_rewards.get(index) for index in range(size)] if group.env_rewards else [],
            rollout_rewards=rewards if self.provides_rollout_rewards or any(r is not None for r in rewards) else [],
            reward_kwargs=reward_kwargs,
            queued_at=self._clock(),
        )

    def _group_metrics(self, group: RolloutGroup, scored: ScoredGroup, score_s: float) -> list[tuple[str, MetricValue]]:
        now = self._clock()
        rate = (float(self._generated_tokens_unreported), now - self._rate_window_start)
        self._generated_tokens_unreported, self._rate_window_start = 0, now
        seen: set[tuple[int, ...]] = set()
        duplicates = 0
        for ids in group.completions_ids:
            duplicates += tuple(ids) in seen
            seen.add(tuple(ids))
        return [
            ("rollout/concurrency", float(self.num_inflight)),
            ("rollout/score_s", score_s),
            ("rollout/generated_tokens_per_s", rate),
            ("completions/duplicate_frac", duplicates / len(group)),
            *scored.metrics,
        ]

    # ---- engines ------------------------------------------------------------------------------------------

    async def _generate_on_engine(self, prompt_ids: list[int], sampling: SamplingParams) -> TurnRecord:
        """Send one request to the least-loaded engine (ties: round robin)."""
        count = len(self.engines)
        start, self._next_engine = self._next_engine, (self._next_engine + 1) % count
        index = min(((start + k) % count for k in range(count)), key=self._engine_load.__getitem__)
        self._engine_load[index] += 1
        try:
            return await self.engines[index].generate(list(prompt_ids), sampling)
        finally:
            self._engine_load[index] -= 1

    async def _observe_engines(self) -> None:
        """Every `engine_stats_interval_s`: feed the engines' gauges to the concurrency controller."""
        now = self._clock()
        if not self._stats_available or now < self._next_stats_at:
            return
        self._next_stats_at = now + self.engine_stats_interval_s
        try:
            if not all(callable(getattr(engine, "stats", None)) for engine in self.engines):
                raise NotImplementedError("an engine has no stats()")
            stats = [await resolve(engine.stats()) for engine in self.engines]
        except NotImplementedError as exc:
            logger.warning("engines report no load stats (%s); concurrency stays at max_concurrent_rollouts", exc)
            self._stats_available = False
            return
        except self.retryable_exceptions as exc:
            logger.warning("reading engine stats failed (%s: %s); keeping the concurrency cap", type(exc).__name__, exc)
            return
        if self.controller is None:
            self.controller = ConcurrencyController.from_stats(self.args.max_concurrent_rollouts, stats)
        self._emit(self.controller.observe(stats, self.counters["rollouts_completed"]))

    # ---- bookkeeping --------------------------------------------------------------------------------------

    async def _release_quietly(self, lease: PromptLease, reason: ReleaseReason) -> None:
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
        tasks = [*self._rollout_tasks, *self._score_tasks, *([self._starter] if self._starter else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for group in list(self._groups):
            await self._release_quietly(group.lease, GroupOutcome.CANCELLED)
            await self._cancel_admission_quietly(group.size)
        self._groups.clear()
        self._rollout_tasks.clear()
        self._score_tasks.clear()
        self._starter = None
        self._dispatching = None
        self._done.clear()



def build_training_sequences(
    turns: Sequence[TurnRecord], rollout_id: str, num_sampler_logprobs: int = 0
) -> list[TrainingSequence]:
    """Training sequences of one rollout's turns.

    A turn whose prompt starts with the tokens held so far extends the current sequence (the new prompt
    tokens as context); any other turn starts a new sequence (the seed's rule, SPEC §3.3). Output tokens are
    trained where `TurnRecord.output_mask` allows (all when it is None) and carry their sampler log-prob,
    top-K sampler log-probs (sorted by log-prob, padded -1 / -inf to `num_sampler_logprobs`) and candidate
    set (padded -1); context carries 0.0 / -1 / -inf. Sequences without a trained token are left out.
    """
    builders: list[_SequenceBuilder] = []
    for turn in turns:
        if not builders or not _starts_with(turn.prompt_ids, builders[-1].token_ids):
            builders.append(_SequenceBuilder())
        builder = builders[-1]
        builder.add_context(turn.prompt_ids[len(builder.token_ids) :])
        builder.add_output(turn)
    return [builder.build(rollout_id, num_sampler_logprobs) for builder in builders if builder.num_trained > 0]


def reconciliation_tally(turns: Sequence[TurnRecord]) -> tuple[int, int, int, int]:
    """`(forks, transitions, drift_total, drift_max)` of one rollout under `build_training_sequences`' rule (SPEC §3.3,
    the seed's reporting): a transition is every turn after the first; it forks when its prompt does not start with
    the tokens the current sequence holds, and its drift is how many of those held tokens the new prompt re-rendered
    (0 for a transition that does not fork)."""
    held: list[int] = []
    forks = transitions = drift_total = drift_max = 0
    for index, turn in enumerate(turns):
        prompt = list(turn.prompt_ids)
        if index > 0:
            transitions += 1
            if not _starts_with(prompt, held):
                matched = _common_prefix_length(held, prompt)
                drift = len(held) - matched
                forks += 1
                drift_total += drift
                drift_max = max(drift_max, drift)
                held = []
        held = prompt + list(turn.output_ids) if not held else held + prompt[len(held) :] + list(turn.output_ids)
    return forks, transitions, drift_total, drift_max


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    length = min(len(a), len(b))
    for index in range(length):
        if a[index] != b[index]:
            return index
    return length


class _SequenceBuilder:
    """Per-token lists of one training sequence under construction."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.topk: list[Mapping[int, float] | None] = []
        self.candidates: list[Sequence[int] | None] = []
        self.has_topk = False
        self.has_candidates = False

    @property
    def num_trained(self) -> int:
        return sum(self.mask)

    def add_context(self, token_ids: Sequence[int]) -> None:
        count = len(token_ids)
        self.token_ids += token_ids
        self.mask += [0] * count
        self.logprobs += [0.0] * count
        self.topk += [None] * count
        self.candidates += [None] * count

    def add_output(self, turn: TurnRecord) -> None:
        count = len(turn.output_ids)
        mask = [int(bool(m)) for m in turn.output_mask] if turn.output_mask is not None else [1] * count
        if any(mask) and len(turn.output_log_probs) != count:
            raise ValueError(
                f"a turn with {count} output tokens has {len(turn.output_log_probs)} output_log_probs: trained "
                "tokens need the sampler's log-prob of every output token"
            )
        self.token_ids += turn.output_ids
        self.mask += mask
        self.logprobs += [lp if m else 0.0 for lp, m in zip(turn.output_log_probs or [0.0] * count, mask)]
        topk = turn.output_sampler_logprobs
        self.has_topk |= topk is not None
        self.topk += [topk[j] if topk is not None and mask[j] else None for j in range(count)]
        candidates = turn.output_sampling_mask
        self.has_candidates |= candidates is not None
        self.candidates += [candidates[j] if candidates is not None and mask[j] else None for j in range(count)]

    def build(self, rollout_id: str, num_sampler_logprobs: int) -> TrainingSequence:
        length = len(self.token_ids)
        topk_ids = topk_logprobs = sampling_mask = None
        if num_sampler_logprobs > 0 and self.has_topk:
            topk_ids = np.full((length, num_sampler_logprobs), -1, dtype=np.int64)
            topk_logprobs = np.full((length, num_sampler_logprobs), -np.inf, dtype=np.float32)
            for position, entry in enumerate(self.topk):
                if entry:
                    ranked = sorted(entry.items(), key=lambda item: (-item[1], item[0]))[:num_sampler_logprobs]
                    topk_ids[position, : len(ranked)] = [token for token, _ in ranked]
                    topk_logprobs[position, : len(ranked)] = [logprob for _, logprob in ranked]
        if self.has_candidates:
            width = max([len(c) for c in self.candidates if c is not None] + [1])
            sampling_mask = np.full((length, width), -1, dtype=np.int64)
            for position, entry in enumerate(self.candidates):
                if entry:
                    sampling_mask[position, : len(entry)] = entry
        return TrainingSequence(
            input_ids=np.asarray(self.token_ids, dtype=np.int64),
            completion_mask=np.asarray(self.mask, dtype=np.int8),
            sampler_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            rollout_id=rollout_id,
            sampler_topk_ids=topk_ids,
            sampler_topk_logprobs=topk_logprobs,
            sampling_mask=sampling_mask,
        )


def _starts_with(token_ids: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(token_ids) >= len(prefix) and list(token_ids[: len(prefix)]) == list(prefix)


def _as_reward_funcs(reward_funcs: RewardFunc | Sequence[RewardFunc] | None) -> list[RewardFunc]:
    if reward_funcs is None:
        return []
    if callable(reward_funcs):
        return [reward_funcs]
    return list(reward_funcs)


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
