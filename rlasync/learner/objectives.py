"""What the `Learner` trains towards: an objective provides the scorer the model is wrapped in, the planning of a
step's samples into micro-batches, this rank's rows of them, the step core, and the step's own metrics.

    GrpoObjective            TokenBudgetBatcher / FixedCountBatcher (rlasync.packing) -> tree-packed rows
                             -> LearnerStep (grpo_loss, docs/algorithms.md §5) ; batch/groups_per_step
    DistillationObjective    TokenBudgetBatcher / FixedCountBatcher (rlasync.distill) -> plain padding-free rows
                             (Σ L² balanced, docs/algorithms.md §9.5) -> DistillLearnerStep (docs/algorithms.md §9.3) ; batch/prompts_per_step

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
    step's new groups (GRPO) or prompts (distillation) under `batch/<unit>_per_step`."""

    scorer_cls: type[TreeScorer] = TreeScorer
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


class GrpoObjective(Objective):
    """Asynchronous GRPO on tree-packed rows (`LearnerStep`); counts `batch/groups_per_step`. A model with
    linear-attention layers is planned padding-free (every sample its own chain, docs/algorithms.md §4.3)."""

    share_prefixes = True  # set by `build` from the model

    def build(self, parts: StepParts) -> None:
        from rlasync.learner.step import LearnerStep
        from rlasync.model.attention import has_linear_attention

        settings = self.settings
        # linear-attention (gated DeltaNet) layers cannot share a prefix: such models train padding-free
        self.share_prefixes = not has_linear_attention(getattr(parts.scorer, "model", parts.scorer))
        self.step_core = LearnerStep(
            parts.scorer,
            parts.optimizer,
            parts.scheduler,
            settings.loss,
            temperature=settings.temperature,
            max_grad_norm=settings.max_grad_norm,
            num_ranks=self.world_size,
            device=parts.device,
            clip_grad_norm=parts.clip_grad_norm,
            autocast_dtype=parts.autocast_dtype,
            row_bucket=settings.row_bucket,
        )

    def plan(self, samples: Sequence[Any]) -> list[Any]:
        from rlasync.packing import FixedCountBatcher, TokenBudgetBatcher

        share = self.share_prefixes
        if self.settings.token_budget > 0:
            batcher: Any = TokenBudgetBatcher(self.world_size, self.settings.token_budget, share_prefixes=share)
        else:
            batcher = FixedCountBatcher(
                self.world_size, self.settings.per_device_train_batch_size, share_prefixes=share
            )
        batches = batcher.plan(list(samples))
        if not batches:
            raise ValueError(f"the step's {len(samples)} samples cannot fill one row per rank ({self.world_size})")
        return batches

    def rows(self, batches: Sequence[Any], device: torch.device, pad_id: int) -> StepRows:
        out = StepRows(rows=[], forwarded_tokens=0, trained_tokens=0, global_terms=[])
        for batch in batches:
            packed = batch.pack()
            mine = packed[self.rank]
            out.rows.append(mine)
            out.global_terms.append(float(sum(len(row.target_ids) for row in packed)))  # type: ignore[union-attr]
            out.forwarded_tokens += len(mine.input_ids)
            out.trained_tokens += len(mine.target_ids)
            if self.rank == 0:
                out.planner_items += list(batch.metrics().items())  # planner metrics already cover every rank's rows
        return out

    def step(self, rows: StepRows) -> dict[str, MetricValue]:
        return self.step_core.step(rows.rows, rows.global_terms, rate_pairs=True)


class DistillationObjective(Objective):
    """On-policy distillation on plain padding-free rows (`DistillLearnerStep` over a `DistillScorer`); counts
    `batch/prompts_per_step` (one sample per prompt, docs/algorithms.md §9.6)."""

    unit = "prompts"

    def __init__(self, settings: LearnerSettings, rank: int, world_size: int) -> None:
        super().__init__(settings, rank, world_size)
        from rlasync.learner.distill import DistillScorer

        self.scorer_cls = DistillScorer
        self.teacher_ids = list(settings.teacher_ids)

    @staticmethod
    def unit_of(sample: Any) -> int:
        return int(sample.prompt_id)

    def build(self, parts: StepParts) -> None:
        from rlasync.learner.distill import DistillLearnerStep

        self.step_core = DistillLearnerStep(
            parts.scorer,
            parts.optimizer,
            parts.scheduler,
            self.settings.loss,  # type: ignore[arg-type]
            max_grad_norm=self.settings.max_grad_norm,
            num_ranks=self.world_size,
            device=parts.device,
            teacher_ids=self.teacher_ids,
            clip_grad_norm=parts.clip_grad_norm,
            autocast_dtype=parts.autocast_dtype,
            reduce_stats=parts.sum_across_ranks,
        )

    def plan(self, samples: Sequence[Any]) -> list[Any]:
        from rlasync.distill import FixedCountBatcher, TokenBudgetBatcher

        budget = self.settings.token_budget
        if budget > 0:
            batcher: Any = TokenBudgetBatcher(self.world_size, budget)
        else:
            batcher = FixedCountBatcher(self.world_size, self.settings.per_device_train_batch_size * self.world_size)
        batches = batcher.plan(list(samples))
        if not batches:
            raise ValueError(
                f"the step's {len(samples)} distillation samples cannot fill one row per rank ({self.world_size}) "
                f"within token_budget={budget}: raise token_budget or lower max_completion_length"
            )
        return batches

    def rows(self, batches: Sequence[Any], device: torch.device, pad_id: int) -> StepRows:
        """Plain padding-free rows (Σ L² balanced, docs/algorithms.md §9.5), one per rank and micro-batch."""
        from rlasync.learner.distill import distill_row_tensors
        from rlasync.model.tree_mask import resolve_backend

        varlen = resolve_backend(self.settings.kernels.tree_attention, device) == "varlen"  # planned on the host
        teacher_ids = self.teacher_ids if len(self.teacher_ids) > 1 else None
        out = StepRows(rows=[], forwarded_tokens=0, trained_tokens=0)
        for batch in batches:
            row = distill_row_tensors(batch.collate(pad_id, teacher_ids), self.rank, device, segments=varlen)
            out.rows.append(row)
            out.forwarded_tokens += row.num_tokens
            out.trained_tokens += row.num_trained_tokens
            if self.rank == 0:
                out.planner_items += list(batch.metrics().items())  # planner metrics already cover every rank's rows
        return out

    def step(self, rows: StepRows) -> dict[str, MetricValue]:
        return self.step_core.step(rows.rows, rate_pairs=True)


OBJECTIVES: dict[str, type[Objective]] = {"grpo": GrpoObjective, "distill": DistillationObjective}


def make_objective(settings: LearnerSettings, rank: int, world_size: int) -> Objective:
    """The objective `settings.objective` names."""
    return OBJECTIVES[settings.objective](settings, rank, world_size)


__all__ = [
    "OBJECTIVES",
    "DistillationObjective",
    "GrpoObjective",
    "Objective",
    "StepParts",
    "StepRows",
    "make_objective",
]
