"""Per-rank metric statistics of the GRPO loss (docs/algorithms.md §5.2 table, §5.3 `sampling/*`, reduction rules §8.1).

Shapes (M = loss terms on this rank): trainer_logprobs, sampler_logprobs, advantages, entropy, sampler_mass [M]
float; sample_index [M] long.

Every value is a partial statistic that a reducer can combine across ranks and logging windows:
  * means over loss terms are `(numerator, denominator)` pairs, reduced as Σ num / Σ den (docs/algorithms.md §8.1 "rate"),
    with denominator = M: `ratio`, `kl`, `entropy`, `clip_ratio/{low,high,region}_mean`,
    `sampling/sampling_logp_difference/mean`, `sampling/importance_sampling_ratio/mean`, `sampling/masked_mean`,
    `sampling/sampler_mass` (score centering only);
  * extrema are plain floats (NaN when this rank has no terms), reduced by their name's `min`/`max` word:
    `clip_ratio/low_min`, `clip_ratio/high_max` (per-sample fractions), `sampling/sampling_logp_difference/max`,
    `sampling/importance_sampling_ratio/min`, `sampling/importance_sampling_ratio/max`.

Definitions (r = π̃_θ(y)/μ(y) before any masking): low-clipped = r < 1−ε_low and A < 0; high-clipped =
r > 1+ε_high and A > 0; region = either. They are counted by that rule in every mode, so with score centering
(nothing is clipped) and with the IS mask (masked terms are not clipped either) they measure how many terms
fall outside the trust region. `kl` = mean (r − 1) − log r; `sampling/masked_mean` = share of terms with
r ∉ [C_min, C_max]; logp difference = |log μ − log π̃_θ|.
"""

from __future__ import annotations

import torch

from rlasync.losses.grpo_config import LossConfig

Metrics = dict[str, float | tuple[float, float]]


@torch.no_grad()
def grpo_metrics(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    sample_index: torch.Tensor,
    config: LossConfig,
    entropy: torch.Tensor | None = None,
    sampler_mass: torch.Tensor | None = None,
) -> Metrics:
    """The loss metrics of one micro-batch on one rank (see the module docstring)."""
    log_ratio = trainer_logprobs.detach() - sampler_logprobs
    ratio = log_ratio.exp()
    low, high = clip_flags(ratio, advantages, config)
    sums = {
        "ratio": ratio,
        "kl": (ratio - 1) - log_ratio,
        "clip_ratio/low_mean": low,
        "clip_ratio/high_mean": high,
        "clip_ratio/region_mean": low | high,
        "sampling/sampling_logp_difference/mean": log_ratio.abs(),
        "sampling/importance_sampling_ratio/mean": ratio,
        "sampling/masked_mean": ~config.importance_mask(ratio),
    }
    if entropy is not None:
        sums["entropy"] = entropy
    if sampler_mass is not None:
        sums["sampling/sampler_mass"] = sampler_mass
    extrema = {
        "clip_ratio/low_min": _min(per_sample_fraction(low, sample_index)),
        "clip_ratio/high_max": _max(per_sample_fraction(high, sample_index)),
        "sampling/sampling_logp_difference/max": _max(log_ratio.abs()),
        "sampling/importance_sampling_ratio/min": _min(ratio),
        "sampling/importance_sampling_ratio/max": _max(ratio),
    }
    return _to_python(sums, extrema, float(trainer_logprobs.shape[0]))


def clip_flags(ratio: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool [M] low-clipped (r < 1−ε_low, A < 0) and high-clipped (r > 1+ε_high, A > 0) flags."""
    eps_low, eps_high = config.epsilon_low_high
    return (ratio < 1 - eps_low) & (advantages < 0), (ratio > 1 + eps_high) & (advantages > 0)


def per_sample_fraction(flags: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """[S] share of each present sample's terms whose flag is set (S = distinct values of `sample_index`)."""
    _, inverse = torch.unique(sample_index, return_inverse=True)
    counts = torch.bincount(inverse)
    hits = torch.bincount(inverse, weights=flags.to(torch.float64))
    return hits / counts


def _min(values: torch.Tensor) -> torch.Tensor:
    return values.min() if values.numel() else values.new_full((), float("nan"), dtype=torch.float64)


def _max(values: torch.Tensor) -> torch.Tensor:
    return values.max() if values.numel() else values.new_full((), float("nan"), dtype=torch.float64)


def _to_python(sums: dict[str, torch.Tensor], extrema: dict[str, torch.Tensor], count: float) -> Metrics:
    """One device-to-host copy for every statistic: sums become (Σ, count) pairs, extrema floats."""
    stacked = torch.stack(
        [v.to(torch.float64).sum() for v in sums.values()] + [v.to(torch.float64) for v in extrema.values()]
    ).tolist()
    metrics: Metrics = {k: (s, count) for k, s in zip(sums, stacked)}
    metrics.update(zip(extrema, stacked[len(sums) :]))
    return metrics
