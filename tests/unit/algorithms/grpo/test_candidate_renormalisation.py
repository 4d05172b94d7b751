"""Reference of the sampling-mask renormalisation (docs/algorithms.md §5.3): log π̃(y) = log π(y) − logsumexp_{v∈S} log π(v)."""

from __future__ import annotations

import math

import pytest
import torch

from rlasync.algorithms.grpo.loss_reference import candidate_logprob_reference

V = 7


def _direct(logits: torch.Tensor, token: int, candidates: list[int] | None, temperature: float) -> torch.Tensor:
    """The same quantity the way the chunked head computes it: mask logits outside S, then log_softmax."""
    scaled = logits / temperature
    if candidates is not None:
        keep = torch.zeros(V, dtype=torch.bool)
        keep[candidates] = True
        scaled = scaled.masked_fill(~keep, -torch.inf)
    return torch.log_softmax(scaled, -1)[token]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("candidates", [None, [0, 3, 4], [2], list(range(V))])
def test_reference_matches_masked_log_softmax(seed, temperature, candidates):
    logits = (2 * torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).requires_grad_()
    for token in candidates or range(V):
        ref = candidate_logprob_reference(logits, token, candidates, temperature)
        direct = _direct(logits, token, candidates, temperature)
        torch.testing.assert_close(ref, direct)
        torch.testing.assert_close(torch.autograd.grad(ref, logits)[0], torch.autograd.grad(direct, logits)[0])


def test_renormalised_probabilities_by_hand():
    logits = torch.tensor([1.0, 2.0, 0.0, -1.0], dtype=torch.float64)
    temperature = 2.0
    weights = [math.exp(z / temperature) for z in logits.tolist()]
    for token in (0, 1):
        value = candidate_logprob_reference(logits, token, [0, 1], temperature).item()
        assert value == pytest.approx(math.log(weights[token] / (weights[0] + weights[1])))
    full = candidate_logprob_reference(logits, 3, None, temperature).item()
    assert full == pytest.approx(math.log(weights[3] / sum(weights)))
    assert candidate_logprob_reference(logits, 3, [0, 1], temperature).item() == -math.inf
    mass = sum(math.exp(candidate_logprob_reference(logits, v, [0, 1, 3], temperature).item()) for v in (0, 1, 3))
    assert mass == pytest.approx(1.0)
