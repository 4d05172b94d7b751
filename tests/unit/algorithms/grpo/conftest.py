"""Random loss-term batches shaped like the chunked LM head's output (see rlasync/algorithms/grpo/loss.py for shapes)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch


@dataclass
class TermBatch:
    trainer_logprobs: torch.Tensor  # [M]
    sampler_logprobs: torch.Tensor  # [M]
    advantages: torch.Tensor  # [M]
    sample_index: torch.Tensor  # [M] long
    entropy: torch.Tensor  # [M]
    head_trainer_logprobs: torch.Tensor  # [M, K], -inf where the id is outside the candidate set
    head_sampler_logprobs: torch.Tensor  # [M, K]


def make_term_batch(seed: int, m: int = 24, vocab: int = 8, k: int = 4, drift: float = 0.6) -> TermBatch:
    """Sampler and trainer distributions over a small vocabulary, some rows filtered to a candidate set.

    The sampled token is drawn from μ, the head is μ's top-k (so rows with fewer than k candidates carry -inf
    entries), and the trainer's logits drift from the sampler's so that ratios spread over roughly [0.3, 3].
    """
    g = torch.Generator().manual_seed(seed)
    sampler_logits = 1.5 * torch.randn(m, vocab, generator=g, dtype=torch.float64)
    trainer_logits = sampler_logits + drift * torch.randn(m, vocab, generator=g, dtype=torch.float64)
    sizes = torch.randint(2, vocab + 1, (m,), generator=g)
    ranks = sampler_logits.argsort(-1, descending=True).argsort(-1)
    candidates = ranks < sizes.unsqueeze(-1)
    log_mu = torch.log_softmax(sampler_logits.masked_fill(~candidates, -torch.inf), -1)
    log_pi = torch.log_softmax(trainer_logits.masked_fill(~candidates, -torch.inf), -1)
    sampled = torch.multinomial(log_mu.exp(), 1, generator=g)
    head_ids = log_mu.topk(k, -1).indices
    advantages = torch.randn(m, generator=g, dtype=torch.float64)
    advantages[::7] = 0.0
    return TermBatch(
        trainer_logprobs=log_pi.gather(-1, sampled).squeeze(-1),
        sampler_logprobs=log_mu.gather(-1, sampled).squeeze(-1),
        advantages=advantages,
        sample_index=torch.randint(0, 5, (m,), generator=g).sort().values,
        entropy=torch.rand(m, generator=g, dtype=torch.float64),
        head_trainer_logprobs=log_pi.gather(-1, head_ids),
        head_sampler_logprobs=log_mu.gather(-1, head_ids),
    )


@pytest.fixture
def term_batch():
    return make_term_batch
