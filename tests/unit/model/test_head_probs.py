"""The chunked head keeping probabilities (keep_as="probs") instead of logits equals the dense reference."""

import pytest
import torch

from rlasync.config import KernelSettings
from rlasync.model.head import LogitTransform, chunked_token_scores
from rlasync.model.head_kernels import (
    HeadMath,
    dense_grad,
    dense_grad_probs,
    dense_stats,
    dense_stats_probs,
    sparse_fixup,
    transform,
)
from tests.unit.model.test_head import dense_reference, make_inputs

KEEP_ALL = 1 << 30
SCALED = LogitTransform(scale=1.5)


def _run(
    dtype,
    *,
    keep_as,
    chunk_size,
    temperature=0.8,
    transform=SCALED,
    entropy=True,
    extra=True,
    bias=False,
    candidates=False,
    keep_bytes=KEEP_ALL,
    seed=4,
):
    hidden, weight, b, targets, extra_ids, candidate_ids, has = make_inputs(seed=seed, num_terms=13, bias=bias)
    leaves = [t.to(dtype).clone().requires_grad_(True) for t in (hidden, weight) + ((b,) if bias else ())]
    scores = chunked_token_scores(
        leaves[0],
        leaves[1],
        targets,
        bias=leaves[2] if bias else None,
        temperature=temperature,
        transform=transform,
        extra_ids=extra_ids if extra else None,
        candidate_ids=candidate_ids if candidates else None,
        has_candidates=has if candidates else None,
        chunk_size=chunk_size,
        keep_logits_bytes=keep_bytes,
        keep_as=keep_as,
    )
    g = torch.Generator().manual_seed(11)
    loss = (
        torch.randn(13, generator=g, dtype=torch.float64).to(dtype)
        * torch.where(scores.logprobs.isfinite(), scores.logprobs, 0)
    ).sum()
    if entropy:
        loss = loss + (torch.randn(13, generator=g, dtype=torch.float64).to(dtype) * scores.entropy).sum()
    if extra:
        ex = torch.where(scores.extra_logprobs.isfinite(), scores.extra_logprobs, 0.0)
        loss = loss + (torch.randn(ex.shape, generator=g, dtype=torch.float64).to(dtype) * ex).sum()
    loss.backward()
    return scores, [leaf.grad for leaf in leaves], (hidden, weight, b, targets, extra_ids, candidate_ids, has)


@pytest.mark.parametrize("chunk_size", [1, 3, 13, 64])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("keep_bytes", [KEEP_ALL, 5 * 37 * 8])  # every chunk kept, or only the first
def test_kept_probabilities_match_the_dense_reference_in_float64(chunk_size, entropy, extra, keep_bytes):
    scores, grads, inputs = _run(
        torch.float64, keep_as="probs", chunk_size=chunk_size, entropy=entropy, extra=extra, keep_bytes=keep_bytes
    )
    hidden, weight, _, targets, extra_ids, _, _ = inputs
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    ref = dense_reference(*leaves, None, targets, 0.8, LogitTransform(scale=1.5), extra_ids, None, None)
    torch.testing.assert_close(scores.logprobs, ref[0], atol=1e-10, rtol=0)
    torch.testing.assert_close(scores.entropy, ref[1], atol=1e-10, rtol=0)
    g = torch.Generator().manual_seed(11)
    loss = (torch.randn(13, generator=g, dtype=torch.float64) * ref[0]).sum()
    if entropy:
        loss = loss + (torch.randn(13, generator=g, dtype=torch.float64) * ref[1]).sum()
    if extra:
        torch.testing.assert_close(scores.extra_logprobs, ref[2], atol=1e-10, rtol=0)
        finite = torch.where(ref[2].isfinite(), ref[2], 0.0)
        loss = loss + (torch.randn(finite.shape, generator=g, dtype=torch.float64) * finite).sum()
    loss.backward()
    for leaf, grad in zip(leaves, grads):
        torch.testing.assert_close(grad, leaf.grad, atol=1e-10, rtol=0)


