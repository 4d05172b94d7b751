"""Distillation's learner objective: plain padding-free rows (Σ L² balanced, docs/algorithms.md §9.5;
`rlasync.algorithms.distill.batching`) -> `DistillLearnerStep` (docs/algorithms.md §9.3); counts
`batch/prompts_per_step` (one sample per prompt, §9.6). Runs on a learner rank: imports no rollout code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rlasync.algorithms.distill.loss import DistillLossConfig
from rlasync.learner.objectives import Objective, StepParts, StepRows
from rlasync.learner.settings import LearnerSettings
from rlasync.metrics import MetricValue


class DistillationObjective(Objective):
    """On-policy distillation on plain padding-free rows (`DistillLearnerStep` over a `DistillScorer`); counts
    `batch/prompts_per_step` (one sample per prompt, docs/algorithms.md §9.6)."""

    loss_cls = DistillLossConfig
    unit = "prompts"

    def __init__(self, settings: LearnerSettings, rank: int, world_size: int) -> None:
        super().__init__(settings, rank, world_size)
        from rlasync.algorithms.distill.learner_step import DistillScorer

        self.scorer_cls = DistillScorer
        self.teacher_ids = list(settings.teacher_ids)

    @staticmethod
    def unit_of(sample: Any) -> int:
        return int(sample.prompt_id)

    def build(self, parts: StepParts) -> None:
        from rlasync.algorithms.distill.learner_step import DistillLearnerStep

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
        if parts.all_reduce is not None:
            self.all_reduce = parts.all_reduce

    def new_batcher(self) -> Any:
        from rlasync.algorithms.distill.batching import FixedCountBatcher, TokenBudgetBatcher

        budget = self.settings.token_budget
        if budget > 0:
            return TokenBudgetBatcher(self.world_size, budget)
        return FixedCountBatcher(self.world_size, self.settings.per_device_train_batch_size * self.world_size)

    def new_row(self) -> Any:
        from rlasync.algorithms.distill.batching import DistillRow

        return DistillRow()

    def unfilled_message(self, num_samples: int) -> str:
        return (
            f"the step's {num_samples} distillation samples cannot fill one row per rank ({self.world_size}) "
            f"within token_budget={self.settings.token_budget}: raise token_budget or lower max_completion_length"
        )

    def rows(self, rows: Sequence[Any], device: torch.device, pad_id: int) -> StepRows:
        """Plain padding-free rows (Σ L² balanced, docs/algorithms.md §9.5), this rank's of every micro-batch; each
        micro-batch's completion tokens over all ranks (the normaliser) and its teacher width (the candidates'
        padding) all-reduced."""
        from rlasync.algorithms.distill.batching import collate_rows
        from rlasync.algorithms.distill.learner_step import distill_row_tensors
        from rlasync.model.tree_mask import resolve_backend

        varlen = resolve_backend(self.settings.kernels.tree_attention, device) == "varlen"  # planned on the host
        teacher_ids = self.teacher_ids if len(self.teacher_ids) > 1 else None
        n_tokens, widths = self.reduce_step_totals(
            [float(row.num_trained_tokens) for row in rows],
            [float(max(sample.width for sample in row.samples)) for row in rows],
        )
        out = StepRows(rows=[], forwarded_tokens=0, trained_tokens=0)
        for row, total, width in zip(rows, n_tokens, widths, strict=True):
            batch = collate_rows([row], pad_id, teacher_ids, width=int(width))
            batch["global_n_tokens"] = np.full(1, int(total), dtype=np.int64)
            tensors = distill_row_tensors(batch, 0, device, segments=varlen)
            out.rows.append(tensors)
            out.forwarded_tokens += tensors.num_tokens
            out.trained_tokens += tensors.num_trained_tokens
        return out

    def step(self, rows: StepRows) -> dict[str, MetricValue]:
        return self.step_core.step(rows.rows, rate_pairs=True)


__all__ = ["DistillationObjective"]
