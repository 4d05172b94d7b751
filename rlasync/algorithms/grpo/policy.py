"""`RolloutPolicy`: what a GRPO rollout is — the user hooks of TRL's `AsyncRolloutLoop` and the group scoring.

The task scheduler (`rlasync.rollout.scheduler`) leases prompts and runs `num_generations` tasks per lease; this
policy says what one task does and what a finished group becomes:

    admit(lease)     filter_prompt, the row's conversational prompt              (None: released as "filtered")
    run_task         one rollout: environment reset, generate_one (generate_one_turn / the tool loop), get_reward
    record           build_sequences of the rollout, per-rollout metrics
    collect          rewards (reward functions here or a `reward_scorer`), compute_advantages, samples → GroupResult
    handed_over      per-group metrics

Requests go through the engine pool (`rlasync.rollout.engine_pool`). Hooks read `self.config` (the user's config
object, possibly a subclass with extra fields; `self.args` is the same object) and `self.tokenizer`; the built-in
behaviour reads the typed `self.settings`. Metric keys are listed in `rlasync.algorithms.grpo.loop`'s docstring.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import json
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from rlasync.data.chat_templates import with_training_chat_template
from rlasync.data.prompts import render_prompt, row_prompt
from rlasync.engine.base import RequestRejectedError
from rlasync.records import MetricItem, PromptLease, Rollout, RolloutGroup, TrainingSequence, TurnRecord
from rlasync.rewards.calling import RewardFunc, RewardTimeoutError
from rlasync.rollout.completions_log import CompletionSampler
from rlasync.rollout.engine_pool import EnginePool, resolve
from rlasync.rollout.environments import (
    EnvironmentFactory,
    EnvironmentSpec,
    environment_for,
    probe_environments,
    run_in_environment,
)
from rlasync.rollout.groups import NOT_REWARD_KWARGS, GroupResult, GroupState, RolloutOutcome
from rlasync.rollout.protocols import Collected, PolicyBase
from rlasync.rollout.rollout_metrics import group_metrics, rollout_metrics
from rlasync.rollout.scoring import ScoredGroup, default_compute_advantages, reward_weight_vector, score_group
from rlasync.rollout.sequences import build_training_sequences, tokenizer_eos_ids
from rlasync.rollout.settings import RolloutSettings
from rlasync.rollout.tools import PARSE_FAILURE_METRIC, ToolCallTracker, run_tool_loop, tools_by_name
from rlasync.rollout.tools import parse_response as parse_tool_response

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

SEED_BITS = 63
RENDER_CACHE_SIZE = 1024  # prompts whose rendering `RolloutPolicy.render` keeps


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


class RewardScorer(Protocol):
    """Scores one group's completions with the reward functions somewhere else (e.g. a RewardActor) and returns
    their `RewardTable`; advantages, dropping and samples stay in the loop (its `compute_advantages` hook)."""

    def __call__(
        self, *, prompts: Any, completions: Any, completion_ids: Any, reward_kwargs: Mapping[str, Any]
    ) -> Any: ...


class GroupSink(Protocol):
    def put(self, result: GroupResult) -> None | Awaitable[None]: ...


class _Scored(NamedTuple):
    group: RolloutGroup
    result: GroupResult
    score_s: float


class RolloutPolicy(PolicyBase):
    """The GRPO rollout policy (see the module docstring); `AsyncRolloutLoop` assembles it with a scheduler."""

    drop_zero_std_groups: bool = True
    """Drop groups whose rewards carry no signal (docs/algorithms.md §2.6.3); they still reach the sink, without samples."""
    provides_rollout_rewards: bool = False
    """Set in a subclass whose `generate_one` sets `Rollout.reward`: it is then a reward source on its own."""
    group_failure_exceptions: tuple[type[BaseException], ...] = (RequestRejectedError, RewardTimeoutError)
    """Errors of a rollout (or of its group's scoring) that fail its group (dropped as "failed", counted) instead of
    stopping the loop."""
    hand_over_holds_slots = False
    failure_metric = "rollout/failed_group_count"

    def _init_policy(
        self,
        *,
        config: TrainerConfig,
        tokenizer: Any,
        settings: RolloutSettings,
        engine_pool: EnginePool,
        reward_funcs: RewardFunc | Sequence[RewardFunc] | None,
        tools: Sequence[Callable[..., Any]] | None,
        environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory] | None,
        eos_token_ids: Iterable[int] | None,
        clock: Callable[[], float],
        rng: random.Random | None,
        reward_scorer: RewardScorer | None,
    ) -> None:
        self.config = self.args = config
        self.tokenizer, self.settings, self.engine_pool = tokenizer, settings, engine_pool
        self.reward_scorer = reward_scorer
        self.reward_funcs = _as_reward_funcs(reward_funcs)
        reward_weight_vector(settings.reward_weights, len(self.reward_funcs))  # a misfit fails here, not per group
        self.environments: dict[str | None, EnvironmentSpec] = probe_environments(environment_factory)
        if not self.reward_funcs and not self.provides_rollout_rewards and not self.has_environment_rewards:
            raise ValueError(
                "No reward source provided: pass reward_funcs, an environment_factory whose class defines "
                "get_reward, or subclass AsyncRolloutLoop with a generate_one that sets Rollout.reward and "
                "provides_rollout_rewards = True"
            )
        self.tools = list(tools) if tools else None
        tools_by_name(self.tools)  # duplicate or unnamed tools fail here, not mid-rollout
        for spec in self.environments.values():
            tools_by_name([*(self.tools or []), *spec.class_tools()])
        self.has_tools = bool(self.tools or any(spec.class_tools() for spec in self.environments.values()))
        if self.has_tools:  # docs/algorithms.md §3.3
            self.tokenizer = with_training_chat_template(tokenizer, settings.chat_template_kwargs)
        self._tool_executor: ThreadPoolExecutor | None = None
        self.tool_calls = ToolCallTracker(clock)
        self.eos_token_ids = frozenset(eos_token_ids) if eos_token_ids is not None else tokenizer_eos_ids(tokenizer)
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._rendered: collections.OrderedDict[str, list[int]] = collections.OrderedDict()  # `render`'s cache
        self._generated_tokens_unreported = 0
        self._rate_window_start = clock()
        self._scoring = 0  # groups being scored now (rollout/score_queue_size)
        self.completion_samples = (  # log_completions: this window's sample, drained by the driver's table
            CompletionSampler(settings.num_completions_to_print) if settings.log_completions else None
        )

    _metrics_callback: Callable[[list[MetricItem]], Any]
    counters: collections.Counter[str]

    # ---- hooks (and `emit`, `setup`, `close` of PolicyBase) ----------------------------------------------

    def filter_prompt(self, row_index: int, row: Mapping[str, Any], epoch: int) -> bool:
        """Whether to generate for this prompt (once per lease). A rejected prompt is released with reason
        "filtered": it counts as consumed for the epoch (the prompt source decides what an epoch of nothing
        but rejections means; it sees every loop's leases)."""
        return True

    async def generate_one(
        self, prompt: list[dict[str, Any]], tools: Sequence[Any] | None, group_id: int = 0
    ) -> Rollout:
        """One whole rollout of `prompt`; every sampling request it made must be in `Rollout.turns`.

        Default without tools: a single turn (render, one `generate_one_turn`, the output decoded as the assistant
        message). With tools: the multi-turn tool loop of docs/algorithms.md §3.1 (`generate_with_tools`).
        """
        if tools:
            return await self.generate_with_tools(prompt, tools)
        prompt_ids = self.render(prompt, tools)
        turn = await self.generate_one_turn(prompt_ids)
        message = self.parse_response(turn.output_ids, prompt_ids)
        return Rollout(completion=[message], completion_ids=list(turn.output_ids), turns=[turn])

    async def generate_with_tools(self, prompt: list[dict[str, Any]], tools: Sequence[Any]) -> Rollout:
        """The multi-turn tool loop (docs/algorithms.md §3.1): generate, run the tool calls of the answer, repeat.

        Each turn re-renders the whole conversation (tools in the template) and is bounded by
        `max_completion_length` on its own. The loop ends on an answer without tool calls, after
        `max_tool_calling_iterations` rounds of tool execution (None: unbounded; 0: the first answer's calls
        are not run; the rollout then counts in `tools/loop_exhausted_frac`), or when the conversation no longer
        fits the engine (a rejected request after the first turn ends it cleanly; counted in
        `rollout/context_exhausted_count`). `completion_ids` are the generated tokens of every turn; tool outputs
        appear in the completion messages and in later prompts, never as trained tokens.
        """
        return await run_tool_loop(
            prompt,
            tools,
            render=self.render,
            generate_one_turn=self.generate_one_turn,
            parse_response=self.parse_response,
            executor=self.tool_executor,
            emit=self.emit,
            max_iterations=self.settings.max_tool_calling_iterations,
            timeout_s=self.settings.tool_timeout_s,
            tracker=self.tool_calls,
        )

    def tool_executor(self) -> ThreadPoolExecutor:
        """The thread pool sync tools (and environment resets/rewards) run on: `max(1, max_concurrent_rollouts)`
        threads, created on first use and shut down when `run()` ends."""
        if self._tool_executor is None:
            size = max(1, self.settings.max_concurrent)
            self._tool_executor = ThreadPoolExecutor(size, thread_name_prefix="rlasync-tool")
        return self._tool_executor

    @property
    def has_environment_rewards(self) -> bool:
        """Whether some environment class defines `get_reward` (a reward column of its own)."""
        return any(spec.owns_reward for spec in self.environments.values())

    def environment_for(self, row: Mapping[str, Any], row_index: int = -1) -> EnvironmentSpec | None:
        """The environment serving `row`: the only one, or (several) the one named by its `environment` column;
        `ValueError` when the row names none of them. None without environments."""
        return environment_for(self.environments, row, row_index)

    def rollout_context(self) -> RolloutContext | None:
        """The context of the rollout being generated in the calling task (None outside a rollout task)."""
        return _ROLLOUT_CONTEXT.get()

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One sampling request with a fresh 63-bit seed; transient engine errors are retried with backoff
        (docs/algorithms.md §2.5), a rejected request is not. Within a rollout task, the group's requests (every
        turn of every rollout) go to one engine (`EnginePool` affinity: one submission for the group, the prompt
        prefilled once, later turns' prefixes cached)."""
        sampling = self.settings.sampling.with_seed(self._rng.getrandbits(SEED_BITS))
        context = _ROLLOUT_CONTEXT.get()
        affinity = ("group", context.group_id) if context is not None else None
        return await self.engine_pool.generate(prompt_ids, sampling, affinity=affinity)

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """`[G]` advantages of a scored group (`group.rewards` is set); default: GRPO's group normalisation
        (`scale_rewards="none"`: centred only)."""
        return default_compute_advantages(group, self.settings.scale_rewards)

    def render(self, messages: list[dict[str, Any]], tools: Sequence[Any] | None = None) -> list[int]:
        """The prompt ids of a conversation: the chat template with the generation prompt appended. The last
        `RENDER_CACHE_SIZE` renderings are kept: a group's G rollouts render the same prompt once."""
        try:
            key = json.dumps([messages, [id(tool) for tool in tools or ()]], sort_keys=True)
        except TypeError:  # content json cannot write (images, objects): render every time
            return render_prompt(self.tokenizer, messages, self.settings.chat_template_kwargs, tools)
        cached = self._rendered.get(key)
        if cached is None:
            cached = render_prompt(self.tokenizer, messages, self.settings.chat_template_kwargs, tools)
            self._rendered[key] = cached
            if len(self._rendered) > RENDER_CACHE_SIZE:
                self._rendered.popitem(last=False)
        else:
            self._rendered.move_to_end(key)
        return list(cached)

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
            self.emit([(PARSE_FAILURE_METRIC, float(parsed.parse_failures))])
        return parsed.message

    def build_sequences(self, rollout: Rollout) -> list[TrainingSequence]:
        """The training sequences of one rollout (one per single-turn rollout)."""
        return build_training_sequences(rollout.turns, rollout.rollout_id, self.settings.num_sampler_logprobs)

    # ---- the scheduler's calls (TaskPolicy) ----------------------------------------------------------------

    def is_group_failure(self, error: BaseException) -> bool:
        return isinstance(error, self.group_failure_exceptions)

    def failure_cause(self, error: BaseException) -> str:
        """The cause a failed group is counted under (the watchdog's reason): "too_long" (the engine rejected a
        prompt over max_model_len), "rejected" (another rejected request), "reward_timeout", else "error"."""
        if isinstance(error, RewardTimeoutError):
            return "reward_timeout"
        if isinstance(error, RequestRejectedError):
            return "too_long" if "max_model_len" in str(getattr(error, "cause", None) or error) else "rejected"
        return "error"

    def progress(self) -> dict[str, Any]:
        """What the rollout actor's health adds for the watchdog: the oldest tool call still running
        (`{"name", "age_s"}` or None)."""
        return {"oldest_tool_call": self.tool_calls.oldest()}

    def after_close(self) -> None:
        """Shut the tool thread pool down (after `close()`, also when it raised)."""
        if self._tool_executor is not None:
            self._tool_executor.shutdown(wait=False, cancel_futures=True)
            self._tool_executor = None

    async def admit(self, lease: PromptLease, waited_s: float) -> GroupState | None:
        if not await resolve(self.filter_prompt(lease.row_index, lease.row, lease.epoch)):
            return None
        state = GroupState.for_lease(lease, row_prompt(lease.row, lease.row_index), self.settings.group_size)
        self.emit([("rollout/backpressure_s", waited_s)])
        return state

    async def run_task(self, group: GroupState, index: int, policy_version: int) -> RolloutOutcome:
        """One rollout in its own task; the task's `RolloutContext` carries the row to the hooks. With
        environments (docs/algorithms.md §3.4) see `rlasync.rollout.environments.run_in_environment`."""
        lease, started = group.lease, self._clock()
        prompt = [dict(message) for message in group.prompt]
        spec = self.environment_for(lease.row, lease.row_index)
        if spec is None:
            _ROLLOUT_CONTEXT.set(RolloutContext(lease.row, lease.row_index, lease.group_id, self.tools))
            rollout = await self._checked_generate_one(prompt, self.tools, lease.group_id)
            return RolloutOutcome(rollout, self._clock() - started)

        async def generate(prompt: list[dict[str, Any]], tools: list[Any] | None, environment: Any) -> Rollout:
            _ROLLOUT_CONTEXT.set(RolloutContext(lease.row, lease.row_index, lease.group_id, tools, environment))
            return await self._checked_generate_one(prompt, tools, lease.group_id)

        rollout, env_reward, prompt = await run_in_environment(
            spec, lease.row, prompt, self.tools, generate, self.tool_executor(), self.emit, self._clock, lease.row_index
        )
        return RolloutOutcome(rollout, self._clock() - started, env_reward, prompt)

    async def _checked_generate_one(
        self, prompt: list[dict[str, Any]], tools: Sequence[Any] | None, group_id: int
    ) -> Rollout:
        rollout = await self.generate_one(prompt, tools, group_id)
        if not isinstance(rollout, Rollout):
            raise TypeError(f"generate_one must return a Rollout, got {type(rollout).__name__}")
        return rollout

    def record(self, group: GroupState, index: int, outcome: RolloutOutcome) -> None:
        sequences = self.build_sequences(outcome.rollout)
        group.add(index, outcome, sequences)
        group.done_at = self._clock()
        self.counters["rollouts_completed"] += 1
        self._generated_tokens_unreported += sum(len(turn.output_ids) for turn in outcome.rollout.turns)
        self.emit(rollout_metrics(outcome.rollout, sequences, outcome.duration_s, self.eos_token_ids))

    async def collect(self, group: GroupState, results: list[Any], policy_version: int) -> Collected:
        rollout_group = group.rollout_group(policy_version, self.provides_rollout_rewards, self._clock())
        started = self._clock()
        # The documents' scoring-queue metrics: a finished group is scored at once, concurrently with the others
        # (no bounded score queue), so score_queue_size counts the other groups being scored and generation never
        # blocks on scoring (score_block_s is 0).
        self.emit(
            [
                ("rollout/score_queue_size", float(self._scoring)),
                ("rollout/score_wait_s", max(started - (group.done_at if group.done_at is not None else started), 0.0)),
                ("rollout/score_block_s", 0.0),
            ]
        )
        self._scoring += 1
        try:
            return await self._score(group, rollout_group, policy_version, started)
        finally:
            self._scoring -= 1

    async def reward_group(self, rollout_group: Any, *, drop_zero_std_groups: bool) -> ScoredGroup:
        """Rewards, advantages and samples of a finished group: the reward functions here, or their table from the
        `reward_scorer` (a RewardActor) within `reward_timeout_s`. Training and evaluation
        (rlasync.rollout.evaluation) score through it."""
        reward_funcs, columns = self.reward_funcs, None
        timeout_s = self.settings.reward_timeout_s
        if self.reward_scorer is not None:  # reward functions run elsewhere (a RewardActor): their table comes back
            try:
                async with asyncio.timeout(timeout_s):
                    table = await resolve(
                        self.reward_scorer(
                            prompts=rollout_group.prompts,
                            completions=rollout_group.completions,
                            completion_ids=rollout_group.completions_ids,
                            reward_kwargs=rollout_group.reward_kwargs,
                        )
                    )
            except TimeoutError:
                raise RewardTimeoutError(
                    f"the reward actor did not score a group within reward_timeout_s={timeout_s:g} s"
                ) from None
            reward_funcs, columns = [], list(zip(table.names, table.values))
        return await score_group(
            rollout_group,
            reward_funcs,
            compute_advantages=self.compute_advantages,
            function_columns=columns,
            reward_weights=self.settings.reward_weights,
            drop_zero_std_groups=drop_zero_std_groups,
            reward_timeout_s=timeout_s,
        )

    async def _score(self, group: GroupState, rollout_group: Any, policy_version: int, started: float) -> Collected:
        scored = await self.reward_group(rollout_group, drop_zero_std_groups=self.drop_zero_std_groups)
        score_s = self._clock() - started
        if self.completion_samples is not None:
            self.completion_samples.add_group(
                rollout_group.prompts[0] if rollout_group.prompts else "",
                rollout_group.completions,
                [None if r != r else float(r) for r in scored.rewards],
                scored.advantages.tolist(),
                rollout_group.policy_version,
            )
        rollout_tokens = sum(len(s.input_ids) for sequences in rollout_group.completions_sequences for s in sequences)
        result = GroupResult(group.lease, policy_version, scored, num_rollout_tokens=rollout_tokens)
        group.scored = _Scored(rollout_group, result, score_s)
        return Collected(result, not scored.dropped, rollout_tokens if scored.dropped else result.num_tokens)

    def handed_over(self, group: GroupState, collected: Collected, put_s: float, num_inflight: int) -> None:
        rollout_group, result, score_s = group.scored
        self.counters["groups_scored"] += 1
        self.counters["groups_dropped"] += int(result.dropped)
        now = self._clock()
        rate = (float(self._generated_tokens_unreported), now - self._rate_window_start)
        self._generated_tokens_unreported, self._rate_window_start = 0, now
        self.emit(group_metrics(rollout_group, result.scored, score_s, rate, num_inflight, tools=self.has_tools))


def _as_reward_funcs(reward_funcs: RewardFunc | Sequence[RewardFunc] | None) -> list[RewardFunc]:
    if reward_funcs is None:
        return []
    if callable(reward_funcs):
        return [reward_funcs]
    return list(reward_funcs)


__all__ = [
    "NOT_REWARD_KWARGS",
    "GroupResult",
    "GroupSink",
    "RewardScorer",
    "RolloutContext",
    "RolloutPolicy",
]
