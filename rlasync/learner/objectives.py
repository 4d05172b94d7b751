"""What the `Learner` trains towards: an objective provides the scorer the model is wrapped in, the planning of a
step's samples into micro-batches, this rank's rows of them, the step core, and the step's own metrics.

The objectives themselves live with their algorithms (`rlasync.algorithms.grpo.objective`,
`rlasync.algorithms.distill.objective`, ...); `LearnerSettings.objective` carries the class, so the learner core
names no algorithm and imports no rollout code.

Every rank runs the same deterministic planner over all the step's samples and trains its own row of every
micro-batch; the planner's metrics already cover every rank's rows (rank 0 reports them). No Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlasync.learner.settings import LearnerSettings
from rlasync.metrics import MetricValue
from rlasync.model import TreeScorer

MetricItems = list[tuple[str, Any]]


@dataclass
class StepRows:
    """This rank's rows of one step's micro-batches, with what the Learner logs about them."""

    rows: list[Any]
    forwarded_tokens: int  # this rank's tokens through the model
    trained_tokens: int  # this rank's loss terms
    planner_items: MetricItems = field(default_factory=list)  # rank 0 only: the planner's metrics (all ranks)
    global_terms: list[float] | None = None  # GRPO: each micro-batch's loss terms over all ranks (the normaliser)


@dataclass(frozen=True)
class StepParts:
    """What the Learner hands an objective to build its step core (one rank, after the model is ready)."""

    scorer: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    rank: int
    world_size: int
    device: torch.device
    clip_grad_norm: Callable[[float], torch.Tensor]
    autocast_dtype: torch.dtype | None
    sum_across_ranks: Callable[[torch.Tensor], torch.Tensor] | None  # None: one rank


class Objective:
    """The parts every objective shares: its settings and rank, the step core it builds, and the count of the
    step's new units (groups, prompts, ...) under `batch/<unit>_per_step`.

    A subclass names `loss_cls` (the type of `LearnerSettings.loss` it trains with), may set `bucket_rows` (compiled
    layers get rows padded to few shapes, docs/algorithms.md §5.5) and `scorer_cls`, and implements `build`, `plan`,
    `rows` and `step`."""

    scorer_cls: type[TreeScorer] = TreeScorer
    loss_cls: type = object
    bucket_rows = False
    unit = "groups"  # what `batch/<unit>_per_step` counts

    def __init__(self, settings: LearnerSettings, rank: int, world_size: int) -> None:
        self.settings, self.rank, self.world_size = settings, rank, world_size
        self.step_core: Any = None
        self.seen: set[int] = set()  # units trained so far (a group's samples may span steps)

    def build(self, parts: StepParts) -> None:
        raise NotImplementedError

    def plan(self, samples: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def rows(self, batches: Sequence[Any], device: torch.device, pad_id: int) -> StepRows:
        raise NotImplementedError

    def step(self, rows: StepRows) -> dict[str, MetricValue]:
        raise NotImplementedError

    @staticmethod
    def unit_of(sample: Any) -> int:
        return int(sample.group_id)

    def step_items(self, samples: Sequence[Any]) -> MetricItems:
        """`batch/<unit>_per_step`: the units whose first samples this step trained."""
        new = {self.unit_of(sample) for sample in samples} - self.seen
        self.seen |= new
        return [(f"batch/{self.unit}_per_step", float(len(new)))]


def make_objective(settings: LearnerSettings, rank: int, world_size: int) -> Objective:
    """The objective class `settings.objective` carries, for this rank."""
    return settings.objective(settings, rank, world_size)


__all__ = ["MetricItems", "Objective", "StepParts", "StepRows", "make_objective"]
