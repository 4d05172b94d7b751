"""Which samples of a step go to which learner rank, decided once (docs/design.md §6.2).

The step's rows are planned once, by the objective's own batcher (`Objective.new_batcher`: GRPO's token-budget /
fixed-count tree batcher balancing attention cost, distillation's Σ L² batcher) over the whole step, in the order
the queue handed the samples out; each rank is then sent only the samples of its own rows, with their layout:

    shares = split_step(objective, samples)   # on the driver, over the samples' metadata (`plan_samples`)
    rank r: learner.train_step([samples[i] for i in shares[r].indices], share=shares[r])

The planner reads only a sample's token ids, group, trained-token count and its per-sample metrics (for the
planner's metrics), so the driver plans over `PlanSample`s made from the queue's entries (`plan_samples`), which
carry exactly those: the rows are the ones each rank would have planned from the full samples. What needs the
whole step stays global: the planner's metrics (`batch/row_imbalance`, ...), `batch/samples_per_step` and
`batch/<unit>_per_step` are computed here and reported by rank 0; the loss normalisers' term counts are
all-reduced by the ranks from their rows (`Objective.rows`). No torch, no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlasync.packing.step_plan import PlanSample

MetricItems = list[tuple[str, Any]]


@dataclass(frozen=True)
class StepShare:
    """One rank's part of a step.

    indices:        the step's samples this rank gets (positions in the step's list), in the order it gets them
    layout:         per micro-batch, this rank's row as positions in its own samples, in the row's order
    planner_items:  rank 0: the planner's metrics of every micro-batch (all ranks' rows); [] elsewhere
    step_items:     rank 0: `batch/samples_per_step`, `batch/<unit>_per_step`, `batch/tail_planned_count` and
                    `batch/unplanned_count` of the whole step; [] elsewhere
    unplanned:      the step's samples in no rank's row (positions; the same on every rank): a short tail the
                    planner could place nowhere (docs/algorithms.md §4.5.2), trained by no rank
    """

    rank: int
    world_size: int
    indices: list[int]
    layout: list[list[int]]
    planner_items: MetricItems = field(default_factory=list)
    step_items: MetricItems = field(default_factory=list)
    unplanned: list[int] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        """Samples this rank gets."""
        return len(self.indices)


def split_step(objective: Any, samples: Sequence[Any]) -> list[StepShare]:
    """Plan the step's rows with `objective`'s batcher (its world size, budget and prefix sharing) and give each
    rank the samples of its rows. A short tail (fewer samples than ranks left at the end) is planned into the
    step's rows where it can be (`plan`, docs/algorithms.md §4.5.2); what could not is `unplanned` and counted,
    `batch/unplanned_count` (the driver tells the queue: `QueueState.unplanned_samples`), and an oversize sample
    is dropped by the planner (`batch/dropped_oversize_count`): both go to no rank. Updates `objective.seen` (the
    step's new units)."""
    samples = list(samples)
    batcher = objective.new_batcher()
    batches = batcher.plan(samples)
    if not batches:
        raise ValueError(objective.unfilled_message(len(samples)))
    world = objective.world_size
    position = {id(sample): i for i, sample in enumerate(samples)}
    indices: list[list[int]] = [[] for _ in range(world)]
    layouts: list[list[list[int]]] = [[] for _ in range(world)]
    for batch in batches:
        if len(batch.rows) != world:
            raise ValueError(f"split_step: a micro-batch of {len(batch.rows)} rows for {world} ranks")
        for rank, row in enumerate(batch.rows):
            mine = indices[rank]
            layouts[rank].append(list(range(len(mine), len(mine) + row.num_samples)))
            mine += [position[id(sample)] for sample in row.samples]
    planner_items = [item for batch in batches for item in batch.metrics().items()]
    unplanned = sorted(position[id(sample)] for sample in batcher.pending)
    left_out = set(unplanned)
    trained = [sample for i, sample in enumerate(samples) if i not in left_out]
    step_items = [
        ("batch/samples_per_step", float(len(samples))),
        *objective.step_items(trained),
        ("batch/tail_planned_count", float(getattr(batcher, "tail_planned_count", 0))),
        ("batch/unplanned_count", float(len(unplanned))),
    ]
    return [
        StepShare(
            rank=rank,
            world_size=world,
            indices=indices[rank],
            layout=layouts[rank],
            planner_items=planner_items if rank == 0 else [],
            step_items=step_items if rank == 0 else [],
            unplanned=unplanned,
        )
        for rank in range(world)
    ]


def plan_samples(entries: Sequence[Any]) -> list[PlanSample] | None:
    """What the planner reads of each queue entry (`QueueEntry`: token ids, group, trained tokens, per-sample
    metrics), or None when an entry carries no token ids (then the step cannot be split ahead: every rank gets the
    whole step and plans it itself)."""
    out = []
    for entry in entries:
        ids = getattr(entry, "input_ids", None)
        if ids is None:
            return None
        metrics = getattr(entry, "metrics", None) or {}
        out.append(PlanSample(np.asarray(ids), int(entry.group_id), int(entry.num_trained_tokens), dict(metrics)))
    return out


class StepSplitter:
    """The driver's side of the split: one planning objective for the run (its `seen` units carry over steps), so
    each step's shares come from the queue's entries alone.

    `objective`: the learners' objective class for rank 0 (`settings.objective(settings, 0, world_size)`) with the
    learners' `share_prefixes` (rank 0's `Learner.info()`)."""

    def __init__(self, objective: Any) -> None:
        self.objective = objective

    @classmethod
    def for_learners(cls, settings: Any, world_size: int, share_prefixes: bool = True) -> StepSplitter:
        objective = settings.objective(settings, 0, world_size)
        objective.share_prefixes = share_prefixes
        return cls(objective)

    def split(self, entries: Sequence[Any]) -> list[tuple[list[Any], StepShare]] | None:
        """Per rank: (the payloads of its samples, its share); None when the entries cannot be planned here."""
        planned = plan_samples(entries)
        if planned is None:
            return None
        return [([entries[i].payload for i in share.indices], share) for share in split_step(self.objective, planned)]


__all__ = ["StepShare", "StepSplitter", "plan_samples", "split_step"]
