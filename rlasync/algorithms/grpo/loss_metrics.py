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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlasync.algorithms.grpo.loss_config import LossConfig
from rlasync.losses.normalize import Metrics


@dataclass(frozen=True)
class PendingMetrics:
    """A micro-batch's statistics still on the device (`grpo_metrics(..., defer=True)`): `resolve_metrics` copies
    many of them to the host at once, so a learner step reads its metrics once, after its last backward, instead of
    waiting for every row's forward to finish before it can queue that row's backward."""

    sum_keys: tuple[str, ...]
    extrema_keys: tuple[str, ...]
    values: torch.Tensor  # [len(sum_keys) + len(extrema_keys)] float64
    count: float

    def as_metrics(self, values: Sequence[float]) -> Metrics:
        metrics: Metrics = {k: (s, self.count) for k, s in zip(self.sum_keys, values)}
        metrics.update(zip(self.extrema_keys, values[len(self.sum_keys) :]))
        return metrics


def resolve_metrics(pending: Sequence[PendingMetrics], *extra: torch.Tensor) -> tuple[list[Metrics], list[float]]:
    """The host values of `pending` and of the 0-d tensors `extra` (e.g. the losses), in one device-to-host copy."""
    parts = [p.values for p in pending] + [t.detach().reshape(1).to(torch.float64) for t in extra]
    if not parts:
        return [], []
    flat = torch.cat([part.to(parts[0].device) for part in parts]).tolist()
    out, offset = [], 0
    for p in pending:
        size = p.values.numel()
        out.append(p.as_metrics(flat[offset : offset + size]))
        offset += size
    return out, flat[offset:]


@torch.no_grad()
def grpo_metrics(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    sample_index: torch.Tensor,
    config: LossConfig,
    entropy: torch.Tensor | None = None,
    sampler_mass: torch.Tensor | None = None,
    *,
    num_samples: int | None = None,
    defer: bool = False,
) -> Metrics | PendingMetrics:
    """The loss metrics of one micro-batch on one rank (see the module docstring). `num_samples` (a bound on
    `sample_index`, e.g. the row's sample count) spares a device read for the per-sample extrema; `defer=True`
    returns them still on the device (`PendingMetrics`)."""
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
    if num_samples is None:  # reads the largest sample index back from the device
        num_samples = int(sample_index.max()) + 1 if sample_index.numel() else 0
    extrema = {
        "clip_ratio/low_min": _present_extremum(*sample_fractions(low, sample_index, num_samples), "min"),
        "clip_ratio/high_max": _present_extremum(*sample_fractions(high, sample_index, num_samples), "max"),
        "sampling/sampling_logp_difference/max": _max(log_ratio.abs()),
        "sampling/importance_sampling_ratio/min": _min(ratio),
        "sampling/importance_sampling_ratio/max": _max(ratio),
    }
    values = torch.stack(
        [v.to(torch.float64).sum() for v in sums.values()] + [v.to(torch.float64) for v in extrema.values()]
    )
    pending = PendingMetrics(tuple(sums), tuple(extrema), values, float(trainer_logprobs.shape[0]))
    return pending if defer else pending.as_metrics(values.tolist())


def clip_flags(ratio: torch.Tensor, advantages: torch.Tensor, config: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool [M] low-clipped (r < 1−ε_low, A < 0) and high-clipped (r > 1+ε_high, A > 0) flags."""
    eps_low, eps_high = config.epsilon_low_high
    return (ratio < 1 - eps_low) & (advantages < 0), (ratio > 1 + eps_high) & (advantages > 0)


def sample_fractions(
    flags: torch.Tensor, sample_index: torch.Tensor, num_samples: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_samples] share of each sample's terms whose flag is set, [num_samples] whether the sample has terms),
    without reading anything back from the device (samples are `sample_index` values below `num_samples`)."""
    counts = torch.zeros(num_samples, dtype=torch.float64, device=flags.device)
    counts.index_add_(0, sample_index, torch.ones_like(sample_index, dtype=torch.float64))
    hits = torch.zeros_like(counts).index_add_(0, sample_index, flags.to(torch.float64))
    return hits / counts.clamp_min(1.0), counts > 0


def _present_extremum(values: torch.Tensor, present: torch.Tensor, kind: str) -> torch.Tensor:
    """min or max of `values` where `present`; NaN when nothing is (as `_min` / `_max` of an empty tensor)."""
    if values.numel() == 0:
        return values.new_full((), float("nan"), dtype=torch.float64)
    fill = float("inf") if kind == "min" else float("-inf")
    masked = torch.where(present, values, torch.full_like(values, fill))
    reduced = masked.min() if kind == "min" else masked.max()
    return torch.where(present.any(), reduced, torch.full_like(reduced, float("nan")))


def _min(values: torch.Tensor) -> torch.Tensor:
    return values.min() if values.numel() else values.new_full((), float("nan"), dtype=torch.float64)


def _max(values: torch.Tensor) -> torch.Tensor:
    return values.max() if values.numel() else values.new_full((), float("nan"), dtype=torch.float64)
