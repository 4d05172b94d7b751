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


__all__ = ["GrpoObjective"]
