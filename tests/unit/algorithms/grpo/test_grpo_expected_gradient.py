"""Score centering: with a constant advantage the *exact* expected gradient over the sampler is zero (docs/algorithms.md §5.3).

A small vocabulary lets us enumerate every sampled token y: E_{y∼μ}[∇_θ ℓ(y)] = Σ_y μ(y) ∇_θ ℓ(y), with
π_θ = softmax(θ) (renormalised over a candidate set S when there is one) and the sampler's head H = μ's top-K.
The identity holds whenever the tail model is exact, i.e. μ = μ̂ (μ = ρ·π_θ outside H): in particular for μ = π_θ,
for any μ when H covers the support, and for a constructed μ̂ ≠ π_θ with IS masking active. Controls show the
computation can fail: no centering, a wrong tail model, and the "drop" variant give non-zero expected gradients.
"""

from __future__ import annotations

import pytest
import torch

from rlasync.algorithms.grpo.loss import LossConfig, grpo_loss

V = 6
NARROW = dict(is_clip_min=0.8, is_clip_max=1.25)  # the masked-IS weights are active (some ratios fall outside)


def _policy_logprobs(theta: torch.Tensor, candidates: torch.Tensor | None) -> torch.Tensor:
    """[V] log π̃_θ: log_softmax(θ), renormalised over the candidate set (−inf outside it)."""
    if candidates is None:
        return torch.log_softmax(theta, -1)
    return torch.log_softmax(theta.masked_fill(~candidates, -torch.inf), -1)


