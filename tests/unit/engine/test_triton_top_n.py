"""The Triton top-N (`sampler_compiled.top_n_ids` over `triton_sampling.chunk_top_n`) against the int64-key ranking
the compiled sampler used before it (`rank_keys(...).topk`): same ids in the same order, on rows with exact ties across chunks, -inf holes, rows with
fewer finite tokens than N, -0.0 next to +0.0, and a vocabulary that is not a multiple of the chunk; and the compiled
sampler's formulation with the kernel picking its top-N against the eager sampler on mixed batches."""

import torch


def reference_top_n(x: torch.Tensor, n: int) -> torch.Tensor:
    """The slow obvious rule: sort each row by (value descending, id ascending), -0.0 == +0.0, keep n."""
    out = []
    for row in x.tolist():
        order = sorted(range(len(row)), key=lambda i: (-(row[i] + 0.0), i))
        out.append(order[:n])
    return torch.tensor(out)


def compare_top_n_with_reference() -> None:
    from rlasync.engine.sampler_compiled import key_ids, rank_keys
    from rlasync.engine.sampler_compiled import top_n_ids as top_n
    from rlasync.engine.triton_sampling import TOP_N_CHUNK

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(5)
    rows, vocab = 10, 2 * TOP_N_CHUNK + 917
    x = (torch.randn(rows, vocab, generator=generator) * 4).to(torch.bfloat16).float()  # bf16 values: many ties
    x[x < -5] = float("-inf")
    x[0] = float("-inf")
    x[0, [3, vocab - 1, TOP_N_CHUNK + 1]] = torch.tensor([1.0, 2.0, 1.0])  # three finite tokens, N = 8: -inf fill
    x[1] = 0.5  # all tied: the lowest ids
    x[2, :] = float("-inf")
    x[2, [10, TOP_N_CHUNK + 10, 2 * TOP_N_CHUNK + 10]] = 7.0  # a tie spread over three chunks
    x[2, [5, 2 * TOP_N_CHUNK + 5]] = torch.tensor([0.0, -0.0])
    x[2, 7] = -0.0
    x[3, :] = float("-inf")  # nothing finite
    x[4, TOP_N_CHUNK : TOP_N_CHUNK + 20] = 30.0  # the top twenty all in one chunk, tied
    ids = torch.arange(vocab)
    for n in (1, 8, 20):
        expected = reference_top_n(x, n)
        assert key_ids(rank_keys(x, ids).topk(n, dim=-1).values).tolist() == expected.tolist()
        got = top_n(x.to(device), n).cpu()
        assert got.tolist() == expected.tolist(), n
    assert top_n(x.to(device), 8)[0, :3].tolist() == [vocab - 1, 3, TOP_N_CHUNK + 1]
    assert top_n(x.to(device), 4)[2].tolist() == [10, TOP_N_CHUNK + 10, 2 * TOP_N_CHUNK + 10, 5]


def compare_sampler_with_kernel() -> None:
    """`sample_compiled(top_n_kernel=True)` (`_core` eagerly, the kernel after it) gives the eager sampler's
    results: mixed batches with ties, -inf ids, every filter; a vocabulary smaller than N (-1 / -inf padding)."""
    from rlasync.engine.base import SamplingParams
    from rlasync.engine.sampler import BatchSampling, sample
    from rlasync.engine.sampler_compiled import sample_compiled
    from tests.unit.engine.test_sampler import make_batch
    from tests.unit.engine.test_sampler_compiled import assert_same

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seed in range(6):
        params, logits, seen, seeds = make_batch(rows=16, vocab=40, seed=seed, windowed=seed % 2 == 1)
        batch = BatchSampling.from_params(params, seeds, device)
        steps = (torch.arange(16) % 5).to(device)
        logits, seen = logits.to(device), None if seen is None else seen.to(device)
        expected = sample(logits, batch, steps, seen_tokens=seen)
        got = sample_compiled(logits, batch, steps, seen_tokens=seen, compile=False, top_n_kernel=True)
        assert got.topn_ids is not None
        assert_same(expected, got, atol=1e-6)
    small = [SamplingParams(temperature=1.0, num_logprobs=8, seed=i) for i in range(3)]
    batch = BatchSampling.from_params(small, [1, 2, 3], device)
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0)).to(device)
    steps = torch.zeros(3, dtype=torch.int64, device=device)
    got = sample_compiled(logits, batch, steps, compile=False, top_n_kernel=True)
    assert got.topn_ids[:, 6:].tolist() == [[-1, -1]] * 3
    assert_same(sample(logits, batch, steps), got, atol=1e-6)


def test_triton_top_n_ranks_as_the_int64_keys(triton_check):
    triton_check(compare_top_n_with_reference, __file__)


def test_compiled_sampler_with_the_top_n_kernel_equals_the_eager_sampler(triton_check):
    triton_check(compare_sampler_with_kernel, __file__, "sampler")


def test_top_n_refuses_more_than_the_vocabulary():
    import pytest

    pytest.importorskip("triton", reason="Triton is not installed (it ships with CUDA builds of torch)")
    from rlasync.engine.triton_sampling import chunk_top_n

    with pytest.raises(ValueError, match="n=9 must be in"):
        chunk_top_n(torch.zeros(2, 8), 9)


def test_a_kernel_triton_cannot_build_gives_way_to_the_int64_keys(monkeypatch, caplog):
    """A Triton error from the top-N kernel (e.g. no kernel for this GPU): the same ids by the int64 keys, one
    warning, and the kernel is not chosen again; any other error propagates."""
    import logging

    import pytest

    from rlasync.engine import sampler_compiled
    from rlasync.engine.base import SamplingParams
    from rlasync.engine.sampler import BatchSampling, sample

    CompilationError = type("CompilationError", (Exception,), {"__module__": "triton.compiler.errors"})

    def no_kernel(masked, n):
        raise CompilationError("at 12:4: unsupported")

    monkeypatch.setattr(sampler_compiled, "top_n_ids", no_kernel)
    monkeypatch.setattr(sampler_compiled, "_TOP_N_KERNEL_FAILED", [])
    params = [SamplingParams(temperature=1.0, num_logprobs=8, seed=i) for i in range(4)]
    batch = BatchSampling.from_params(params, [11, 12, 13, 14])
    logits = (torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 2).round()  # ties
    steps = torch.arange(4)
    with caplog.at_level(logging.WARNING, logger="rlasync.engine.sampler_compiled"):
        for _ in range(2):
            got = sampler_compiled.sample_compiled(logits, batch, steps, compile=False, top_n_kernel=True)
            expected = sample(logits, batch, steps)
            assert torch.equal(got.topn_ids, expected.topn_ids)
            assert torch.allclose(got.topn_logprobs, expected.topn_logprobs, atol=1e-6)
    assert len([r for r in caplog.records if "top-N log-prob kernel failed" in r.message]) == 1
    assert sampler_compiled._TOP_N_KERNEL_FAILED == ["CompilationError: at 12:4: unsupported"]

    def device_fault(masked, n):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(sampler_compiled, "top_n_ids", device_fault)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        sampler_compiled.sample_compiled(logits, batch, steps, compile=False, top_n_kernel=True)


if __name__ == "__main__":
    import sys

    compare_sampler_with_kernel() if sys.argv[1:] == ["sampler"] else compare_top_n_with_reference()
