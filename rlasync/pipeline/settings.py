"""`QueueSettings`: what the StalenessQueue actor is built from, derived once from the flat config."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig
    from rlasync.packing.step_plan import StepPlan


@dataclass(frozen=True)
class QueueSettings:
    """The queue's prompt stream (`num_rows` dataset rows, `num_epochs` over them or None for an endless stream),
    its staleness gate (`max_staleness` policy versions) and the first step's token target."""

    num_rows: int
    num_epochs: float | None
    max_staleness: int
    tokens_per_step: int = 0
    stream: Any = None
    """A streaming dataset (`rlasync.data.streaming`): the queue leases its rows in order, each lease carrying its
    row; `num_rows` is then 0 and `num_epochs` None (`max_steps` run: the stream repeats) or 1 (one pass)."""
    steps_per_version: int = 1
    """Optimizer steps between weight syncs (`weight_sync_steps`): what one version serves when `max_staleness=0`."""
    samples_per_step: int | None = None
    """Steps of a fixed sample count (else of `tokens_per_step` raw tokens): the unit of the synchronous budget."""
    step_plan: StepPlan | None = None
    """How the learner plans a step (token budget, rows, micro-batches): the queue composes each step with it
    (`rlasync.packing.step_plan`; max_staleness >= 1). None: steps of `tokens_per_step` raw tokens."""

    @classmethod
    def from_config(cls, config: TrainerConfig, *, num_rows: int, tokens_per_step: int = 0) -> QueueSettings:
        """With `max_steps > 0` the stream is endless (the step count ends the run); else it holds
        `num_train_epochs` epochs over distinct prompts."""
        num_epochs = None if config.max_steps > 0 else config.num_train_epochs
        return cls(
            num_rows=num_rows,
            num_epochs=num_epochs,
            max_staleness=config.max_staleness,
            tokens_per_step=tokens_per_step,
            steps_per_version=_steps_per_version(config),
        )

    @classmethod
    def for_dataset(cls, config: TrainerConfig, dataset: Any) -> QueueSettings:
        """`from_config` for an indexed dataset (its length) or a streaming one (one pass, or repeated under
        `max_steps`; see `rlasync.data.streaming`)."""
        from rlasync.data.streaming import is_streaming

        if not is_streaming(dataset):
            return cls.from_config(config, num_rows=len(dataset))
        num_epochs = None if config.max_steps > 0 else 1.0
        return cls(
            num_rows=0,
            num_epochs=num_epochs,
            max_staleness=config.max_staleness,
            stream=dataset,
            steps_per_version=_steps_per_version(config),
        )

    def with_tokens_per_step(
        self, tokens_per_step: int, samples_per_step: int | None = None, step_plan: StepPlan | None = None
    ) -> QueueSettings:
        """A copy with the first step's token target (known once the engines report their max_model_len), the
        step's sample count when steps are a sample count, and the step plan the queue composes steps with."""
        return replace(self, tokens_per_step=tokens_per_step, samples_per_step=samples_per_step, step_plan=step_plan)


__all__ = ["QueueSettings"]


def _steps_per_version(config: TrainerConfig) -> int:
    return int(config.weight_sync_steps or 1)
