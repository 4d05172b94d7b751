"""What the `Learner` trains towards: an objective provides the scorer the model is wrapped in, the planning of a
step's samples into micro-batches, this rank's rows of them, the step core, and the step's own metrics.

The objectives themselves live with their algorithms (`rlasync.algorithms.grpo.objective`,
`rlasync.algorithms.distill.objective`, ...); `LearnerSettings.objective` carries the class, so the learner core
names no algorithm and imports no rollout code.

The step's rows are planned once (`rlasync.learner.sharing.split_step`: the objective's batcher over the whole
step, on the driver over the samples' metadata) and each rank gets only the samples of its own rows, with their
layout (`Objective.layout`); what needs the whole step (the loss normaliser's term counts, a collated batch's
totals) is all-reduced over the ranks from their rows (`Objective.all_reduce`). No Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlasync.learner.metrics import AllReduce, local_all_reduce
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
    all_reduce: AllReduce | None = None
    """(sums, maxes) -> (summed, maxed) over the ranks (`Reducer.all_reduce`); None: one rank."""


class Objective:
    """The parts every objective shares: its settings and rank, the step core it builds, the planning of a step's
    rows, and the count of the step's new units (groups, prompts, ...) under `batch/<unit>_per_step`.

    A subclass names `loss_cls` (the type of `LearnerSettings.loss` it trains with), may set `bucket_rows` (compiled
    layers get rows padded to few shapes, docs/algorithms.md §5.5) and `scorer_cls`, and implements `build`,
    `new_batcher` (the step's planner), `new_row` (an empty row of its kind), `rows` and `step`.

    `plan(samples)` is this rank's rows of the step, one per micro-batch: with a `layout` (set by the Learner from
    its `StepShare`) the rows it names over `samples` (this rank's samples only); without, the whole step planned
    here and this rank's row of every micro-batch kept. A subclass may look at the samples it trains there (and
    call `super().plan`)."""

    scorer_cls: type[TreeScorer] = TreeScorer
    loss_cls: type = object
    bucket_rows = False
    unit = "groups"  # what `batch/<unit>_per_step` counts
    share_prefixes = True  # rows share prompts (GRPO sets it from the model in `build`)

    def __init__(self, settings: LearnerSettings, rank: int, world_size: int) -> None:
        self.settings, self.rank, self.world_size = settings, rank, world_size
        self.step_core: Any = None
        self.seen: set[int] = set()  # units trained so far (a group's samples may span steps)
        self.layout: list[list[int]] | None = None  # this step's rows as positions in the rank's samples
        self.all_reduce: AllReduce = local_all_reduce  # `build` sets the ranks' (StepParts.all_reduce)

    def build(self, parts: StepParts) -> None:
        raise NotImplementedError

    def new_batcher(self) -> Any:
        """The step's planner (`push`/`flush`/`plan` over samples, micro-batches of `world_size` rows)."""
        raise NotImplementedError

    def new_row(self) -> Any:
        """An empty row of the batcher's kind (`add(sample)`)."""
        raise NotImplementedError

    def unfilled_message(self, num_samples: int) -> str:
        """Why a step of `num_samples` samples gave no micro-batch."""
        return f"the step's {num_samples} samples cannot fill one row per rank ({self.world_size})"

    def plan(self, samples: Sequence[Any]) -> list[Any]:
        """This rank's row of every micro-batch (see the class docstring)."""
        if self.layout is None:
            batches = self.new_batcher().plan(list(samples))
            if not batches:
                raise ValueError(self.unfilled_message(len(samples)))
            return [batch.rows[self.rank] for batch in batches]
        rows = []
        for positions in self.layout:
            row = self.new_row()
            for position in positions:
                row.add(samples[position])
            rows.append(row)
        return rows

    def rows(self, rows: Sequence[Any], device: torch.device, pad_id: int) -> StepRows:
        raise NotImplementedError

    def step(self, rows: StepRows) -> dict[str, MetricValue]:
        raise NotImplementedError

    def reduce_step_totals(self, sums: Sequence[float], maxes: Sequence[float] = ()) -> tuple[list[float], list[float]]:
        """`sums` summed and `maxes` maxed over the ranks (one all-reduce pair; exact for integer counts)."""
        summed, maxed = self.all_reduce(
            torch.tensor([*sums, 0.0], dtype=torch.float64), torch.tensor([*maxes, 0.0], dtype=torch.float64)
        )
        return summed.tolist()[: len(sums)], maxed.tolist()[: len(maxes)]

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