def expected_gradient(
    theta: torch.Tensor,
    log_mu: torch.Tensor,
    config: LossConfig,
    head_ids: torch.Tensor,
    advantage: float = 1.0,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_y μ(y) ∇_θ ℓ(y), enumerating every token y the sampler can draw."""
    theta = theta.detach().clone().requires_grad_()
    log_pi = _policy_logprobs(theta, candidates)
    total = theta.sum() * 0.0
    for y in range(V):
        if log_mu[y] == -torch.inf:
            continue
        loss, _ = grpo_loss(
            log_pi[y : y + 1],
            log_mu[y : y + 1],
            torch.tensor([advantage], dtype=theta.dtype),
            torch.zeros(1, dtype=torch.long),
            config=config,
            num_tokens_global=1,
            head_trainer_logprobs=log_pi[head_ids].unsqueeze(0),
            head_sampler_logprobs=log_mu[head_ids].unsqueeze(0),
        )
        total = total + log_mu[y].exp() * loss
    (grad,) = torch.autograd.grad(total, theta)
    return grad


def _theta(seed: int) -> torch.Tensor:
    return 1.2 * torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _top(log_probs: torch.Tensor, k: int) -> torch.Tensor:
    return log_probs.topk(k).indices


def tail_consistent_sampler(
    log_pi: torch.Tensor, head_ids: torch.Tensor, factors: list[float], rho: float
) -> torch.Tensor:
    """log μ̂: μ̂(v) = f_v·π(v) on head_ids[1:], μ̂ = ρ·π outside the head, head_ids[0] takes the rest."""
    pi = log_pi.exp()
    mu = rho * pi
    last, first = head_ids[0], head_ids[1:]
    mu[first] = pi[first] * torch.tensor(factors, dtype=pi.dtype)
    mu[last] = 0.0
    mu[last] = 1 - mu.sum()
    assert mu[last] > 0, "factors too large for this policy: pick others"
    return mu.log()


@pytest.mark.parametrize("k", [2, 4, V])
@pytest.mark.parametrize("clip", [dict(), NARROW])
@pytest.mark.parametrize("advantage", [1.0, -0.7])
def test_sampler_equal_to_policy(k, clip, advantage):
    theta = _theta(0)
    log_mu = torch.log_softmax(theta, -1)
    for centering in ("keep", "drop"):
        config = LossConfig(masked_token_centering=centering, **clip)
        grad = expected_gradient(theta, log_mu, config, _top(log_mu, k), advantage)
        assert grad.abs().max() <= 1e-6


# (head factors f_v = μ(v)/π(v), ρ): with C = [0.8, 1.25], f = 1.6 and 0.5 are masked, 1.0 is kept. ρ = 1.1 keeps
# 1/ρ inside [C_min, C_max] (the tail term of c_{t,v} is active), ρ = 0.7 pushes it outside.
TAIL_SCALES = {"tail_in": ([1.6, 0.5], 1.1), "tail_out": ([1.6, 1.0], 0.7)}


@pytest.mark.parametrize("case", list(TAIL_SCALES))
@pytest.mark.parametrize("seed", [1, 2])
def test_tail_consistent_sampler_with_active_mask(case, seed):
    theta = _theta(seed)
    log_pi = torch.log_softmax(theta, -1)
    head_ids = _top(log_pi, 3)
    log_mu = tail_consistent_sampler(log_pi, head_ids, *TAIL_SCALES[case])
    config = LossConfig(**NARROW)
    ratio = (log_pi - log_mu).exp()
    masked = (ratio < 0.8) | (ratio > 1.25)
    assert masked.any() and not masked.all()  # the IS mask really removes some sampled tokens, not all
    grad = expected_gradient(theta, log_mu, config, head_ids, advantage=1.3)
    assert grad.abs().max() <= 1e-6
    # Controls on the same inputs: the same objective without centering, or dropping masked tokens, is biased.
    biased = expected_gradient(theta, log_mu, LossConfig(score_centering=False, **NARROW), head_ids, advantage=1.3)
    dropped = expected_gradient(theta, log_mu, LossConfig(masked_token_centering="drop", **NARROW), head_ids, 1.3)
    assert biased.abs().max() > 1e-3
    assert dropped.abs().max() > 1e-3


def test_wrong_tail_model_gives_a_nonzero_expected_gradient():
    """μ ≠ μ̂ (the sampler's tail is not proportional to π_θ's) and a tail ratio is masked: the estimator is biased."""
    theta = _theta(3)
    log_pi = torch.log_softmax(theta, -1)
    head_ids = _top(log_pi, 2)
    mu = log_pi.exp().clone()
    smallest, largest = log_pi.argmin(), log_pi.topk(3).indices[-1]  # both in the tail
    mu[smallest], mu[largest] = 2.0 * mu[smallest], mu[largest] - mu[smallest]  # keeps Σμ = 1; ratio 0.5 is masked
    assert (mu > 0).all()
    grad = expected_gradient(theta, mu.log(), LossConfig(**NARROW), head_ids)
    assert grad.abs().max() > 1e-3


@pytest.mark.parametrize("seed", [4, 5])
def test_full_head_is_exact_for_any_sampler(seed):
    """K = V: nothing is modelled, so the expected gradient vanishes for an arbitrary μ."""
    theta = _theta(seed)
    log_mu = torch.log_softmax(_theta(seed + 10), -1)
    for centering_config in (LossConfig(**NARROW), LossConfig()):
        grad = expected_gradient(theta, log_mu, centering_config, torch.arange(V))
        assert grad.abs().max() <= 1e-6
    assert (
        expected_gradient(theta, log_mu, LossConfig(score_centering=False, **NARROW), torch.arange(V)).abs().max()
        > 1e-3
    )


CANDIDATES = torch.tensor([True, False, True, True, False, True])  # S = {0, 2, 3, 5}


@pytest.mark.parametrize("k", [2, 4, 5])  # K < |S|, K = |S|, K > |S| (head carries -inf ids)
def test_candidate_set_sampler_equal_to_policy(k):
    theta = _theta(6)
    log_pi = _policy_logprobs(theta, CANDIDATES)
    grad = expected_gradient(theta, log_pi.detach(), LossConfig(**NARROW), _top(log_pi, k), candidates=CANDIDATES)
    assert grad.abs().max() <= 1e-6


def test_candidate_set_tail_consistent_sampler():
    theta = _theta(7)
    log_pi = _policy_logprobs(theta, CANDIDATES)
    head_ids = _top(log_pi, 2)
    mu = log_pi.exp().detach().clone()
    p_head = mu[head_ids].sum()
    mu[head_ids] = mu[head_ids] * torch.tensor([0.5, 1.1], dtype=mu.dtype)
    rest = CANDIDATES.clone()
    rest[head_ids] = False
    mu[rest] = mu[rest] * (1 - mu[head_ids].sum()) / (1 - p_head)
    log_mu = mu.log()  # -inf outside S
    assert torch.isclose(mu.sum(), torch.tensor(1.0, dtype=mu.dtype))
    grad = expected_gradient(theta, log_mu, LossConfig(**NARROW), head_ids, candidates=CANDIDATES)
    assert grad.abs().max() <= 1e-6
    biased = expected_gradient(
        theta, log_mu, LossConfig(score_centering=False, **NARROW), head_ids, candidates=CANDIDATES
    )
    assert biased.abs().max() > 1e-3
