"""`AsyncDistillationLoop`: the distillation worker loop (SPEC §9.1) over rlasync engines.

    PromptSource.lease() ──► route(row) ──► student.generate ──► teacher.score(prompt + completion) ──► sink.put
                              (§9.4)         (no log-probs)       (top-k at teacher_top_k)              (one sample)

No groups, no rewards, no tools, no multi-turn: one leased row → one task → one `DistillationSample`. Up to
`max_inflight_tasks` tasks run at once (`-1` → `max(max_staleness, 1) × samples_per_step`). A lease's `group_id`
is the sample's `prompt_id` (the global prompt counter, GRPO's group id with one rollout per prompt).

It talks only to protocols, like `rlasync.rollout.loop.AsyncRolloutLoop` (whose `PromptLease`/`PromptSource`
it reuses): `Engine.generate` / `Engine.score` (student engines 1..E, least loaded first; one teacher engine per
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
"raw log-probs" case of SPEC §9.3: τ then only affects the student side of the loss).

No torch, no ray.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from rlasync.data.prompts import render_prompt, row_prompt
from rlasync.distill.routing import TeacherRouter
from rlasync.distill.samples import DEFAULT_TEACHER_ID, DistillationSample, build_distillation_sample
from rlasync.engine.base import Engine, EngineError, RequestRejectedError, SamplingParams, ScoreResult
from rlasync.metrics import MetricSink, MetricValue
from rlasync.records import GroupOutcome, MetricsCallback, PromptLease, TurnRecord
from rlasync.rewards.text import completion_text
from rlasync.rollout.loop import PromptSource
from rlasync.rollout.task_loop import TaskLoopBase, resolve, tokenizer_eos_ids

logger = logging.getLogger(__name__)

R = TypeVar("R")

FINISH_STOP = "stop"
SEED_BITS = 63
FAILED_TASK_METRIC = "rollout/failed_task_count"
DEFAULT_LOG_COMPLETIONS_STEPS = 100


def resolve_max_inflight_tasks(args: Any, num_ranks: int = 1) -> int:
    """`args.max_inflight_tasks`, or for a negative value `max(max_staleness, 1) × samples_per_step` (SPEC §10;
    `samples_per_step` from `args.samples_per_step` or `per_device_train_batch_size × gradient_accumulation_steps
    × num_ranks`)."""
    value = int(getattr(args, "max_inflight_tasks", -1))
    if value > 0:
        return value
    if value == 0:
        raise ValueError("max_inflight_tasks=0: no task could ever run (use -1 for the default)")
    per_step = getattr(args, "samples_per_step", None)
    if per_step is None:
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * num_ranks
    return max(int(getattr(args, "max_staleness", 1)), 1) * int(per_step)


class AsyncDistillationLoop(TaskLoopBase):
    """Generates with the student, scores with the routed teacher, puts one `DistillationSample` per leased row.

    `args` (duck-typed) needs: `max_completion_length`, `temperature`, `teacher_top_k`; optional `top_k`, `top_p`,
    `min_p`, `repetition_penalty`, `teacher_temperature` (1.0), `max_inflight_tasks` (-1, see
    `resolve_max_inflight_tasks`), `chat_template_kwargs`, `log_completions`, `log_completions_steps` (100),
    `rollout_worker_timeout`. `teachers`: one engine (id "default") or teacher id -> engine in stable order (the
    collator's `teacher_id_idx` order). Run with `await loop.run()`; stop with `await loop.stop()`.
    """

    retryable_exceptions: tuple[type[BaseException], ...] = (EngineError, TimeoutError, ConnectionError)
    task_failure_exceptions: tuple[type[BaseException], ...] = (RequestRejectedError,)
    max_request_attempts: int = 30
    loop_name = "distillation loop"

    def __init__(
        self,
        *,
        args: Any,
        tokenizer: Any,
        student: Engine | Sequence[Engine],
        teachers: Engine | Mapping[str, Engine],
        prompt_source: PromptSource,
        sink: Any,
        metrics_callback: MetricsCallback | None = None,
        policy_version: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        max_inflight_tasks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.students: list[Engine] = list(student) if isinstance(student, Sequence) else [student]
        if not self.students:
            raise ValueError("AsyncDistillationLoop needs at least one student engine")
        self.router: TeacherRouter[Engine] = TeacherRouter(
            teachers if isinstance(teachers, Mapping) else {DEFAULT_TEACHER_ID: teachers}
        )
        self.teacher_top_k = int(args.teacher_top_k)
        if self.teacher_top_k < 0:
            raise ValueError(f"teacher_top_k={self.teacher_top_k} must be >= 0")
        self.teacher_temperature = float(getattr(args, "teacher_temperature", 1.0))
        self._score_takes_temperature = {
            teacher_id: _accepts_keyword(engine.score, "temperature")
            for teacher_id, engine in self.router.teachers.items()
        }
        if self.teacher_temperature != 1.0:
            for teacher_id, supported in self._score_takes_temperature.items():
                if not supported:
                    logger.warning(
                        "teacher %r: Engine.score takes no temperature, so its log-probs are at temperature 1 while "
                        "teacher_temperature=%s (only the student side of the loss is tempered)",
                        teacher_id, self.teacher_temperature,
                    )  # fmt: skip
        self.max_inflight_tasks = (
            int(max_inflight_tasks) if max_inflight_tasks is not None else resolve_max_inflight_tasks(args)
        )
        if self.max_inflight_tasks < 1:
            raise ValueError(f"max_inflight_tasks={self.max_inflight_tasks} must be >= 1")
        self.prompt_source = prompt_source
        self.sink = sink
        self.metrics = MetricSink()
        self._metrics_callback = metrics_callback if metrics_callback is not None else self.metrics.update
        self.policy_version = int(policy_version)
        self.eos_token_ids = frozenset(eos_token_ids) if eos_token_ids is not None else tokenizer_eos_ids(tokenizer)
        self._init_task_loop(wall_clock)
        self._clock, self._sleep = clock, sleep
        self._rng = rng if rng is not None else random.Random()
        self.counters: collections.Counter[str] = collections.Counter()

        self._student_load = [0] * len(self.students)
        self._next_student = 0
        self._tasks: dict[asyncio.Task[Any], PromptLease] = {}
        self._starter: asyncio.Task[PromptLease | None] | None = None
        self._exhausted = False
        self._tokens_since_push = 0
        self._last_push_at = clock()

    # ---- hooks --------------------------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """Prompt ids: the chat template with the generation prompt (and `args.chat_template_kwargs`)."""
        return render_prompt(self.tokenizer, messages, getattr(self.args, "chat_template_kwargs", None))

    def sampling_params(self) -> SamplingParams:
        """The student's sampling settings with a fresh 63-bit seed; no log-probs (the student side is recomputed
        by the learner)."""
        args = self.args
        return SamplingParams(
            max_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_k=getattr(args, "top_k", 0) or 0,
            top_p=getattr(args, "top_p", 1.0),
            min_p=getattr(args, "min_p", None),
            repetition_penalty=getattr(args, "repetition_penalty", 1.0),
            seed=self._rng.getrandbits(SEED_BITS),
            num_logprobs=0,
            return_sampling_mask=False,
        )

    async def generate_and_score_one(
        self, lease: PromptLease
    ) -> tuple[DistillationSample, list[tuple[str, MetricValue]]]:
        """One task (SPEC §9.1's `_generate_and_score_one`): route the row, render its prompt, generate with the
        student, score `prompt + completion` with the row's teacher, build the sample. Returns the sample and its
        per-task metrics (emitted with the push)."""
        started = self._clock()
        policy_version = self.policy_version
        teacher_id, teacher = self.router.route(lease.row)  # an unknown teacher_id stops the loop (SPEC §9.4)
        prompt = row_prompt(lease.row, lease.row_index)
        prompt_ids = self.render(prompt)
        turn = await self._with_retries("student", lambda: self._generate_on_student(prompt_ids))
        completion_ids = [int(t) for t in turn.output_ids]
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=False)
        completion = [{"role": "assistant", "content": text}]
        score_s = 0.0
        scores: ScoreResult | list[Any] = []  # an empty completion has nothing to score: the sample trains no token
        if completion_ids:
            score_started = self._clock()
            token_ids = prompt_ids + completion_ids
            scores = await self._with_retries(
                f"teacher {teacher_id}", lambda: self._score(teacher_id, teacher, token_ids, len(prompt_ids))
            )
            score_s = self._clock() - score_started
        sample = build_distillation_sample(
            prompt_ids, completion_ids, scores, self.teacher_top_k,
            prompt_id=lease.group_id, teacher_id=teacher_id, policy_version=policy_version, row_index=lease.row_index,
            prompt=prompt, completion=completion, enqueued_at=self._wall_clock(),
        )  # fmt: skip
        return sample, self._task_metrics(turn, completion_ids, teacher_id, score_s, self._clock() - started)

    # ---- control ------------------------------------------------------------------------------------------

    def update_policy_version(self, version: int) -> None:
        """The version stamped on samples whose task starts from now on."""
        self.policy_version = int(version)

    @property
    def num_inflight(self) -> int:
        return len(self._tasks)

    # ---- the loop -----------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            self.heartbeat = self._wall_clock()
            await self._handle_finished_tasks()
            if self._stop_requested:
                return
            if self._starter is None and not self._exhausted and len(self._tasks) < self.max_inflight_tasks:
                self._starter = self._spawn(self._next_lease())
            if self._exhausted and not self._tasks and self._starter is None:
                return
            await self._wait_for_news()

    async def _next_lease(self) -> PromptLease | None:
        lease = await resolve(self.prompt_source.lease())
        return None if lease is None else PromptLease.coerce(lease)

    async def _handle_finished_tasks(self) -> None:
        while self._done:
            task = self._done.popleft()
            if task is self._starter:
                self._starter = None
                lease = task.result()  # an error from the prompt source stops the loop
                if lease is None:
                    self._exhausted = True
                else:
                    self._tasks[self._spawn(self._run_task(lease))] = lease
            elif task in self._tasks:
                lease = self._tasks.pop(task)
                if task.cancelled():
                    continue
                error = task.exception()
                if error is None:
                    continue
                if not isinstance(error, self.task_failure_exceptions):
                    raise error
                logger.warning(
                    "prompt %d (row %d) failed and is released: %s: %s",
                    lease.group_id, lease.row_index, type(error).__name__, error,
                )  # fmt: skip
                self.counters["tasks_failed"] += 1
                self._emit([(FAILED_TASK_METRIC, 1.0)])
                await resolve(self.prompt_source.release(lease, GroupOutcome.FAILED))

    async def _run_task(self, lease: PromptLease) -> None:
        """One row -> one sample -> `sink.put`, then the task's metrics."""
        sample, items = await self.generate_and_score_one(lease)
        put_started = self._clock()
        await resolve(self.sink.put(sample))
        backpressure_s = lease.waited_s + (self._clock() - put_started)
        self.counters["samples_put"] += 1
        self._tokens_since_push += sample.num_trained_tokens
        now = self._clock()
        items += [
            ("rollout/backpressure_s", backpressure_s),
            ("rollout/inflight", float(len(self._tasks) - 1)),
            ("rollout/generated_tok_s", (float(self._tokens_since_push), now - self._last_push_at)),
        ]
        self._tokens_since_push, self._last_push_at = 0, now
        self._emit(items)
        self._maybe_log_completion(sample)

    def _task_metrics(
        self, turn: TurnRecord, completion_ids: list[int], teacher_id: str, score_s: float, duration_s: float
    ) -> list[tuple[str, MetricValue]]:
        length = float(len(completion_ids))
        items: list[tuple[str, MetricValue]] = [
            ("completions/mean_length", (length, 1.0)),
            ("rollout/score_s", (score_s, 1.0)),
        ]
        if self.router.is_multi_teacher:
            items.append((f"teacher_score_s/{teacher_id}", (score_s, 1.0)))
        if completion_ids:
            items.append(("completions/clipped_ratio", (float(self._is_clipped(turn, completion_ids)), 1.0)))
        items += [
            ("rollout/duration_s", duration_s),
            ("completions/max_length", length),
            ("completions/min_length", length),
        ]
        return items

    def _is_clipped(self, turn: TurnRecord, completion_ids: list[int]) -> bool:
        """Not ended by EOS: the engine's finish reason when it gave one, else the last token ∉ eos ∪ pad."""
        if turn.finish_reason is not None:
            return turn.finish_reason != FINISH_STOP
        return completion_ids[-1] not in self.eos_token_ids

    def _maybe_log_completion(self, sample: DistillationSample) -> None:
        if not getattr(self.args, "log_completions", False):
            return
        every = int(getattr(self.args, "log_completions_steps", DEFAULT_LOG_COMPLETIONS_STEPS) or 0)
        if every > 0 and self.counters["samples_put"] % every == 0:
            prompt = sample.prompt[-1].get("content", "") if sample.prompt else ""
            print(
                f"[distill] prompt {sample.prompt_id} (policy v{sample.policy_version}, teacher {sample.teacher_id}): "
                f"{prompt}\n  -> {completion_text(sample.completion)}",
                flush=True,
            )

    # ---- engines ------------------------------------------------------------------------------------------

    async def _with_retries(self, what: str, call: Callable[[], Awaitable[R]]) -> R:
        """`call()` with transient errors retried (GRPO's backoff, SPEC §2.5), each counted."""
        return await self._retrying(what, call, self.max_request_attempts)

    async def _generate_on_student(self, prompt_ids: list[int]) -> TurnRecord:
        """One request to the least-loaded student engine (ties: round robin)."""
        count = len(self.students)
        start, self._next_student = self._next_student, (self._next_student + 1) % count
        index = min(((start + k) % count for k in range(count)), key=self._student_load.__getitem__)
        self._student_load[index] += 1
        try:
            return await self.students[index].generate(list(prompt_ids), self.sampling_params())
        finally:
            self._student_load[index] -= 1

    async def _score(self, teacher_id: str, teacher: Engine, token_ids: list[int], prompt_length: int) -> ScoreResult:
        if self._score_takes_temperature[teacher_id]:
            call: Any = teacher.score
            return await call(token_ids, prompt_length, self.teacher_top_k, temperature=self.teacher_temperature)
        return await teacher.score(token_ids, prompt_length, self.teacher_top_k)

    # ---- bookkeeping --------------------------------------------------------------------------------------

    async def _cancel_everything(self) -> None:
        tasks = [*self._tasks, *([self._starter] if self._starter else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task, lease in list(self._tasks.items()):
            if task.cancelled() or task.exception() is not None:
                try:
                    await resolve(self.prompt_source.release(lease, GroupOutcome.CANCELLED))
                except Exception as exc:
                    logger.warning("could not release prompt %d: %s", lease.group_id, exc)
        self._tasks.clear()
        self._starter = None
        self._done.clear()



def _accepts_keyword(function: Any, name: str) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


__all__ = ["AsyncDistillationLoop", "resolve_max_inflight_tasks"]
