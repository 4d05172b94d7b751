"""Losses of the learner: pure functions of per-loss-term tensors (no model, no ray).

A *loss term* is one trained token of a packed row; the chunked LM head (`rlasync.model`) turns a forward pass
into per-term tensors, and the functions here turn those into a scalar loss plus per-rank metric statistics.

* `grpo_loss` / `LossConfig`: the GRPO objective of docs/algorithms.md §5.2-§5.3 (clipped surrogate with masked importance
  sampling, or score centering).
* the on-policy distillation loss (docs/algorithms.md §9.3) lives with its algorithm: `rlasync.algorithms.distill.loss`.
* `rlasync.losses.reference`: slow per-token loops of the same formulas, used only by the tests.
"""

from rlasync.losses.grpo import LossConfig, grpo_loss, masked_is_weight, normalize_loss
from rlasync.losses.grpo_metrics import Metrics

__all__ = [
    "LossConfig",
    "Metrics",
    "grpo_loss",
    "masked_is_weight",
    "normalize_loss",
]
