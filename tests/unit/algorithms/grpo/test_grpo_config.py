"""LossConfig construction and validation, input checks, the 1.16 objective, and closed-form values."""

from __future__ import annotations

import math

import pytest
import torch

from rlasync.algorithms.grpo.loss import LossConfig, grpo_loss, masked_is_weight, normalize_loss


def _config(**overrides):
    from rlasync.config import AsyncGRPOConfig

    fields = dict(
        epsilon=0.2,
        epsilon_high=0.28,
        score_centering=False,
        num_sampler_logprobs=0,
        vllm_importance_sampling_clip_min=0.25,
        vllm_importance_sampling_clip_max=4.0,
    )
    return AsyncGRPOConfig(**{**fields, **overrides})


def test_from_config_reads_trl_field_names():
    config = LossConfig.from_config(_config())
    assert config == LossConfig(0.2, 0.28, False, 0.25, 4.0, "keep")
    assert config.epsilon_low_high == (0.2, 0.28)
    assert LossConfig.from_config(_config(masked_token_centering="drop")).masked_token_centering == "drop"
    assert LossConfig().epsilon_low_high == (0.2, 0.2)


@pytest.mark.parametrize(
    "kwargs", [dict(epsilon=-0.1), dict(is_clip_min=2.0, is_clip_max=1.0), dict(masked_token_centering="maybe")]
)
def test_invalid_configs_raise(kwargs):
    with pytest.raises(ValueError):
        LossConfig(**kwargs)


def test_score_centering_without_head_names_the_setting():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="num_sampler_logprobs") as info:
        grpo_loss(x, x, x, torch.zeros(3, dtype=torch.long), config=LossConfig(), num_tokens_global=3)
    assert "head_trainer_logprobs" in str(info.value)


def test_shape_mismatch_raises():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(
            x, x, torch.zeros(2), torch.zeros(3, dtype=torch.long), config=LossConfig.trl_1_16(), num_tokens_global=3
        )


def test_trl_1_16_is_the_unmasked_clipped_surrogate():
    """No IS mask at any ratio (r = 10 ≫ C_max), value and gradient by the closed form."""
    ratio = torch.tensor([0.1, 0.7, 1.0, 1.5, 10.0], dtype=torch.float64)
    adv = torch.tensor([-1.0, -2.0, 0.5, 1.0, -1.0], dtype=torch.float64)
    trainer = ratio.log().requires_grad_()
    sampler = torch.zeros(5, dtype=torch.float64)
    idx = torch.zeros(5, dtype=torch.long)
    loss, _ = grpo_loss(trainer, sampler, adv, idx, config=LossConfig.trl_1_16(), num_tokens_global=5)
    (grad,) = torch.autograd.grad(loss, trainer)
    # min(rA, clip(r)A): 0.1·-1 → min(-0.1, -0.8) = -0.8 (clipped, no grad); 0.7·-2 → min(-1.4, -1.6) = -1.6 (clipped);
    # 1.0·0.5 = 0.5; 1.5·1 → min(1.5, 1.2) = 1.2 (clipped); 10·-1 → min(-10, -1.2) = -10 (unclipped, grad).
    expected = -(-0.8 - 1.6 + 0.5 + 1.2 - 10.0) / 5
    assert loss.item() == pytest.approx(expected)
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, -0.5, 0.0, 10.0], dtype=torch.float64) / 5)
    same, _ = grpo_loss(
        trainer,
        sampler,
        adv,
        idx,
        num_tokens_global=5,
        config=LossConfig(score_centering=False, is_clip_min=0.0, is_clip_max=math.inf),
    )
    assert same.item() == loss.item()
    masked, _ = grpo_loss(trainer, sampler, adv, idx, config=LossConfig(score_centering=False), num_tokens_global=5)
    assert masked.item() == pytest.approx(-(-1.6 + 0.5 + 1.2) / 5)  # r = 0.1 and r = 10 are masked out


