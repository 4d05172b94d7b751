"""The chunked head's fast paths: kept logits, chunks sized by memory, the fused dense passes, the dW accumulation."""

import pytest
import torch

from rlasync.config import KernelSettings
from rlasync.model.head import (
    CHUNK_ELEMENTS,
    WORKSPACE_BYTES_PER_LOGIT,
    LogitTransform,
    chunked_token_scores,
    plan_chunk_size,
    plan_kept_chunks,
)
from rlasync.model.head_kernels import HeadMath, dense_grad, dense_stats, sparse_fixup, transform
from rlasync.model.head_matmul import accumulate_matmul, matmul_to
from tests.unit.model.test_head import dense_reference, make_inputs

CPU = torch.device("cpu")


def _scores_and_grads(dtype, seed=4, weights=None, **kwargs):
    hidden, weight, bias, targets, extra, candidates, has = make_inputs(seed=seed, num_terms=13)
    leaves = [t.to(dtype).requires_grad_(True) for t in (hidden, weight, bias)]
    scores = chunked_token_scores(
        leaves[0],
        leaves[1],
        targets,
        bias=leaves[2],
        temperature=0.8,
        transform=LogitTransform(0.5, 3.0),
        extra_ids=extra,
        candidate_ids=candidates,
        has_candidates=has,
        **kwargs,
    )
    g = torch.Generator().manual_seed(11)
    finite = [torch.where(torch.isfinite(x), x, 0.0) for x in (scores.logprobs, scores.extra_logprobs)]
    loss = (torch.randn(13, generator=g) * finite[0]).sum() + (torch.randn(13, generator=g) * scores.entropy).sum()
    (loss + (torch.randn(finite[1].shape, generator=g) * finite[1]).sum()).backward()
    return scores, [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep_chunks", [1, 2, 3])
def test_kept_logits_give_the_same_values_and_gradients_as_recomputing(dtype, keep_chunks):
    chunk_bytes = 5 * 37 * torch.empty((), dtype=dtype).element_size()  # 13 terms in chunks of 5, 4, 4
    recompute, recompute_grads = _scores_and_grads(dtype, chunk_size=5, keep_logits_bytes=0)
    kept, kept_grads = _scores_and_grads(dtype, chunk_size=5, keep_logits_bytes=keep_chunks * chunk_bytes)
    for a, b in zip(
        (recompute.logprobs, recompute.entropy, recompute.extra_logprobs),
        (kept.logprobs, kept.entropy, kept.extra_logprobs),
    ):
        assert torch.equal(a, b)
    for a, b in zip(recompute_grads, kept_grads):
        assert torch.equal(a, b)


def test_kept_logits_survive_a_retained_graph():
    hidden, weight, _, targets, *_ = make_inputs(seed=1)
    hidden = hidden.float().requires_grad_(True)
    scores = chunked_token_scores(hidden, weight.float(), targets, chunk_size=4, keep_logits_bytes=1 << 20)
    scores.logprobs.sum().backward(retain_graph=True)
    first = hidden.grad.clone()
    scores.logprobs.sum().backward()
    torch.testing.assert_close(hidden.grad, 2 * first, atol=1e-6, rtol=0)


def test_plan_kept_chunks_fits_the_budget():
    assert plan_kept_chunks(13, 5, 37, torch.bfloat16, 0) == 0
    assert plan_kept_chunks(13, 5, 37, torch.bfloat16, 5 * 37 * 2 * 2 + 1) == 2
    assert plan_kept_chunks(13, 5, 37, torch.float32, 10**9) == 3  # never more than there are chunks


def test_chunk_size_is_chosen_by_memory_and_evened_out():
    per_term = 100 * WORKSPACE_BYTES_PER_LOGIT
    assert plan_chunk_size(11, 100, CPU, chunk_bytes=5 * per_term) == 4  # 5 per chunk -> 3 chunks -> 4, 4, 3
    assert plan_chunk_size(11, 100, CPU, chunk_bytes=per_term // 2) == 1  # at least one term
    assert plan_chunk_size(11, 100, CPU, chunk_bytes=10**9) == 11  # a single chunk holds every term
    assert plan_chunk_size(0, 100, CPU) == 1
    assert plan_chunk_size(10**6, 151_936, CPU) == CHUNK_ELEMENTS // 151_936  # the CPU default: ~2^27 logits
    assert plan_chunk_size(20, 100, CPU, chunk_size=7, chunk_bytes=1) == 7  # an explicit chunk_size wins
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        plan_chunk_size(11, 100, CPU, chunk_size=0)
    with pytest.raises(ValueError, match="chunk_bytes must be > 0"):
        plan_chunk_size(11, 100, CPU, chunk_bytes=0)


@pytest.mark.parametrize("chunk_bytes", [37 * WORKSPACE_BYTES_PER_LOGIT * 3, 10**9])
def test_memory_sized_chunks_match_the_dense_reference_in_float64(chunk_bytes):
    hidden, weight, bias, targets, extra, candidates, has = make_inputs(seed=21)
    transform_ = LogitTransform(2.0, 5.0)
    ref_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    ref = dense_reference(*ref_leaves, targets, 1.1, transform_, extra, candidates, has)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    mine = chunked_token_scores(
        leaves[0],
        leaves[1],
        targets,
        bias=leaves[2],
        temperature=1.1,
        transform=transform_,
        extra_ids=extra,
        candidate_ids=candidates,
        has_candidates=has,
        chunk_bytes=chunk_bytes,
        keep_logits_bytes=1 << 20,
    )
    for a, b in zip((mine.logprobs, mine.entropy, mine.extra_logprobs), ref):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    finite = [torch.where(torch.isfinite(x), x, 0.0) for x in ref]
    (finite[0].sum() + 0.3 * finite[1].sum() - finite[2].sum()).backward()
    finite = [torch.where(torch.isfinite(x), x, 0.0) for x in (mine.logprobs, mine.entropy, mine.extra_logprobs)]
    (finite[0].sum() + 0.3 * finite[1].sum() - finite[2].sum()).backward()
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=0)


MATHS = [HeadMath(1.0, 1.0, None), HeadMath(0.7, 0.5, 3.0), HeadMath(1.3, 2.0, None)]


@pytest.mark.parametrize("math", MATHS)
def test_dense_stats_is_logsumexp_and_softmax_mean(math):
    raw = torch.randn(6, 50, dtype=torch.float64) * 4
    z = raw * math.scale
    if math.softcap is not None:
        z = math.softcap * torch.tanh(z / math.softcap)
    z = z / math.temperature
    lse, mean = dense_stats(raw, math)
    torch.testing.assert_close(lse, torch.logsumexp(z, -1), atol=1e-12, rtol=0)
    torch.testing.assert_close(mean, (torch.softmax(z, -1) * z).sum(-1), atol=1e-12, rtol=0)


@pytest.mark.parametrize("math", MATHS)
def test_dense_grad_and_sparse_fixup_are_the_autograd_gradient(math):
    """A loss Σ g_H·H + Σ a·z[ids] − w·lse with repeated ids: the fused grad equals autograd through `transform`."""
    g = torch.Generator().manual_seed(3)
    raw = (torch.randn(5, 40, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    ids = torch.randint(0, 40, (5, 6), generator=g)
    ids[:, 1] = ids[:, 0]  # a repeated id sums its contributions
    values = torch.randn(5, 6, generator=g, dtype=torch.float64)
    grad_entropy = torch.randn(5, generator=g, dtype=torch.float64)
    weight_of_lse = values.sum(-1)
    z = transform(raw, math)
    lse = torch.logsumexp(z, -1)
    entropy = lse - (torch.softmax(z, -1) * z).sum(-1)
    ((grad_entropy * entropy).sum() + (values * z.gather(1, ids)).sum() - (weight_of_lse * lse).sum()).backward()
    with torch.no_grad():
        lse, mean = dense_stats(raw, math)
        out = dense_grad(raw, lse, mean, -weight_of_lse, grad_entropy, math)
        sparse_fixup(out, raw, ids, values, lse, mean, -weight_of_lse, grad_entropy, math)
    torch.testing.assert_close(out, raw.grad, atol=1e-12, rtol=0)


def test_dense_grad_writes_the_logits_dtype():
    raw = torch.randn(3, 20).bfloat16()
    lse, mean = dense_stats(raw, MATHS[1])
    assert lse.dtype == torch.float32
    out = dense_grad(raw, lse, mean, torch.ones(3), None, MATHS[1])
    assert out.dtype == torch.bfloat16 and out.shape == raw.shape


@pytest.mark.parametrize("name,args", [("stats", ()), ("grad", (True,)), ("grad", (False,))])
def test_the_dense_passes_trace_as_one_graph_for_torch_compile(name, args):
    """fullgraph=True: no graph break (the CUDA path compiles them with inductor); aot_eager keeps the test cheap."""
    torch._dynamo.reset()
    raw = torch.randn(7, 30)
    lse, mean = dense_stats(raw, MATHS[1])
    if name == "stats":
        compiled = torch.compile(dense_stats, backend="aot_eager", fullgraph=True, dynamic=True)
        for a, b in zip(compiled(raw, MATHS[1]), (lse, mean)):
            torch.testing.assert_close(a, b)
        return
    grad_entropy = torch.randn(7) if args[0] else None
    compiled = torch.compile(dense_grad, backend="aot_eager", fullgraph=True, dynamic=True)
    expected = dense_grad(raw, lse, mean, -torch.ones(7), grad_entropy, MATHS[1])
    torch.testing.assert_close(compiled(raw, lse, mean, -torch.ones(7), grad_entropy, MATHS[1]), expected)


def test_accumulate_matmul_and_matmul_to_match_float64():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 5, generator=g), torch.randn(5, 6, generator=g)
    reference = (a.double() @ b.double()).float()
    acc = torch.ones(8, 6)
    accumulate_matmul(acc, a, b)  # same dtype: addmm_ in place
    torch.testing.assert_close(acc, reference + 1, atol=1e-5, rtol=0)
    half_a, half_b = a.bfloat16(), b.bfloat16()
    half_reference = (half_a.double() @ half_b.double()).float()
    acc = torch.zeros(8, 6)
    accumulate_matmul(acc, half_a, half_b)  # bf16 into float32 (out_dtype on CUDA, a cast elsewhere)
    torch.testing.assert_close(acc, half_reference, atol=0.05, rtol=0.02)
    out = matmul_to(half_a, half_b, torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, half_reference, atol=0.05, rtol=0.02)


def test_several_chunks_and_one_chunk_give_the_same_bfloat16_gradients():
    _, one = _scores_and_grads(torch.bfloat16, chunk_size=13)
    _, several = _scores_and_grads(torch.bfloat16, chunk_size=3)
    for a, b in zip(one, several):
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.02)


def test_autocast_computes_the_logits_in_its_dtype_and_returns_float32_gradients():
    hidden, weight, _, targets, extra, *_ = make_inputs(seed=6, bias=False)
    leaves = [t.float().requires_grad_(True) for t in (hidden, weight)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = chunked_token_scores(leaves[0], leaves[1], targets, extra_ids=extra, chunk_size=4)
    plain = chunked_token_scores(hidden.bfloat16(), weight.bfloat16(), targets, extra_ids=extra, chunk_size=4)
    assert torch.equal(scores.logprobs, plain.logprobs) and torch.equal(scores.entropy, plain.entropy)
    scores.logprobs.sum().backward()
    assert leaves[0].grad.dtype == torch.float32 and leaves[1].grad.dtype == torch.float32
    full = chunked_token_scores(*[t.float().detach().requires_grad_(True) for t in (hidden, weight)], targets)
    assert (scores.logprobs - full.logprobs).abs().max() < 0.1


def test_bad_memory_settings_name_the_field(monkeypatch):
    hidden, weight, _, targets, *_ = make_inputs(seed=2, bias=False)
    with pytest.raises(ValueError, match="keep_logits_bytes must be >= 0"):
        chunked_token_scores(hidden, weight, targets, keep_logits_bytes=-1)
    with pytest.raises(ValueError, match="chunk_bytes must be > 0"):
        chunked_token_scores(hidden, weight, targets, chunk_bytes=-5)
    with pytest.raises(ValueError, match="kernels.head_dynamic must be 'rows'"):
        chunked_token_scores(hidden, weight, targets, dynamic="vocab")
    with pytest.raises(ValueError, match="kernels.head_compile"):
        KernelSettings(head_compile="yes")


def test_passes_that_fail_to_compile_warn_once_and_run_eagerly(monkeypatch, caplog):
    """A GPU or torch build inductor cannot serve: the compiled passes fall back to the eager ones (same values and
    gradients), with one warning, and are not tried again."""
    import torch._dynamo.exc

    from rlasync.model import head_kernels

    attempts = []

    def failing_compile(function, **kwargs):
        def compiled(*args):
            attempts.append(function.__name__)
            raise torch._dynamo.exc.TorchDynamoException("no backend for this device")

        return compiled

    monkeypatch.setattr(head_kernels, "_COMPILED", {})
    monkeypatch.setattr(head_kernels, "COMPILE_FAILURES", [])
    monkeypatch.setattr(torch, "compile", failing_compile)
    eager, eager_grads = _scores_and_grads(torch.float32, chunk_size=5, compile_kernels=False)
    with caplog.at_level("WARNING"):
        fallen, fallen_grads = _scores_and_grads(torch.float32, chunk_size=5, compile_kernels=True)
        again, _ = _scores_and_grads(torch.float32, chunk_size=5, compile_kernels=True)
    assert attempts == ["dense_stats"]  # the first failure turned both passes eager
    assert caplog.text.count("failed to compile") == 1 and head_kernels.COMPILE_FAILURES
    for a, b in zip((eager.logprobs, eager.entropy), (fallen.logprobs, fallen.entropy)):
        assert torch.equal(a, b)
    for a, b in zip(eager_grads, fallen_grads):
        assert torch.equal(a, b)
    assert torch.equal(again.logprobs, eager.logprobs)
