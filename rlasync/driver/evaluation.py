"""Evaluation during training, on the driver's side (pure asyncio, no Ray): when an evaluation is due and running
it in the background so that the step loop never waits for it.

    EvalSchedule.from_config(config, horizon, steps_per_epoch)   eval_strategy "no" | "steps" | "epoch", eval_steps
    BackgroundEvaluations(evaluate, schedule)                    the StepLoop's hook:
        after_step(step, version)  -> a due evaluation starts as an asyncio task (`evaluate(version)`: the
                                      generation engines sample the held-out prompts next to the training rollouts)
        finished()                 -> (step, metrics) of the evaluations done since the last call, in step order
        finish()                   -> waits for the ones still running (the end of the run)

The metrics are `eval/...` (rlasync.rollout.evaluation) tagged with the step whose policy was evaluated; the step
loop logs them when they arrive. At most `max_inflight` evaluations run at once: one that falls due while that
many still run is skipped with a warning (evaluations slower than `eval_steps` steps would pile up on the engines).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlasync.config.trl_fields import EVAL_STRATEGIES

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

logger = logging.getLogger(__name__)


def _strategy(value: Any) -> str:
    return str(getattr(value, "value", value))  # transformers' IntervalStrategy compares by its string value


def check_eval_fields(config: TrainerConfig, has_eval_dataset: bool) -> None:
    """The eval settings against the eval dataset (transformers' rule: a strategy other than "no" needs an
    `eval_dataset`); `eval_strategy` / `eval_steps` themselves are checked with the config."""
    strategy = _strategy(config.eval_strategy)
    if strategy != "no" and not has_eval_dataset:
        raise ValueError(
            f"eval_strategy={strategy!r} evaluates on held-out prompts: pass eval_dataset= to the trainer "
            "(a dataset with a 'prompt' column), or set eval_strategy='no'"
        )


@dataclass(frozen=True)
class EvalSchedule:
    """Evaluate after every `every` steps (None: never periodically) and, with `at_end`, after the run's last step
    when the last evaluation was not there (an epoch run's final epoch)."""

    every: int | None
    at_end: bool = False

    @classmethod
    def from_config(cls, config: TrainerConfig, horizon: int | None, steps_per_epoch: int) -> EvalSchedule:
        """transformers' rules: "steps" every `eval_steps` (unset: `logging_steps`; a fraction: of `max_steps`),
        "epoch" at the end of every epoch (`steps_per_epoch`, estimated from the dataset: steps by tokens vary)."""
        strategy = _strategy(config.eval_strategy)
        if strategy == "no":
            return cls(None)
        if strategy == "epoch":
            return cls(max(1, steps_per_epoch) if steps_per_epoch > 0 else None, at_end=True)
        value = config.eval_steps if config.eval_steps is not None else config.logging_steps
        if value >= 1:
            return cls(int(value))
        if horizon is None:
            raise ValueError(
                f"eval_steps={value} is a fraction of max_steps, but the run has no horizon: set max_steps"
            )
        return cls(max(1, math.ceil(value * horizon)))

    def due(self, step: int) -> bool:
        return self.every is not None and step > 0 and step % self.every == 0


class BackgroundEvaluations:
    """Runs `evaluate(version) -> metrics` in the background at the steps `schedule` names (see the module
    docstring); `clock` times each evaluation (`eval/wall_s`: from its start to its metrics)."""

    def __init__(
        self,
        evaluate: Callable[[int], Awaitable[dict[str, float]]],
        schedule: EvalSchedule,
        *,
        max_inflight: int = 2,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.evaluate, self.schedule = evaluate, schedule
        self.max_inflight, self.clock = max_inflight, clock
        self.running: list[tuple[int, asyncio.Task[dict[str, float]]]] = []
        self.last_started: int | None = None
        self.skipped = 0

    def after_step(self, step: int, version: int) -> bool:
        """Start the evaluation of `step` (the engines serve `version`) if one is due; True if it started."""
        if not self.schedule.due(step):
            return False
        return self.start(step, version)

    def start(self, step: int, version: int) -> bool:
        if len(self.running) >= self.max_inflight:
            self.skipped += 1
            logger.warning(
                "evaluation at step %d skipped: %d evaluations still run (they take longer than eval_steps=%s "
                "steps; raise eval_steps or shrink eval_dataset / num_generations_eval)",
                step,
                len(self.running),
                self.schedule.every,
            )
            return False
        self.last_started = step
        self.running.append((step, asyncio.ensure_future(self._timed(step, version))))
        return True

    async def _timed(self, step: int, version: int) -> dict[str, float]:
        started = self.clock()
        try:
            metrics = dict(await self.evaluate(version))
        except Exception as exc:  # raised by finished(): the run stops, saying it was the evaluation
            raise RuntimeError(f"the evaluation of step {step} (eval_dataset) failed: {exc}") from exc
        metrics["eval/wall_s"] = self.clock() - started
        return metrics

    def finished(self) -> list[tuple[int, dict[str, float]]]:
        """The evaluations done since the last call, in step order (an evaluation that failed raises here)."""
        done = [(step, task) for step, task in self.running if task.done()]
        self.running = [(step, task) for step, task in self.running if not task.done()]
        return [(step, task.result()) for step, task in done]

    async def finish(self, final_step: int | None = None, version: int = 0) -> list[tuple[int, dict[str, float]]]:
        """The end of the run: with `schedule.at_end`, evaluate `final_step` unless it was just evaluated; then wait
        for every evaluation still running and return all that were not collected yet."""
        if self.schedule.at_end and final_step and self.last_started != final_step:
            self.start(final_step, version)
        if self.running:
            await asyncio.wait([task for _, task in self.running])
        return self.finished()

    def cancel(self) -> None:
        """Stop the evaluations still running (the run failed or was interrupted)."""
        for _, task in self.running:
            task.cancel()
        self.running = []


__all__ = ["EVAL_STRATEGIES", "BackgroundEvaluations", "EvalSchedule", "check_eval_fields"]
