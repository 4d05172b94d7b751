"""The chunked LM head equals full logits -> log_softmax, in values and in gradients (hidden, weight, bias)."""

import math

import pytest
import torch

from rlasync.model.head import LogitTransform, chunked_token_scores


def dense_reference(hidden, weight, bias, targets, temperature, transform, extra, candidates, has):
    """Slow and obvious: full [M, V] logits, log_softmax, per-row loops for the candidate sets."""
    logits = torch.nn.functional.linear(hidden, weight, bias) * transform.scale
    if transform.softcap is not None:
        logits = transform.softcap * torch.tanh(logits / transform.softcap)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    target_lp, extra_lp = [], []
    for m in range(hidden.shape[0]):
        norm = torch.zeros(())
        support = None
        if candidates is not None and has[m]:
            support = sorted({int(c) for c in candidates[m] if c >= 0})
            if support:
                norm = torch.logsumexp(logp[m, support], dim=0)
            else:
                support = None
        if support is not None and int(targets[m]) not in support:
            target_lp.append(torch.tensor(float("-inf"), dtype=logp.dtype))
        else:
            target_lp.append(logp[m, targets[m]] - norm)
        if extra is not None:
            row = []
            for v in extra[m].tolist():
                if v < 0 or (support is not None and v not in support):
                    row.append(torch.tensor(float("-inf")))
                else:
                    row.append(logp[m, v] - norm)
            extra_lp.append(torch.stack(row))
    return torch.stack(target_lp), entropy, torch.stack(extra_lp) if extra is not None else None


def make_inputs(seed, num_terms=11, hidden_size=16, vocab=37, k=4, c=6, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_terms, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    targets = torch.randint(0, vocab, (num_terms,), generator=g)
    extra = torch.randint(-1, vocab, (num_terms, k), generator=g)
    candidates = torch.randint(-1, vocab, (num_terms, c), generator=g)
    has = torch.rand(num_terms, generator=g) < 0.6
    has[0] = True
    candidates[:, 0] = targets  # the sampled token is a candidate ...
    candidates[1, 0] = (targets[1] + 1) % vocab  # ... except on row 1 (a sampler inconsistency: -inf)
    candidates[1, 1:] = torch.where(candidates[1, 1:] == targets[1], -1, candidates[1, 1:])
    has[1] = True
    candidates[0, 1] = candidates[0, 2]  # a repeated id counts once
    extra[:, 0] = candidates[:, 0]  # an extra id inside S_t
    return hidden, weight, b, targets, extra, candidates, has


@pytest.mark.parametrize("chunk_size", [1, 3, 11, 64])
@pytest.mark.parametrize(
    "temperature,transform",
    [(1.0, LogitTransform()), (0.7, LogitTransform(scale=0.5, softcap=3.0)), (1.3, LogitTransform(scale=2.0))],
)
def test_chunked_head_matches_dense_values_and_gradients_in_float64(chunk_size, temperature, transform):
    hidden, weight, bias, targets, extra, candidates, has = make_inputs(seed=chunk_size)  # float64: exact check
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    ref = dense_reference(*leaves, targets, temperature, transform, extra, candidates, has)
    mine_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    mine = chunked_token_scores(
        mine_leaves[0],
        mine_leaves[1],
        targets,
        bias=mine_leaves[2],
        temperature=temperature,
        transform=transform,
        extra_ids=extra,
        candidate_ids=candidates,
        has_candidates=has,
        chunk_size=chunk_size,
    )
    torch.testing.assert_close(mine.logprobs, ref[0], atol=1e-10, rtol=0)
    assert torch.isneginf(mine.logprobs[1])  # the target outside its candidate set
    torch.testing.assert_close(mine.entropy, ref[1], atol=1e-10, rtol=0)
    torch.testing.assert_close(mine.extra_logprobs, ref[2], atol=1e-10, rtol=0)

    g = torch.Generator().manual_seed(7)
    w_lp, w_h = torch.randn(targets.shape, generator=g), torch.randn(targets.shape, generator=g)
    w_ex = torch.randn(extra.shape, generator=g)

    def functional(lp, ent, ex):
        def finite(x):
            return torch.where(torch.isfinite(x), x, 0.0)

        return (w_lp * finite(lp)).sum() + (w_h * ent).sum() + (w_ex * finite(ex)).sum()

    functional(*ref).backward()
    functional(mine.logprobs, mine.entropy, mine.extra_logprobs).backward()
    for ref_leaf, leaf in zip(leaves, mine_leaves):
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, atol=1e-10, rtol=0)


