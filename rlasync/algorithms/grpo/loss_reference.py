"""Slow, obvious per-token references of the losses, used only by the tests (never on a training path).

Each function loops over loss terms in Python, follows the formula of docs/algorithms.md §5 line by line, and keeps only the
differentiable pieces as torch scalars, so a test can compare values *and* gradients with the vectorised code.

Shapes (M = loss terms, K = sampler top-K ids, V = vocabulary, C = candidate ids):
  trainer_logprobs, sampler_logprobs, advantages [M]; sample_index [M] long; entropy [M];
  head_trainer_logprobs, head_sampler_logprobs [M, K] (-inf where absent); logits [V]; candidate_ids [C].
"""

from __future__ import annotations

import math

import torch

from rlasync.algorithms.grpo.loss import TAIL_MASS_FLOOR, LossConfig


def candidate_logprob_reference(
    logits: torch.Tensor, token: int, candidate_ids: list[int] | None, temperature: float = 1.0
) -> torch.Tensor:
    """log π̃(y) = log π(y) − logsumexp_{v∈S} log π(v), π = softmax(logits / T); `None` = full vocabulary (docs/algorithms.md §5.3)."""
    scaled = [logits[v] / temperature for v in range(logits.shape[0])]
    log_z = torch.log(sum(torch.exp(z) for z in scaled))
    logprobs = [z - log_z for z in scaled]
    if candidate_ids is None:
        return logprobs[token]
    if token not in candidate_ids:
        return torch.tensor(-math.inf, dtype=logits.dtype)
    return logprobs[token] - torch.log(sum(torch.exp(logprobs[v]) for v in candidate_ids))


