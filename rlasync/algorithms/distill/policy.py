"""`DistillationPolicy`: what one on-policy distillation task is (docs/algorithms.md §9.1) — render, sample with the student,
score with the routed teacher, build the `DistillationSample` — and its metrics.

The task scheduler (`rlasync.rollout.scheduler`) runs it with one task per lease (a distillation "group" is one
sample) and counts a sample being handed to the sink as in flight (`hand_over_holds_slots`: a full queue holds
generation back). Student requests and teacher scores go through the engine pool's retry path
(`rlasync.rollout.engine_pool`). No torch, no ray.
"""

from __future__ import annotations

import collections
import inspect
import logging
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlasync.algorithms.distill.routing import TeacherRouter
from rlasync.algorithms.distill.samples import DEFAULT_TEACHER_ID, DistillationSample, build_distillation_sample
from rlasync.algorithms.distill.settings import TeacherSettings
from rlasync.data.prompts import render_prompt, row_prompt
from rlasync.engine.base import Engine, RequestRejectedError, SamplingParams, ScoreResult
from rlasync.records import MetricItem, PromptLease, TurnRecord
from rlasync.rewards.text import completion_text
from rlasync.rollout.engine_pool import EnginePool
from rlasync.rollout.protocols import Collected, PolicyBase
from rlasync.rollout.sequences import is_clipped, tokenizer_eos_ids
from rlasync.rollout.settings import RolloutSettings

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

logger = logging.getLogger("rlasync.algorithms.distill.loop")  # the loop's logger, as before the split
SEED_BITS = 63
FAILED_TASK_METRIC = "rollout/failed_task_count"


@dataclass(slots=True)
class _Task:
    """One leased row on its way to the sink."""

    lease: PromptLease
    waited_s: float
    items: list[MetricItem] = field(default_factory=list)
    """The task's metrics, emitted with its push."""


class TeacherRejectedError(RequestRejectedError):
    """The row's teacher rejected its scoring request (e.g. prompt + completion longer than the teacher's
    max_model_len): the task fails (dropped as "failed", counted under a `teacher_*` cause), never retried."""


