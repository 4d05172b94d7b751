"""Loss metrics on synthetic ratios, against values computed by hand (docs/algorithms.md §5.2 table, §5.3 sampling/*)."""

from __future__ import annotations

import math

import pytest
import torch

from rlasync.algorithms.grpo.loss import LossConfig, grpo_loss

RATIOS = [0.4, 0.7, 1.0, 1.3, 6.0, 0.9]
ADVANTAGES = [-1.0, -1.0, 1.0, 1.0, 1.0, 1.0]
SAMPLES = [0, 0, 0, 1, 1, 1]
NEG_INF = -math.inf


def _metrics(config: LossConfig, ratios=RATIOS, advantages=ADVANTAGES, samples=SAMPLES, **kwargs):
    sampler = torch.linspace(-2.0, -0.5, len(ratios), dtype=torch.float64)
    trainer = sampler + torch.tensor(ratios, dtype=torch.float64).log()
    _, metrics = grpo_loss(
        trainer,
        sampler,
        torch.tensor(advantages, dtype=torch.float64),
        torch.tensor(samples, dtype=torch.long),
        config=config,
        num_tokens_global=len(ratios),
        **kwargs,
    )
    return metrics


def _head(m: int) -> dict[str, torch.Tensor]:
    """Each term's sampler head: μ = 0.5, 0.2 and one absent id (mass 0.7); the trainer's head is irrelevant here."""
    sampler = torch.tensor([[math.log(0.5), math.log(0.2), NEG_INF]] * m, dtype=torch.float64)
    return dict(head_trainer_logprobs=sampler.clone(), head_sampler_logprobs=sampler)


def test_clipped_surrogate_metrics_by_hand():
    m = _metrics(LossConfig(score_centering=False, epsilon_high=0.28), entropy=torch.tensor([1.0, 2, 3, 4, 5, 6]))
    # low: r < 0.8 and A < 0 -> terms 0, 1; high: r > 1.28 and A > 0 -> terms 3, 4
    assert m["clip_ratio/low_mean"] == (2.0, 6.0)
    assert m["clip_ratio/high_mean"] == (2.0, 6.0)
    assert m["clip_ratio/region_mean"] == (4.0, 6.0)
    assert m["clip_ratio/low_min"] == 0.0  # sample 0: 2/3, sample 1: 0
    assert m["clip_ratio/high_max"] == pytest.approx(2 / 3)  # sample 0: 0, sample 1: 2/3
    assert m["sampling/masked_mean"] == (2.0, 6.0)  # 0.4 < 0.5 and 6.0 > 5.0
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx((10.3, 6.0))
    assert m["ratio"] == pytest.approx((10.3, 6.0))
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(0.4)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(6.0)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(6.0))
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx((sum(abs(math.log(r)) for r in RATIOS), 6.0))
    assert m["kl"] == pytest.approx((sum(r - 1 - math.log(r) for r in RATIOS), 6.0))
    assert m["entropy"] == (21.0, 6.0)
    assert "sampling/sampler_mass" not in m


def test_score_centering_counts_trust_region_exits_and_reports_sampler_mass():
    """Nothing is clipped under score centering, but clip_ratio/* still count terms outside the trust region."""
    m = _metrics(LossConfig(epsilon_high=0.28), **_head(len(RATIOS)))
    assert m["clip_ratio/low_mean"] == (2.0, 6.0)
    assert m["clip_ratio/high_mean"] == (2.0, 6.0)
    assert m["sampling/sampler_mass"] == pytest.approx((6 * 0.7, 6.0))
    assert "entropy" not in m  # not given


def test_trl_1_16_masks_nothing():
    m = _metrics(LossConfig.trl_1_16())
    assert m["sampling/masked_mean"] == (0.0, 6.0)
    assert m["clip_ratio/low_mean"] == (2.0, 6.0)  # 1 - 0.2 = 0.8
    assert m["clip_ratio/high_mean"] == (2.0, 6.0)  # 1.2


def test_values_have_the_shapes_the_reducer_expects():
    m = _metrics(LossConfig(), entropy=torch.ones(6), **_head(6))
    pairs = {k for k, v in m.items() if isinstance(v, tuple)}
    floats = {k for k, v in m.items() if isinstance(v, float)}
    assert pairs | floats == set(m)
    assert floats == {
        "clip_ratio/low_min",
        "clip_ratio/high_max",
        "sampling/sampling_logp_difference/max",
        "sampling/importance_sampling_ratio/min",
        "sampling/importance_sampling_ratio/max",
    }
    assert all(isinstance(x, float) for k in pairs for x in m[k])


