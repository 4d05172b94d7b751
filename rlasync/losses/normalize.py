"""What every algorithm's loss shares: the normaliser of a micro-batch's summed loss terms (docs/algorithms.md §5.2)
and the type of a loss's per-rank metric statistics."""

from __future__ import annotations

import torch

Metrics = dict[str, float | tuple[float, float]]
"""A loss's metric statistics: plain floats, or (numerator, denominator) rate pairs (docs/algorithms.md §8.1)."""


def normalize_loss(
    summed_terms: torch.Tensor, num_tokens_global: float, num_ranks: int = 1, grad_accum_steps: int = 1
) -> torch.Tensor:
    """docs/algorithms.md §5.2: Σ ℓ_t / max(num_tokens_global / num_ranks, 1) / grad_accum_steps.

    After gradient averaging over the ranks this is Σ ℓ / num_tokens_global per micro-batch, averaged over the
    `grad_accum_steps` micro-batches of a step.
    """
    if num_ranks < 1 or grad_accum_steps < 1:
        raise ValueError(f"num_ranks and grad_accum_steps must be >= 1, got {num_ranks}, {grad_accum_steps}")
    tokens_per_rank = max(float(num_tokens_global) / num_ranks, 1.0)
    return summed_terms / tokens_per_rank / grad_accum_steps


__all__ = ["Metrics", "normalize_loss"]
