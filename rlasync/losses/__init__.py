"""What every algorithm's loss shares (pure functions of per-loss-term tensors; no model, no ray).

A *loss term* is one trained token of a packed row; the chunked LM head (`rlasync.model`) turns a forward pass
into per-term tensors, and each algorithm's loss turns those into a scalar loss plus per-rank metric statistics:
GRPO's in `rlasync.algorithms.grpo.loss` (docs/algorithms.md §5.2-§5.3), distillation's in
`rlasync.algorithms.distill.loss` (§9.3). Here: the normaliser both use and the metrics' type.
"""

from rlasync.losses.normalize import Metrics, normalize_loss

__all__ = ["Metrics", "normalize_loss"]