def test_score_centering_single_term_closed_form():
    """One term, head = {a, b}: c_v and ρ by hand."""
    config = LossConfig(is_clip_min=0.8, is_clip_max=1.25)
    pi = {"y": 0.2, "a": 0.5, "b": 0.1}
    mu = {"y": 0.2 / 1.1, "a": 0.45, "b": 0.2}  # ratios: y 1.1 (kept), a 1.11 (kept), b 0.5 (masked)
    trainer = torch.tensor([math.log(pi["y"])], dtype=torch.float64, requires_grad=True)
    head = torch.tensor([[math.log(pi["a"]), math.log(pi["b"])]], dtype=torch.float64, requires_grad=True)
    loss, metrics = grpo_loss(
        trainer,
        torch.tensor([math.log(mu["y"])], dtype=torch.float64),
        torch.tensor([2.0], dtype=torch.float64),
        torch.zeros(1, dtype=torch.long),
        config=config,
        num_tokens_global=1,
        head_trainer_logprobs=head,
        head_sampler_logprobs=torch.tensor([[math.log(0.45), math.log(0.2)]]),
    )
    loss.backward()
    rho = (1 - 0.65) / (1 - 0.6)  # 0.875 -> 1/ρ = 1.143 inside [0.8, 1.25]: the tail term is on
    assert 0.8 <= 1 / rho <= 1.25
    c_a, c_b = 0.5 * 1 - 0.5, 0.1 * 0 - 0.1
    assert trainer.grad.item() == pytest.approx(-2.0 * 1.1)
    torch.testing.assert_close(head.grad, torch.tensor([[2.0 * c_a, 2.0 * c_b]], dtype=torch.float64))
    assert metrics["sampling/sampler_mass"] == pytest.approx((0.65, 1.0))


def test_masked_token_keep_vs_drop():
    """A masked sampled token keeps only its centring term ("keep"), or vanishes entirely ("drop")."""
    head_t = torch.tensor([[math.log(0.5), math.log(0.3)]], dtype=torch.float64, requires_grad=True)
    head_s = torch.tensor([[math.log(0.66), math.log(0.31)]], dtype=torch.float64)  # head ratios 0.76, 0.97: kept
    trainer = torch.tensor([math.log(0.1)], dtype=torch.float64, requires_grad=True)
    sampler = torch.tensor([math.log(0.01)], dtype=torch.float64)  # r = 10: masked
    # ρ = 0.03 / 0.2 -> 1/ρ = 6.7 > C_max: tail term off, so c_v = π(v) and ℓ = −A·(0 − Σ c_v log π(v)).
    for mode, expected in (("keep", [[0.5, 0.3]]), ("drop", [[0.0, 0.0]])):
        loss, _ = grpo_loss(
            trainer,
            sampler,
            torch.ones(1, dtype=torch.float64),
            torch.zeros(1, dtype=torch.long),
            config=LossConfig(masked_token_centering=mode),
            num_tokens_global=1,
            head_trainer_logprobs=head_t,
            head_sampler_logprobs=head_s,
        )
        grad_trainer, grad_head = torch.autograd.grad(loss, [trainer, head_t])
        assert grad_trainer.item() == 0.0
        torch.testing.assert_close(grad_head, torch.tensor(expected, dtype=torch.float64))


def test_low_precision_inputs_are_upcast():
    trainer = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = grpo_loss(
        trainer,
        torch.tensor([-1.1, -1.9]),
        torch.tensor([1.0, -1.0]),
        torch.tensor([0, 1]),
        config=LossConfig.trl_1_16(),
        num_tokens_global=2,
    )
    assert loss.dtype == torch.float32
    loss.backward()
    assert trainer.grad.dtype == torch.bfloat16


def test_normalize_loss():
    assert normalize_loss(torch.tensor(12.0), 8, 2, 3).item() == pytest.approx(12 / 4 / 3)
    assert normalize_loss(torch.tensor(12.0), 1, 4).item() == 12.0  # max(1/4, 1) = 1
    with pytest.raises(ValueError):
        normalize_loss(torch.tensor(1.0), 1, 0)


def test_masked_is_weight():
    config = LossConfig(is_clip_min=0.5, is_clip_max=5.0)
    ratio = torch.tensor([0.4, 0.5, 1.0, 5.0, 6.0, math.inf, math.nan])
    assert masked_is_weight(ratio, config).tolist() == [0.0, 0.5, 1.0, 5.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("config", [LossConfig(score_centering=False), LossConfig()])
def test_extreme_masked_ratios_give_finite_gradients(config):
    """A sampled token with r = ∞ or r = 0 (log-prob −inf on either side) is masked and leaves no NaN behind."""
    trainer = torch.tensor([-1.0, -torch.inf, -0.5], dtype=torch.float64, requires_grad=True)
    sampler = torch.tensor([-torch.inf, -1.0, -0.6], dtype=torch.float64)
    head = torch.tensor([[-0.5, -torch.inf]] * 3, dtype=torch.float64, requires_grad=True)
    loss, _ = grpo_loss(
        trainer,
        sampler,
        torch.ones(3, dtype=torch.float64),
        torch.arange(3),
        config=config,
        num_tokens_global=3,
        head_trainer_logprobs=head,
        head_sampler_logprobs=torch.tensor([[-0.6, -torch.inf]] * 3, dtype=torch.float64),
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(trainer.grad).all()
    assert head.grad is None or torch.isfinite(head.grad).all()  # unused without score centering
    assert trainer.grad[:2].tolist() == [0.0, 0.0] and trainer.grad[2] != 0
