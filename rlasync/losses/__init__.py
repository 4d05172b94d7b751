"""Losses of the learner: pure functions of per-loss-term tensors (no model, no ray).

A *loss term* is one trained token of a packed row; the chunked LM head (`rlasync.model`) turns a forward pass
into per-term tensors, and the functions here turn those into a scalar loss plus per-rank metric statistics.

* `grpo_loss` / `LossConfig`: the GRPO objective of docs/algorithms.md §5.2-§5.3 (clipped surrogate with masked importance
  sampling, or score centering).
* `distillation_loss` / `distillation_row_loss` / `DistillLossConfig`: the on-policy distillation objective of
  docs/algorithms.md §9.3 (generalised JSD against a teacher's sparse top-k, chunked over the LM head), and
  `distillation_metrics` for docs/algorithms.md §8.4.
* `rlasync.losses.reference`: slow per-token loops of the same formulas, used only by the tests.
"""

from rlasync.losses.distill import (
    DistillLossConfig,
    distillation_loss,
    distillation_metrics,
    distillation_row_loss,
    generalized_jsd,
    narrow_support,
)
from rlasync.losses.grpo import LossConfig, grpo_loss, masked_is_weight, normalize_loss
from rlasync.losses.grpo_metrics import Metrics

__all__ = [
    "DistillLossConfig",
    "LossConfig",
    "Metrics",
    "distillation_loss",
    "distillation_metrics",
    "distillation_row_loss",
    "generalized_jsd",
    "grpo_loss",
    "masked_is_weight",
    "narrow_support",
    "normalize_loss",
]