def test_repeated_extra_ids_and_the_target_among_them_count_once():
    hidden, weight, _, targets, *_ = make_inputs(seed=8, num_terms=6, bias=False)
    extra = torch.stack([targets, targets, (targets + 1) % 37, (targets + 1) % 37, -torch.ones_like(targets)], 1)
    results = []
    for keep_as in ("logits", "probs"):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight)]
        s = chunked_token_scores(*leaves, targets, extra_ids=extra, keep_logits_bytes=KEEP_ALL, keep_as=keep_as)
        ex = torch.where(s.extra_logprobs.isfinite(), s.extra_logprobs, 0.0)
        (s.logprobs.sum() * 0.7 + (ex * torch.arange(1.0, 6.0, dtype=ex.dtype)).sum()).backward()
        results.append([leaf.grad for leaf in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("entropy", [False, True])
def test_bfloat16_probabilities_are_as_close_to_float64_as_kept_logits(entropy):
    exact, exact_grads, _ = _run(torch.float64, keep_as="logits", chunk_size=13, entropy=entropy)
    errors = {}
    for keep_as in ("logits", "probs"):
        scores, grads, _ = _run(torch.bfloat16, keep_as=keep_as, chunk_size=13, entropy=entropy)
        torch.testing.assert_close(scores.logprobs, exact.logprobs.float(), atol=0.1, rtol=0)
        errors[keep_as] = [float((g.double() - e).abs().max() / e.abs().max()) for g, e in zip(grads, exact_grads)]
    for probs_error, logits_error in zip(errors["probs"], errors["logits"]):
        assert probs_error < 0.05 and probs_error <= 2 * logits_error + 1e-3, errors


@pytest.mark.parametrize(
    "case", [{"transform": LogitTransform(scale=0.5, softcap=3.0)}, {"candidates": True}, {"bias": True}]
)
def test_heads_the_probability_path_does_not_serve_keep_logits_and_give_the_same_result(case):
    kept_probs, probs_grads, _ = _run(torch.float32, keep_as="probs", chunk_size=5, **case)
    kept_logits, logits_grads, _ = _run(torch.float32, keep_as="logits", chunk_size=5, **case)
    assert torch.equal(kept_probs.logprobs, kept_logits.logprobs)
    for a, b in zip(probs_grads, logits_grads):
        assert torch.equal(a, b)


def test_keep_as_is_a_kernel_setting_and_a_bad_value_names_the_field():
    hidden, weight, _, targets, *_ = make_inputs(seed=1, bias=False)
    with pytest.raises(ValueError, match="keep_as must be 'logits' or 'probs'"):
        chunked_token_scores(hidden, weight, targets, keep_as="prob")
    with pytest.raises(ValueError, match="kernels.head_keep='softmax': use one of 'logits', 'probs'"):
        KernelSettings(head_keep="softmax")
    keep = KernelSettings(head_keep="probs").head_keep
    torch.testing.assert_close(
        chunked_token_scores(hidden, weight, targets, keep_as=keep).logprobs,
        chunked_token_scores(hidden, weight, targets).logprobs,
    )


MATHS = [HeadMath(1.0, 1.0, None), HeadMath(1.3, 2.0, None)]


@pytest.mark.parametrize("math", MATHS)
def test_dense_stats_probs_and_dense_grad_probs_equal_the_logit_passes(math):
    g = torch.Generator().manual_seed(2)
    raw = torch.randn(6, 50, generator=g, dtype=torch.float64) * 4
    lse, mean, probs = dense_stats_probs(raw, math)
    lse_ref, mean_ref = dense_stats(raw, math)
    torch.testing.assert_close(lse, lse_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(mean, mean_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(probs, torch.softmax(transform(raw, math), -1), atol=1e-12, rtol=0)
    coef, grad_entropy = (
        torch.randn(6, generator=g, dtype=torch.float64),
        torch.randn(6, generator=g, dtype=torch.float64),
    )
    expected = dense_grad(raw, lse, mean, coef, grad_entropy, math)
    torch.testing.assert_close(
        dense_grad_probs(probs, lse, mean, coef, grad_entropy, math), expected, atol=1e-12, rtol=0
    )
    ids = torch.randint(0, 50, (6, 3), generator=g)
    values = torch.randn(6, 3, generator=g, dtype=torch.float64)
    out_raw, out_probs = expected.clone(), expected.clone()
    sparse_fixup(out_raw, raw, ids, values, lse, mean, coef, grad_entropy, math)
    sparse_fixup(
        out_probs, None, ids, values, lse, mean, coef, grad_entropy, math, z_at=transform(raw.gather(1, ids), math)
    )
    torch.testing.assert_close(out_probs, out_raw, atol=1e-12, rtol=0)


def test_an_underflowed_probability_contributes_nothing():
    probs = torch.tensor([[0.0, 0.25, 0.75]], dtype=torch.float64)
    out = dense_grad_probs(
        probs,
        torch.zeros(1, dtype=torch.float64),
        torch.zeros(1, dtype=torch.float64),
        torch.ones(1, dtype=torch.float64),
        torch.ones(1, dtype=torch.float64),
        MATHS[0],
    )
    assert torch.isfinite(out).all() and out[0, 0] == 0


@pytest.mark.parametrize("name", ["stats", "grad"])
def test_the_probability_passes_trace_as_one_graph_for_torch_compile(name):
    torch._dynamo.reset()
    raw = torch.randn(7, 30)
    lse, mean, probs = dense_stats_probs(raw, MATHS[1])
    if name == "stats":
        compiled = torch.compile(dense_stats_probs, backend="aot_eager", fullgraph=True, dynamic=True)
        for a, b in zip(compiled(raw, MATHS[1]), (lse, mean, probs)):
            torch.testing.assert_close(a, b)
        return
    compiled = torch.compile(dense_grad_probs, backend="aot_eager", fullgraph=True, dynamic=True)
    args = (probs, lse, mean, -torch.ones(7), torch.randn(7), MATHS[1])
    torch.testing.assert_close(compiled(*args), dense_grad_probs(*args))