class DistillationPolicy(PolicyBase):
    """The distillation policy (see the module docstring); `AsyncDistillationLoop` assembles it with a scheduler."""

    task_failure_exceptions: tuple[type[BaseException], ...] = (RequestRejectedError,)
    hand_over_holds_slots = True
    failure_metric = FAILED_TASK_METRIC

    _metrics_callback: Callable[[list[MetricItem]], Any]
    counters: collections.Counter[str]
    policy_version: int  # the scheduler's (`ScheduledLoop.policy_version`)

    def _init_policy(
        self,
        *,
        config: TrainerConfig,
        tokenizer: Any,
        settings: RolloutSettings,
        scoring: TeacherSettings,
        engine_pool: EnginePool,
        teachers: Engine | Mapping[str, Engine],
        eos_token_ids: Iterable[int] | None,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        rng: random.Random | None,
    ) -> None:
        self.config = self.args = config
        self.tokenizer, self.settings, self.engine_pool = tokenizer, settings, engine_pool
        self.router: TeacherRouter[Engine] = TeacherRouter(
            teachers if isinstance(teachers, Mapping) else {DEFAULT_TEACHER_ID: teachers}
        )
        self.teacher_top_k = scoring.teacher_top_k
        self.teacher_temperature = scoring.teacher_temperature
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
                        teacher_id,
                        self.teacher_temperature,
                    )
        self.eos_token_ids = frozenset(eos_token_ids) if eos_token_ids is not None else tokenizer_eos_ids(tokenizer)
        self._clock, self._wall_clock = clock, wall_clock
        self._rng = rng if rng is not None else random.Random()
        self._tokens_since_push = 0
        self._last_push_at = clock()

    # ---- hooks (and `emit`, `setup`, `close` of PolicyBase) ----------------------------------------------

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """Prompt ids: the chat template with the generation prompt (and `chat_template_kwargs`)."""
        return render_prompt(self.tokenizer, messages, self.settings.chat_template_kwargs)

    def sampling_params(self) -> SamplingParams:
        """The student's sampling settings with a fresh 63-bit seed; no log-probs (the student side is recomputed
        by the learner)."""
        return self.settings.sampling.with_seed(self._rng.getrandbits(SEED_BITS))

    async def generate_and_score_one(
        self, lease: PromptLease, policy_version: int | None = None
    ) -> tuple[DistillationSample, list[MetricItem]]:
        """One task (docs/algorithms.md §9.1's `_generate_and_score_one`): route the row, render its prompt, generate with the
        student, score `prompt + completion` with the row's teacher, build the sample. Returns the sample and its
        per-task metrics (emitted with the push). `policy_version`: the version read when the task started."""
        started = self._clock()
        if policy_version is None:
            policy_version = self.policy_version
        teacher_id, teacher = self.router.route(
            lease.row
        )  # an unknown teacher_id stops the loop (docs/algorithms.md §9.4)
        prompt = row_prompt(lease.row, lease.row_index)
        prompt_ids = self.render(prompt)
        turn = await self.engine_pool.generate(prompt_ids, self.sampling_params(), what="student")
        completion_ids = [int(t) for t in turn.output_ids]
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=False)
        completion = [{"role": "assistant", "content": text}]
        score_s = 0.0
        scores: ScoreResult | list[Any] = []  # an empty completion has nothing to score: the sample trains no token
        if completion_ids:
            score_started = self._clock()
            token_ids = prompt_ids + completion_ids
            try:
                scores = await self.engine_pool.retrying(
                    f"teacher {teacher_id}", lambda: self._score(teacher_id, teacher, token_ids, len(prompt_ids))
                )
            except RequestRejectedError as exc:  # told apart from the student's rejection in `failure_cause`
                raise TeacherRejectedError(f"teacher {teacher_id!r} rejected the scoring request: {exc}") from exc
            score_s = self._clock() - score_started
        sample = build_distillation_sample(
            prompt_ids,
            completion_ids,
            scores,
            self.teacher_top_k,
            prompt_id=lease.group_id,
            teacher_id=teacher_id,
            policy_version=policy_version,
            row_index=lease.row_index,
            prompt=prompt,
            completion=completion,
            enqueued_at=self._wall_clock(),
        )
        return sample, self._task_metrics(turn, completion_ids, teacher_id, score_s, self._clock() - started)

    # ---- the scheduler's calls (TaskPolicy) ----------------------------------------------------------------

    def is_group_failure(self, error: BaseException) -> bool:
        """A rejected request (student or teacher) fails only its task; transient errors were retried by the
        engine pool; anything else (retries used up, a dead teacher) stops the loop with its error."""
        return isinstance(error, self.task_failure_exceptions)

    def failure_cause(self, error: BaseException) -> str:
        """The cause a failed task is counted under (the watchdog's reason), as GRPO's: "too_long" (the student
        rejected a prompt over max_model_len), "rejected"; the teacher's: "teacher_too_long", "teacher_rejected"."""
        prefix = "teacher_" if isinstance(error, TeacherRejectedError) else ""
        if isinstance(error, RequestRejectedError):
            too_long = "max_model_len" in str(getattr(error, "cause", None) or error)
            return prefix + ("too_long" if too_long else "rejected")
        return "error"

    def after_close(self) -> None:
        """Nothing of its own to release."""

    async def admit(self, lease: PromptLease, waited_s: float) -> _Task:
        return _Task(lease, waited_s)

    async def run_task(
        self, task: _Task, index: int, policy_version: int
    ) -> tuple[DistillationSample, list[MetricItem]]:
        return await self.generate_and_score_one(task.lease, policy_version)

    def record(self, task: _Task, index: int, result: tuple[DistillationSample, list[MetricItem]]) -> None:
        """Nothing yet: a task's metrics are emitted with its push."""

    async def collect(self, task: _Task, results: list[Any], policy_version: int) -> Collected:
        (sample, items) = results[0]
        task.items = items
        return Collected(sample, True, len(sample))

    def handed_over(self, task: _Task, collected: Collected, put_s: float, num_inflight: int) -> None:
        """The push's metrics: lease wait + time blocked in `sink.put`, other tasks in flight, generated tokens
        per second since the previous push."""
        sample: DistillationSample = collected.item
        self.counters["samples_put"] += 1
        self._tokens_since_push += sample.num_trained_tokens
        now = self._clock()
        items = task.items + [
            ("rollout/backpressure_s", task.waited_s + put_s),
            ("rollout/inflight", float(num_inflight - 1)),
            ("rollout/generated_tok_s", (float(self._tokens_since_push), now - self._last_push_at)),
        ]
        self._tokens_since_push, self._last_push_at = 0, now
        self.emit(items)
        self._maybe_log_completion(sample)

    # ---- metrics and teachers -----------------------------------------------------------------------------

    def _task_metrics(
        self, turn: TurnRecord, completion_ids: list[int], teacher_id: str, score_s: float, duration_s: float
    ) -> list[MetricItem]:
        length = float(len(completion_ids))
        items: list[MetricItem] = [("completions/mean_length", (length, 1.0)), ("rollout/score_s", (score_s, 1.0))]
        if self.router.is_multi_teacher:
            items.append((f"teacher_score_s/{teacher_id}", (score_s, 1.0)))
        if completion_ids:
            clipped = is_clipped(turn, completion_ids, self.eos_token_ids)
            items.append(("completions/clipped_ratio", (float(clipped), 1.0)))
        items += [
            ("rollout/duration_s", duration_s),
            ("completions/max_length", length),
            ("completions/min_length", length),
        ]
        return items

    def _maybe_log_completion(self, sample: DistillationSample) -> None:
        if not self.settings.log_completions:
            return
        every = self.settings.log_completions_steps
        if every > 0 and self.counters["samples_put"] % every == 0:
            prompt = sample.prompt[-1].get("content", "") if sample.prompt else ""
            print(
                f"[distill] prompt {sample.prompt_id} (policy v{sample.policy_version}, teacher {sample.teacher_id}): "
                f"{prompt}\n  -> {completion_text(sample.completion)}",
                flush=True,
            )

    async def _score(self, teacher_id: str, teacher: Engine, token_ids: list[int], prompt_length: int) -> ScoreResult:
        if self._score_takes_temperature[teacher_id]:
            call: Any = teacher.score
            return await call(token_ids, prompt_length, self.teacher_top_k, temperature=self.teacher_temperature)
        return await teacher.score(token_ids, prompt_length, self.teacher_top_k)


def _accepts_keyword(function: Any, name: str) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


__all__ = ["FAILED_TASK_METRIC", "DistillationPolicy", "TeacherRejectedError"]