def test_chunked_head_without_optional_inputs_is_plain_log_softmax():
    hidden, weight, _, targets, *_ = make_inputs(seed=3, bias=False)
    hidden = hidden.float().requires_grad_(True)
    scores = chunked_token_scores(hidden, weight.float(), targets, chunk_size=4)
    assert scores.extra_logprobs is None
    ref = torch.log_softmax(hidden.detach() @ weight.float().t(), dim=-1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(scores.logprobs, ref, atol=1e-5, rtol=0)
    scores.logprobs.sum().backward()  # only the log-probs feed the loss: entropy/extra grads are absent
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def test_renormalised_probabilities_sum_to_one_over_the_candidate_set():
    hidden, weight, _, _, _, _, _ = make_inputs(seed=5, bias=False)
    candidates = torch.tensor([[3, 7, 9, -1]] * hidden.shape[0])
    scores = chunked_token_scores(
        hidden.float(), weight.float(), candidates[:, 0], extra_ids=candidates, candidate_ids=candidates
    )
    mass = scores.extra_logprobs[:, :3].exp().sum(-1)
    torch.testing.assert_close(mass, torch.ones_like(mass), atol=1e-5, rtol=1e-6)
    assert torch.isneginf(scores.extra_logprobs[:, 3]).all()


def test_frozen_head_weight_gets_no_gradient_and_hidden_still_does():
    hidden, weight, _, targets, *_ = make_inputs(seed=9, bias=False)
    hidden = hidden.float().requires_grad_(True)
    frozen = weight.float()
    chunked_token_scores(hidden, frozen, targets, chunk_size=5).logprobs.sum().backward()
    assert frozen.grad is None and hidden.grad is not None


def test_bfloat16_head_is_close_to_float32():
    hidden, weight, _, targets, *_ = make_inputs(seed=2, bias=False)
    full = chunked_token_scores(hidden.float(), weight.float(), targets)
    half = chunked_token_scores(hidden.bfloat16(), weight.bfloat16(), targets)
    assert half.logprobs.dtype == torch.float32
    assert (half.logprobs - full.logprobs).abs().max() < 0.1


def test_empty_row_gives_empty_scores():
    weight = torch.randn(10, 4, requires_grad=True)
    hidden = torch.zeros(0, 4, requires_grad=True)
    scores = chunked_token_scores(hidden, weight, torch.zeros(0, dtype=torch.long), chunk_size=2)
    assert scores.logprobs.shape == (0,)
    scores.logprobs.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_logit_transform_reads_scale_and_softcap_from_configs():
    from types import SimpleNamespace

    assert LogitTransform.from_config(SimpleNamespace()) == LogitTransform(1.0, None)
    assert LogitTransform.from_config(SimpleNamespace(logit_scale=0.25)).scale == 0.25
    assert LogitTransform.from_config(SimpleNamespace(logits_scaling=4.0)).scale == 0.25
    hyperclova = SimpleNamespace(logits_scaling=4.0, model_type="hyperclovax")
    assert LogitTransform.from_config(hyperclova).scale == 4.0
    assert LogitTransform.from_config(SimpleNamespace(final_logit_softcapping=30.0)).softcap == 30.0
    assert math.isclose(LogitTransform.from_config(SimpleNamespace(output_multiplier=0.5)).scale, 0.5)
