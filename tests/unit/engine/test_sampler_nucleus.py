"""top_p and min_p without top_k (TRL's `top_p=0.95` / `min_p=0.05` recipes): the candidate set is the nucleus / the
min-p set over the whole vocabulary, in the eager sampler, the compiled formulation and the per-slot path, checked
against an obvious reference (sort, cumulative sum, mask) written here with torch's own float64 ops."""

from __future__ import annotations

import pytest
import torch

from rlasync.config import AsyncGRPOConfig
from rlasync.engine.base import SamplingParams
from rlasync.engine.sampler import BatchSampling, processed_logprobs, sample
from rlasync.engine.sampler_compiled import sample_compiled
from rlasync.engine.slot_sampling import SlotSampling

VOCAB = 300


def reference_set(logits: torch.Tensor, temperature: float, top_p: float, min_p: float) -> list[int]:
    """The candidate set of one row, ascending: rank by (probability desc, id asc), keep the ranked prefix whose
    preceding mass is below top_p, then keep p >= min_p * p_max."""
    x = logits.double() / (temperature if temperature > 0 else 1.0)
    probs = torch.softmax(x, dim=-1)
    order = sorted(range(len(x)), key=lambda i: (-float(x[i]), i))
    ranked = probs[order]
    before = torch.cumsum(ranked, dim=0) - ranked  # the mass of the tokens ranked above
    keep = torch.zeros(len(x), dtype=torch.bool)
    keep[torch.tensor(order)] = before < top_p
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    return torch.nonzero(keep).flatten().tolist()


def make_rows(seed: int, rows: int = 12) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # peaked and flat rows: a nucleus of a few tokens and one of most of the vocabulary
    scale = torch.tensor([0.3, 1.0, 3.0, 6.0] * (rows // 4))[:, None]
    return torch.randn(rows, VOCAB, generator=gen) * scale


CASES = [
    SamplingParams(temperature=1.0, top_p=0.95),
    SamplingParams(temperature=0.7, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.3, min_p=0.2),
    SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1),
    SamplingParams(temperature=0.0, top_p=0.8),  # greedy row: its set is still reported
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-p{p.top_p}-m{p.min_p}")
@pytest.mark.parametrize("path", ["eager", "formulation", "slots"])
def test_nucleus_and_min_p_sets_without_top_k(params, path):
    logits = make_rows(seed=int(params.top_p * 100) + int((params.min_p or 0) * 1000))
    rows = logits.shape[0]
    seeds = list(range(11, 11 + rows))
    steps = torch.arange(rows) % 3
    if path == "slots":
        slots = SlotSampling(capacity=rows, device="cpu")
        batch, steps = slots.batch(list(range(rows)), [params] * rows, seeds, steps.tolist())
    else:
        batch = BatchSampling.from_params([params] * rows, seeds, "cpu")
    assert batch.plan.full_sort == (params.top_p < 1) and batch.plan.max_top_k == 0
    if path == "formulation":
        result = sample_compiled(logits, batch, steps, compile=False)
    else:
        result = sample(logits, batch, steps)
    logp = processed_logprobs(logits, batch)
    widths = []
    for b in range(rows):
        expected = reference_set(logits[b], params.temperature, params.top_p, params.min_p or 0.0)
        count = int(result.num_candidates[b])
        assert result.candidate_ids[b, :count].tolist() == expected, b
        assert (result.candidate_ids[b, count:] == -1).all()
        assert int(result.token_ids[b]) in expected
        # the processed distribution is the softmax over the set, -inf outside it
        assert torch.isfinite(logp[b]).nonzero().flatten().tolist() == expected
        x = logits[b].double() / (params.temperature if params.temperature > 0 else 1.0)
        renormalised = x[expected] - torch.logsumexp(x[expected], dim=0)
        torch.testing.assert_close(logp[b, expected].double(), renormalised, atol=1e-5, rtol=0)
        widths.append(count)
    assert max(widths) > 1  # the sets are not trivially the sampled token
    if params.top_p >= 0.9 and not params.min_p:
        assert max(widths) > VOCAB // 2  # a flat row's nucleus spans most of the vocabulary: no top_k cap


def test_config_accepts_top_p_or_min_p_alone_and_requests_the_sets():
    for fields in ({"top_p": 0.95}, {"min_p": 0.05}):
        config = AsyncGRPOConfig(**fields)
        params = SamplingParams.from_config(config)
        assert config.top_k == 0 and params.filters and params.return_sampling_mask
        assert params.num_logprobs == config.num_sampler_logprobs  # score centering keeps its head