def test_pairs_reduce_to_global_means_across_ranks():
    """Σnum/Σden over two ranks equals the metric of the concatenated batch (a mean of ratios would not)."""
    config = LossConfig(score_centering=False)
    whole = _metrics(config)
    left = _metrics(config, RATIOS[:2], ADVANTAGES[:2], SAMPLES[:2])
    right = _metrics(config, RATIOS[2:], ADVANTAGES[2:], SAMPLES[2:])
    for key in ("clip_ratio/low_mean", "sampling/masked_mean", "ratio", "kl"):
        num = left[key][0] + right[key][0]
        den = left[key][1] + right[key][1]
        assert num / den == pytest.approx(whole[key][0] / whole[key][1])
    assert min(left["clip_ratio/low_min"], right["clip_ratio/low_min"]) == whole["clip_ratio/low_min"]


def test_empty_micro_batch():
    empty = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    loss, m = grpo_loss(
        empty,
        torch.zeros(0),
        torch.zeros(0),
        torch.zeros(0, dtype=torch.long),
        config=LossConfig(),
        num_tokens_global=0,
        entropy=torch.zeros(0),
        head_trainer_logprobs=torch.zeros(0, 8),
        head_sampler_logprobs=torch.zeros(0, 8),
    )
    assert loss.item() == 0.0
    loss.backward()
    assert m["ratio"] == (0.0, 0.0) and m["sampling/sampler_mass"] == (0.0, 0.0)
    assert math.isnan(m["clip_ratio/low_min"]) and math.isnan(m["sampling/importance_sampling_ratio/max"])


def test_per_sample_clip_fractions():
    """Fractions are per sample (by `sample_index`, any ids, any order), then min / max over samples."""
    ratios = [0.4, 0.7, 1.0, 0.7, 1.3, 6.0, 1.5]
    advantages = [-1.0, -1.0, 1.0, -1.0, 1.0, 1.0, 1.0]
    samples = [7, 7, 7, 3, 3, 3, 7]
    m = _metrics(LossConfig(score_centering=False), ratios, advantages, samples)
    # sample 7: terms 0, 1, 2, 6 -> low 2/4, high 1/4; sample 3: terms 3, 4, 5 -> low 1/3, high 2/3
    assert m["clip_ratio/low_min"] == pytest.approx(1 / 3)
    assert m["clip_ratio/high_max"] == pytest.approx(2 / 3)
    assert m["clip_ratio/low_mean"] == (3.0, 7.0)


@pytest.mark.parametrize(
    "samples, num_samples",
    # absent samples (1, 2, 4, 6; then 2, 3) must not count: with [0, 1, 0, 1, 0, 1] each present sample has a
    # third of its terms low-clipped, an absent one would bring the minimum to 0
    [(SAMPLES, 2), ([3, 3, 0, 0, 5, 5], 7), ([0, 0, 0, 0, 0, 0], 1), ([0, 1, 0, 1, 0, 1], 4)],
)
def test_metrics_with_a_known_sample_count_equal_the_reference(samples, num_samples):
    """`num_samples` (the learner passes it, so nothing waits for the device) and without it (the largest index
    is read back) give the plain-Python reference's per-sample extrema, samples without terms ignored; deferred
    metrics resolve to the same values."""
    from rlasync.algorithms.grpo.loss_metrics import resolve_metrics
    from rlasync.algorithms.grpo.loss_reference import grpo_metrics_reference

    config = LossConfig(score_centering=False, epsilon_high=0.28)
    sampler = torch.linspace(-2.0, -0.5, len(RATIOS), dtype=torch.float64)
    trainer = sampler + torch.tensor(RATIOS, dtype=torch.float64).log()
    advantages, index = torch.tensor(ADVANTAGES, dtype=torch.float64), torch.tensor(samples)
    reference = grpo_metrics_reference(trainer, sampler, advantages, index, config)
    plain = _metrics(config, samples=samples)
    known = _metrics(config, samples=samples, num_samples=num_samples)
    deferred = _metrics(config, samples=samples, num_samples=num_samples, defer_metrics=True)
    (resolved,), extra = resolve_metrics([deferred], torch.tensor(2.5), torch.tensor([1.5]))
    for got in (plain, known, resolved):
        assert got.keys() == reference.keys()
        for key, want in reference.items():
            assert pytest.approx(want if isinstance(want, tuple) else (want,)) == (
                got[key] if isinstance(got[key], tuple) else (got[key],)
            ), key
    assert extra == [2.5, 1.5]


def test_known_sample_count_of_an_empty_micro_batch_gives_nan_extrema():
    m = _metrics(LossConfig(score_centering=False), ratios=[], advantages=[], samples=[], num_samples=0)
    assert math.isnan(m["clip_ratio/low_min"]) and math.isnan(m["clip_ratio/high_max"])
    assert m["ratio"] == (0.0, 0.0)