def grpo_loss_reference(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    config: LossConfig,
    num_tokens_global: float,
    num_ranks: int = 1,
    grad_accum_steps: int = 1,
    head_trainer_logprobs: torch.Tensor | None = None,
    head_sampler_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_t ℓ_t / max(num_tokens_global / num_ranks, 1) / grad_accum_steps, one term at a time."""
    total = trainer_logprobs.sum() * 0.0
    for t in range(trainer_logprobs.shape[0]):
        if config.score_centering:
            term = _score_centering_term(
                trainer_logprobs[t],
                float(sampler_logprobs[t]),
                float(advantages[t]),
                head_trainer_logprobs[t],
                [float(x) for x in head_sampler_logprobs[t]],
                config,
            )
        else:
            term = _clipped_term(trainer_logprobs[t], float(sampler_logprobs[t]), float(advantages[t]), config)
        total = total + term
    tokens_per_rank = max(num_tokens_global / num_ranks, 1.0)
    return total / tokens_per_rank / grad_accum_steps


def _inside(x: float, config: LossConfig) -> bool:
    return config.is_clip_min <= x <= config.is_clip_max


def _clipped_term(logprob: torch.Tensor, sampler_logprob: float, advantage: float, config: LossConfig) -> torch.Tensor:
    """ℓ = −m · min(r A, clip(r, 1−ε_low, 1+ε_high) A)."""
    ratio = torch.exp(logprob - sampler_logprob)
    r = ratio.item()
    if not _inside(r, config):
        return logprob * 0.0
    eps_low, eps_high = config.epsilon_low_high
    if r < 1 - eps_low:
        clipped = torch.tensor(1 - eps_low, dtype=ratio.dtype)
    elif r > 1 + eps_high:
        clipped = torch.tensor(1 + eps_high, dtype=ratio.dtype)
    else:
        clipped = ratio
    unclipped_value, clipped_value = r * advantage, clipped.item() * advantage
    return -(ratio * advantage if unclipped_value <= clipped_value else clipped * advantage)


def _score_centering_term(
    logprob: torch.Tensor,
    sampler_logprob: float,
    advantage: float,
    head_logprobs: torch.Tensor,
    head_sampler_logprobs: list[float],
    config: LossConfig,
) -> torch.Tensor:
    """ℓ = −A · [sg(w(r)) log π̃(y) − Σ_{v∈H} c_v log π̃(v)]."""
    ratio = math.exp(logprob.item() - sampler_logprob)
    if config.masked_token_centering == "drop" and not _inside(ratio, config):
        return logprob * 0.0
    weight = ratio if _inside(ratio, config) else 0.0
    head = head_logprobs.tolist()
    trainer_mass = sum(math.exp(x) for x in head if x > -math.inf)
    sampler_mass = sum(math.exp(x) for x in head_sampler_logprobs if x > -math.inf)
    rho = max(1 - sampler_mass, 0.0) / max(1 - trainer_mass, TAIL_MASS_FLOOR)
    tail_in = _inside(1 / rho if rho > 0 else math.inf, config)
    centring = logprob * 0.0
    for k, (lp, slp) in enumerate(zip(head, head_sampler_logprobs)):
        if lp == -math.inf or slp == -math.inf:
            continue
        prob = math.exp(lp)
        coef = prob * float(_inside(math.exp(lp - slp), config)) - prob * float(tail_in)
        if coef != 0.0:
            centring = centring + coef * head_logprobs[k]
    sampled = weight * logprob if weight > 0 else logprob * 0.0
    return -advantage * (sampled - centring)


def grpo_metrics_reference(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    sample_index: torch.Tensor,
    config: LossConfig,
    entropy: torch.Tensor | None = None,
    head_sampler_logprobs: torch.Tensor | None = None,
) -> dict[str, float | tuple[float, float]]:
    """The metrics of `grpo_loss` as plain Python (pairs = (Σ, M), extrema = floats)."""
    eps_low, eps_high = config.epsilon_low_high
    m = trainer_logprobs.shape[0]
    log_ratios = [a - b for a, b in zip(trainer_logprobs.tolist(), sampler_logprobs.tolist())]
    ratios = [math.exp(x) for x in log_ratios]
    adv = [float(a) for a in advantages]
    low = [r < 1 - eps_low and a < 0 for r, a in zip(ratios, adv)]
    high = [r > 1 + eps_high and a > 0 for r, a in zip(ratios, adv)]
    samples: dict[int, list[int]] = {}
    for t, s in enumerate(sample_index.tolist()):
        samples.setdefault(s, []).append(t)
    low_fracs = [sum(low[t] for t in ts) / len(ts) for ts in samples.values()]
    high_fracs = [sum(high[t] for t in ts) / len(ts) for ts in samples.values()]
    nan = math.nan
    out: dict[str, float | tuple[float, float]] = {
        "ratio": (sum(ratios), m),
        "kl": (sum((r - 1) - lr for r, lr in zip(ratios, log_ratios)), m),
        "clip_ratio/low_mean": (sum(low), m),
        "clip_ratio/high_mean": (sum(high), m),
        "clip_ratio/region_mean": (sum(lo or hi for lo, hi in zip(low, high)), m),
        "sampling/sampling_logp_difference/mean": (sum(abs(x) for x in log_ratios), m),
        "sampling/importance_sampling_ratio/mean": (sum(ratios), m),
        "sampling/masked_mean": (sum(not _inside(r, config) for r in ratios), m),
        "clip_ratio/low_min": min(low_fracs, default=nan),
        "clip_ratio/high_max": max(high_fracs, default=nan),
        "sampling/sampling_logp_difference/max": max((abs(x) for x in log_ratios), default=nan),
        "sampling/importance_sampling_ratio/min": min(ratios, default=nan),
        "sampling/importance_sampling_ratio/max": max(ratios, default=nan),
    }
    if entropy is not None:
        out["entropy"] = (sum(float(h) for h in entropy), m)
    if config.score_centering and head_sampler_logprobs is not None:
        mass = [sum(math.exp(float(x)) for x in row if float(x) > -math.inf) for row in head_sampler_logprobs]
        out["sampling/sampler_mass"] = (sum(mass), m)
    return out
