"""GRPO loss over loss terms: clipped surrogate with masked importance sampling, or score centering (docs/algorithms.md §5.2-§5.3).

Shapes (M = loss terms of this micro-batch on this rank, i.e. trained tokens; K = num_sampler_logprobs):
  trainer_logprobs        [M]    log π̃_θ(y_t), differentiable (temperature applied, renormalised over the
                                 sampling candidate set S_t when there is one)
  sampler_logprobs        [M]    log μ(y_t), the sampler's processed log-prob ("old policy")
  advantages              [M]    A_t
  sample_index            [M]    long, which sample of the row each term belongs to (per-sample clip metrics)
  entropy                 [M]    H_t, detached (metric only)
  head_trainer_logprobs   [M, K] log π̃_θ(v) at the sampler's top-K ids, differentiable (-inf where absent)
  head_sampler_logprobs   [M, K] log μ(v) at those ids (-inf where absent)

Notation: r_t = π̃_θ(y_t)/μ(y_t); masked importance sampling keeps a term iff C_min ≤ sg(r_t) ≤ C_max
(`is_clip_min`, `is_clip_max`); w(x) = x·1[C_min ≤ x ≤ C_max].

Two objectives (`LossConfig.score_centering`):
  False  ℓ_t = −m_t · min(r_t A_t, clip(r_t, 1−ε_low, 1+ε_high) A_t). With `is_clip_min=0, is_clip_max=inf` the
         mask is always 1 and this is TRL 1.16's objective (`LossConfig.trl_1_16()`).
  True   ℓ_t = −A_t · [sg(w(r_t)) log π̃_θ(y_t) − Σ_{v∈H_t} c_{t,v} log π̃_θ(v)], with the centring coefficients
         c_{t,v} of docs/algorithms.md §5.3 (tail model ρ_t). Nothing is clipped.

The summed terms are divided by the §5.2 normaliser (`normalize_loss`). Metrics: see `rlasync.algorithms.grpo.loss_metrics`.
"""

from __future__ import annotations

from typing import Any

import torch

from rlasync.algorithms.grpo.loss_config import TAIL_MASS_FLOOR, LossConfig, MaskedTokenCentering
from rlasync.algorithms.grpo.loss_metrics import Metrics, PendingMetrics, grpo_metrics
from rlasync.losses.normalize import normalize_loss

__all__ = ["TAIL_MASS_FLOOR", "LossConfig", "MaskedTokenCentering", "grpo_loss", "masked_is_weight", "normalize_loss"]


def grpo_loss(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    sample_index: torch.Tensor,
    *,
    config: LossConfig,
    num_tokens_global: float,
    num_ranks: int = 1,
    grad_accum_steps: int = 1,
    entropy: torch.Tensor | None = None,
    head_trainer_logprobs: torch.Tensor | None = None,
    head_sampler_logprobs: torch.Tensor | None = None,
    num_samples: int | None = None,
    defer_metrics: bool = False,
) -> tuple[torch.Tensor, Metrics | PendingMetrics]:
    """This rank's share of the GRPO loss of one micro-batch, and its metric statistics.

    `num_tokens_global` is the number of loss terms of the micro-batch summed over all ranks (counted regardless
    of the IS mask). Returns (0-d loss tensor, metrics); see the module docstring for shapes and formulas.
    `num_samples` and `defer_metrics`: see `rlasync.algorithms.grpo.loss_metrics.grpo_metrics` (a learner step passes
    both, so nothing in the micro-batch waits for the device).
    """
    dtype = torch.promote_types(trainer_logprobs.dtype, torch.float32)
    trainer_logprobs = trainer_logprobs.to(dtype)
    sampler_logprobs = sampler_logprobs.to(dtype)
    advantages = advantages.to(dtype)
    _check_terms(trainer_logprobs, sampler_logprobs, advantages, sample_index)
    sampler_mass = None
    if config.score_centering:
        head_trainer_logprobs, head_sampler_logprobs = _check_head(
            head_trainer_logprobs, head_sampler_logprobs, trainer_logprobs.shape[0], dtype
        )
        terms, sampler_mass = score_centering_terms(
            trainer_logprobs, sampler_logprobs, advantages, head_trainer_logprobs, head_sampler_logprobs, config
        )
    else:
        terms = clipped_surrogate_terms(trainer_logprobs, sampler_logprobs, advantages, config)
    loss = normalize_loss(terms.sum(), num_tokens_global, num_ranks, grad_accum_steps)
    metrics = grpo_metrics(
        trainer_logprobs.detach(),
        sampler_logprobs,
        advantages,
        sample_index,
        config,
        entropy,
        sampler_mass,
        num_samples=num_samples,
        defer=defer_metrics,
    )
    return loss, metrics


def masked_is_weight(ratio: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """w(x) = x · 1[C_min ≤ x ≤ C_max], elementwise (0 where masked, also for infinite ratios)."""
    return torch.where(config.importance_mask(ratio), ratio, torch.zeros_like(ratio))


def clipped_surrogate_terms(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, advantages: torch.Tensor, config: LossConfig
) -> torch.Tensor:
    """[M] ℓ_t = −m_t · min(r_t A_t, clip(r_t, 1−ε_low, 1+ε_high) A_t) (m_t = 1 for `LossConfig.trl_1_16()`)."""
    eps_low, eps_high = config.epsilon_low_high
    log_ratio = trainer_logprobs - sampler_logprobs
    keep = config.importance_mask(log_ratio.detach().exp())
    # Masked terms get log r = 0 before exp() so that an overflowing ratio cannot turn their zero gradient into NaN.
    ratio = torch.exp(torch.where(keep, log_ratio, torch.zeros_like(log_ratio)))
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - eps_low, 1 + eps_high) * advantages)
    return torch.where(keep, -surrogate, torch.zeros_like(surrogate))


