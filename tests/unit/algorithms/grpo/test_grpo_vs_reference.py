"""grpo_loss equals the slow per-token reference (values, gradients, metrics) on random inputs, in every mode."""

from __future__ import annotations

import math

import pytest
import torch

from rlasync.algorithms.grpo.loss import LossConfig, grpo_loss
from rlasync.algorithms.grpo.loss_reference import grpo_loss_reference, grpo_metrics_reference

CONFIGS = {
    "trl_1_16": LossConfig.trl_1_16(),
    "trl_1_16_asym": LossConfig.trl_1_16(0.2, 0.28),
    "masked_is": LossConfig(score_centering=False),
    "masked_is_narrow": LossConfig(score_centering=False, epsilon_high=0.28, is_clip_min=0.8, is_clip_max=1.25),
    "centering_keep": LossConfig(),
    "centering_drop": LossConfig(masked_token_centering="drop"),
    "centering_keep_narrow": LossConfig(is_clip_min=0.8, is_clip_max=1.25),
    "centering_drop_narrow": LossConfig(is_clip_min=0.8, is_clip_max=1.25, masked_token_centering="drop"),
    "centering_unmasked": LossConfig(is_clip_min=0.0, is_clip_max=math.inf),
}
NORMALISERS = [(None, 1, 1), (3.5, 4, 2), (0.25, 2, 3)]  # (num_tokens_global as a multiple of M, ranks, GA)


def _run(batch, config, scale, num_ranks, grad_accum_steps, fn):
    trainer = batch.trainer_logprobs.clone().requires_grad_()
    head = batch.head_trainer_logprobs.clone().requires_grad_()
    kwargs = dict(
        config=config,
        num_tokens_global=(scale or 1.0) * trainer.shape[0],
        num_ranks=num_ranks,
        grad_accum_steps=grad_accum_steps,
        head_trainer_logprobs=head,
        head_sampler_logprobs=batch.head_sampler_logprobs,
    )
    if fn is grpo_loss:
        loss, _ = grpo_loss(trainer, batch.sampler_logprobs, batch.advantages, batch.sample_index, **kwargs)
    else:
        loss = grpo_loss_reference(trainer, batch.sampler_logprobs, batch.advantages, **kwargs)
    grads = torch.autograd.grad(loss, [trainer, head], allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, (trainer, head))]
    return loss.detach(), grads


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_gradients_match_reference(term_batch, name, seed):
    batch = term_batch(seed)
    config = CONFIGS[name]
    for scale, num_ranks, grad_accum_steps in NORMALISERS:
        loss, grads = _run(batch, config, scale, num_ranks, grad_accum_steps, grpo_loss)
        ref_loss, ref_grads = _run(batch, config, scale, num_ranks, grad_accum_steps, grpo_loss_reference)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
        for got, want in zip(grads, ref_grads):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_random_batches_exercise_every_branch(term_batch):
    """Guard the test above against vacuity: masking, clipping, absent head ids and both tail cases occur."""
    batch = term_batch(0)
    ratio = (batch.trainer_logprobs - batch.sampler_logprobs).exp()
    assert ((ratio < 0.8) | (ratio > 1.25)).any() and ((ratio >= 0.8) & (ratio <= 1.25)).any()
    assert (ratio < 0.5).any() or (ratio > 5.0).any() or ((ratio < 0.8) & (batch.advantages < 0)).any()
    assert torch.isinf(batch.head_sampler_logprobs).any() and torch.isfinite(batch.head_sampler_logprobs).any()
    mass_gap = batch.head_sampler_logprobs.exp().sum(-1) - batch.head_trainer_logprobs.exp().sum(-1)
    assert (mass_gap.abs() > 0.05).any() and (mass_gap.abs() < 0.05).any()


def test_normaliser_is_global_mean_over_ranks_and_micro_batches(term_batch):
    """Two ranks × two micro-batches with the docs/algorithms.md §5.2 normaliser: the averaged gradient equals the global token mean."""
    config = LossConfig.trl_1_16()
    shards = [term_batch(seed, m=m) for seed, m in ((0, 10), (1, 6), (2, 12), (3, 4))]  # (mb0: r0, r1), (mb1: ...)
    trainer = [s.trainer_logprobs.clone().requires_grad_() for s in shards]
    total = 0.0
    for mb in range(2):
        pair = shards[2 * mb : 2 * mb + 2]
        n_global = sum(s.trainer_logprobs.shape[0] for s in pair)
        for rank in range(2):
            s = shards[2 * mb + rank]
            loss, _ = grpo_loss(
                trainer[2 * mb + rank],
                s.sampler_logprobs,
                s.advantages,
                s.sample_index,
                config=config,
                num_tokens_global=n_global,
                num_ranks=2,
                grad_accum_steps=2,
            )
            total = total + loss / 2  # gradient averaging over the 2 ranks
    expected = 0.0
    for mb in range(2):
        pair = shards[2 * mb : 2 * mb + 2]
        n_global = sum(s.trainer_logprobs.shape[0] for s in pair)
        summed = sum(
            grpo_loss_reference(
                trainer[2 * mb + r], s.sampler_logprobs, s.advantages, config=config, num_tokens_global=1
            )
            for r, s in enumerate(pair)
        )
        expected = expected + summed / n_global / 2
    torch.testing.assert_close(total, expected)


@pytest.mark.parametrize("name", ["trl_1_16", "masked_is_narrow", "centering_keep", "centering_drop_narrow"])
def test_metrics_match_reference(term_batch, name):
    batch = term_batch(3)
    config = CONFIGS[name]
    _, metrics = grpo_loss(
        batch.trainer_logprobs,
        batch.sampler_logprobs,
        batch.advantages,
        batch.sample_index,
        config=config,
        num_tokens_global=24,
        entropy=batch.entropy,
        head_trainer_logprobs=batch.head_trainer_logprobs,
        head_sampler_logprobs=batch.head_sampler_logprobs,
    )
    expected = grpo_metrics_reference(
        batch.trainer_logprobs,
        batch.sampler_logprobs,
        batch.advantages,
        batch.sample_index,
        config,
        entropy=batch.entropy,
        head_sampler_logprobs=batch.head_sampler_logprobs,
    )
    assert metrics.keys() == expected.keys()
    for key, want in expected.items():
        assert metrics[key] == pytest.approx(want, rel=1e-12, abs=1e-12), key
