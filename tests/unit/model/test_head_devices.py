"""The head at the library defaults of each device (on CUDA: compiled dense passes, kept logits, bf16 -> fp32 addmm)
against the float64 reference on CPU."""

import pytest
import torch

from rlasync.model.head import LogitTransform, chunked_token_scores
from rlasync.model.head_matmul import _out_dtype_matmul, accumulate_matmul
from tests.unit.model.test_head import dense_reference, make_inputs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_at_device_defaults_matches_the_float64_reference(device, chunk_size, dtype):
    hidden, weight, bias, targets, extra, candidates, has = make_inputs(seed=8, num_terms=13, vocab=300)
    transform = LogitTransform(0.5, 3.0)
    ref_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    ref = dense_reference(*ref_leaves, targets, 0.8, transform, extra, candidates, has)
    leaves = [t.to(device, dtype).requires_grad_(True) for t in (hidden, weight, bias)]
    mine = chunked_token_scores(
        leaves[0],
        leaves[1],
        targets.to(device),
        bias=leaves[2],
        temperature=0.8,
        transform=transform,
        extra_ids=extra.to(device),
        candidate_ids=candidates.to(device),
        has_candidates=has.to(device),
        chunk_size=chunk_size,
    )
    atol = 1e-4 if dtype == torch.float32 else 0.05  # measured on CPU: 7e-7 / 0.01
    for a, b in zip((mine.logprobs, mine.entropy, mine.extra_logprobs), ref):
        assert torch.equal(torch.isfinite(a.cpu()), torch.isfinite(b))
        finite = torch.isfinite(b)
        torch.testing.assert_close(a.cpu().double()[finite], b.detach()[finite], atol=atol, rtol=0.02)
    for outputs in (ref, (mine.logprobs, mine.entropy, mine.extra_logprobs)):
        finite = [torch.where(torch.isfinite(x), x, 0.0) for x in outputs]
        (finite[0].sum() + 0.3 * finite[1].sum() - finite[2].sum()).backward()
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad.cpu().double(), b.grad, atol=atol, rtol=0.02)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_addmm_accumulates_into_float32_on_cuda():
    assert _out_dtype_matmul(torch.device("cuda"))  # torch >= 2.9 on CUDA: the one-pass path is taken
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 300, generator=g), torch.randn(64, 32, generator=g)
    acc = torch.ones(300, 32, device="cuda")
    accumulate_matmul(acc, a.cuda().bfloat16().t(), b.cuda().bfloat16())
    expected = a.bfloat16().double().t() @ b.bfloat16().double() + 1
    torch.testing.assert_close(acc.cpu().double(), expected, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entropy", [0.0, 0.3])
def test_kept_probabilities_at_device_defaults_match_the_float64_reference(device, entropy):
    """keep_as="probs" (no softcap, no candidate sets, no bias) in bf16, compiled on CUDA, kept whole."""
    hidden, weight, _, targets, extra, *_ = make_inputs(seed=5, num_terms=13, vocab=300, bias=False)
    transform = LogitTransform(scale=1.5)
    ref_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    ref = dense_reference(*ref_leaves, None, targets, 0.8, transform, extra, None, None)
    leaves = [t.to(device, torch.bfloat16).requires_grad_(True) for t in (hidden, weight)]
    mine = chunked_token_scores(
        leaves[0],
        leaves[1],
        targets.to(device),
        temperature=0.8,
        transform=transform,
        extra_ids=extra.to(device),
        keep_as="probs",
        keep_logits_bytes=1 << 24,
    )
    for a, b in zip((mine.logprobs, mine.entropy), ref[:2]):
        torch.testing.assert_close(a.cpu().double(), b.detach(), atol=0.05, rtol=0.02)
    for outputs in (ref, (mine.logprobs, mine.entropy, mine.extra_logprobs)):
        finite = torch.where(torch.isfinite(outputs[2]), outputs[2], 0.0)
        (outputs[0].sum() + entropy * outputs[1].sum() - finite.sum()).backward()
    for a, b in zip(leaves, ref_leaves):  # bf16 grads: within 2% of the largest (kept logits: 1.1% measured on CPU)
        torch.testing.assert_close(a.grad.cpu().double(), b.grad, atol=0.02 * float(b.grad.abs().max()), rtol=0)