def score_centering_terms(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    head_trainer_logprobs: torch.Tensor,
    head_sampler_logprobs: torch.Tensor,
    config: LossConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M] ℓ_t = −A_t · [sg(w(r_t)) log π̃_θ(y_t) − Σ_v c_{t,v} log π̃_θ(v)], and [M] Q_H (sampler head mass).

    With `masked_token_centering="drop"`, terms whose sampled token is masked (m_t = 0) are zero.
    """
    with torch.no_grad():
        ratio = torch.exp(trainer_logprobs - sampler_logprobs)
        keep = config.importance_mask(ratio)
        weight = masked_is_weight(ratio, config)
        coef, sampler_mass = centering_coefficients(head_trainer_logprobs.detach(), head_sampler_logprobs, config)
    # where(), not a product, so that a zero weight / coefficient never meets a -inf log-prob (0·-inf = NaN).
    sampled = torch.where(weight > 0, weight * trainer_logprobs, torch.zeros_like(trainer_logprobs))
    present = coef != 0
    head = torch.where(present, head_trainer_logprobs, torch.zeros_like(head_trainer_logprobs))
    centring = (coef * head).sum(-1)
    terms = -advantages * (sampled - centring)
    if config.masked_token_centering == "drop":
        terms = torch.where(keep, terms, torch.zeros_like(terms))
    return terms, sampler_mass


def centering_coefficients(
    head_trainer_logprobs: torch.Tensor, head_sampler_logprobs: torch.Tensor, config: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached [M, K] c_{t,v} and [M] Q_H (docs/algorithms.md §5.3).

    c_{t,v} = π̃(v)·1[C_min ≤ π̃(v)/μ(v) ≤ C_max] − π̃(v)·1[C_min ≤ 1/ρ_t ≤ C_max], 0 where the id is absent
    (either log-prob is -inf). ρ_t = (1 − Q_H) / max(1 − P_H, 1e-6) models the sampler outside the head as
    ρ_t·π̃_θ; 1 − Q_H is floored at 0 (it can only go negative by rounding).
    """
    present = torch.isfinite(head_trainer_logprobs) & torch.isfinite(head_sampler_logprobs)
    trainer_probs, sampler_probs = head_trainer_logprobs.exp(), head_sampler_logprobs.exp()  # 0 where -inf
    sampler_mass = sampler_probs.sum(-1)
    rho = tail_scale(trainer_probs.sum(-1), sampler_mass)
    zeros = torch.zeros_like(trainer_probs)
    head_ratio = torch.where(present, (head_trainer_logprobs - head_sampler_logprobs).exp(), zeros)
    head_in = (config.importance_mask(head_ratio) & present).to(zeros.dtype)
    tail_in = config.importance_mask(1.0 / rho).to(zeros.dtype).unsqueeze(-1)
    coef = torch.where(present, trainer_probs * (head_in - tail_in), zeros)
    return coef, sampler_mass


def tail_scale(trainer_head_mass: torch.Tensor, sampler_head_mass: torch.Tensor) -> torch.Tensor:
    """ρ = max(1 − Q_H, 0) / max(1 − P_H, 1e-6): the sampler's tail as a multiple of the trainer's (elementwise)."""
    return (1 - sampler_head_mass).clamp_min(0) / (1 - trainer_head_mass).clamp_min(TAIL_MASS_FLOOR)


def _check_terms(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, advantages: torch.Tensor, sample_index: torch.Tensor
) -> None:
    if trainer_logprobs.ndim != 1:
        raise ValueError(f"trainer_logprobs must be [M] (one value per loss term), got {tuple(trainer_logprobs.shape)}")
    for name, value in (
        ("sampler_logprobs", sampler_logprobs),
        ("advantages", advantages),
        ("sample_index", sample_index),
    ):
        if value.shape != trainer_logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {tuple(trainer_logprobs.shape)} ([M])")


def _check_head(
    head_trainer_logprobs: torch.Tensor | None, head_sampler_logprobs: torch.Tensor | None, num_terms: int, dtype: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    missing = [
        n
        for n, v in (("head_trainer_logprobs", head_trainer_logprobs), ("head_sampler_logprobs", head_sampler_logprobs))
        if v is None
    ]
    if missing:
        raise ValueError(
            f"score_centering needs the sampler's top-K log-probs, but {' and '.join(missing)} is None: set "
            "num_sampler_logprobs > 0 (so the generation engine returns them and the LM head gathers them), "
            "or turn score_centering off"
        )
    if head_trainer_logprobs.shape != head_sampler_logprobs.shape or head_trainer_logprobs.ndim != 2:
        raise ValueError(
            "head_trainer_logprobs and head_sampler_logprobs must both be [M, K], got "
            f"{tuple(head_trainer_logprobs.shape)} and {tuple(head_sampler_logprobs.shape)}"
        )
    if head_trainer_logprobs.shape[0] != num_terms:
        raise ValueError(f"head log-probs have {head_trainer_logprobs.shape[0]} rows, expected M = {num_terms}")
    return head_trainer_logprobs.to(dtype), head_sampler_logprobs.to(dtype)
