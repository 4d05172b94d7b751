"""GRPO's learner objective: tree-packed rows (`rlasync.packing`: TokenBudgetBatcher / FixedCountBatcher) ->
`GrpoLearnerStep` (grpo_loss, docs/algorithms.md §5); counts `batch/groups_per_step`. Runs on a learner rank: imports
no rollout code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlasync.algorithms.grpo.loss_config import LossConfig
from rlasync.learner.objectives import Objective, StepParts, StepRows
from rlasync.metrics import MetricValue


class GrpoObjective(Objective):
    """Asynchronous GRPO on tree-packed rows (`GrpoLearnerStep`); counts `batch/groups_per_step`. A model with
    linear-attention layers is planned padding-free (every sample its own chain, docs/algorithms.md §4.3)."""

    loss_cls = LossConfig
    bucket_rows = True  # compiled layers: rows padded to a multiple of row_bucket (docs/algorithms.md §5.5)
    share_prefixes = True  # set by `build` from the model

    def build(self, parts: StepParts) -> None:
        from rlasync.algorithms.grpo.learner_step import GrpoLearnerStep
        from rlasync.model.attention import has_linear_attention

        settings = self.settings
        # linear-attention (gated DeltaNet) layers cannot share a prefix: such models train padding-free
        self.share_prefixes = not has_linear_attention(getattr(parts.scorer, "model", parts.scorer))
        self.step_core = GrpoLearnerStep(
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
        if parts.all_reduce is not None:
            self.all_reduce = parts.all_reduce

    def new_batcher(self) -> Any:
        from rlasync.packing import FixedCountBatcher, TokenBudgetBatcher

        share = self.share_prefixes
        if self.settings.token_budget > 0:
            return TokenBudgetBatcher(self.world_size, self.settings.token_budget, share_prefixes=share)
        # B per rank: a micro-batch is B x P samples (TRL's per_device_train_batch_size, as distillation counts it)
        micro = self.settings.per_device_train_batch_size * self.world_size
        return FixedCountBatcher(self.world_size, micro, share_prefixes=share)

    def new_row(self) -> Any:
        from rlasync.packing import TreeRow

        return TreeRow(self.share_prefixes)

    def rows(self, rows: Sequence[Any], device: torch.device, pad_id: int) -> StepRows:
        """This rank's rows packed; each micro-batch's loss terms over all ranks (the normaliser) all-reduced."""
        from rlasync.packing.layout import pack

        out = StepRows(rows=[pack(row) for row in rows], forwarded_tokens=0, trained_tokens=0)
        for mine in out.rows:
            out.forwarded_tokens += len(mine.input_ids)
            out.trained_tokens += len(mine.target_ids)
        out.global_terms, _ = self.reduce_step_totals([float(len(mine.target_ids)) for mine in out.rows])
        return out

    def step(self, rows: StepRows) -> dict[str, MetricValue]:
        return self.step_core.step(rows.rows, rows.global_terms, rate_pairs=True)


__all__ = ["GrpoObjective"]
