"""The LM head's compiled dense passes: one graph for every chunk length, the vocabulary a constant of it.

Dynamo alone (a recording backend, no inductor) shows what the graph is specialised on; values against the eager
passes."""

import pytest
import torch

from rlasync.config import KernelSettings
from rlasync.model import head_kernels
from rlasync.model.head_kernels import HeadMath


@pytest.fixture
def recorded(monkeypatch):
    """torch.compile through Dynamo with a backend that records each graph's input shapes and runs it eagerly."""
    graphs = []
    real_compile = torch.compile

    def backend(gm, example_inputs):
        values = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
        graphs.append([tuple(v.shape) for v in values if isinstance(v, torch.Tensor)])  # fake: symbolic sizes kept
        return gm.forward

    def compile_recording(function, **kwargs):
        kwargs.pop("backend", None)
        return real_compile(function, backend=backend, **kwargs)

    torch._dynamo.reset()
    monkeypatch.setattr(head_kernels, "_COMPILED", {})
    monkeypatch.setattr(head_kernels, "COMPILE_FAILURES", [])
    monkeypatch.setattr(torch, "compile", compile_recording)
    yield graphs
    torch._dynamo.reset()


def _chunk(rows: int, vocab: int = 37, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed + rows))


def _is_symbolic(size) -> bool:
    return isinstance(size, torch.SymInt)


def test_one_graph_serves_every_chunk_length_with_the_vocabulary_static(recorded):
    math = HeadMath(temperature=0.7, scale=1.0, softcap=None)
    stats = head_kernels.fused("dense_stats", True)
    for rows in (6, 9, 4, 13):
        raw = _chunk(rows)
        lse, mean = stats(raw, math)
        ref_lse, ref_mean = head_kernels.dense_stats(raw, math)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-6)
        torch.testing.assert_close(mean, ref_mean, rtol=0, atol=1e-6)
    assert len(recorded) == 1, recorded  # no recompile for a new chunk length
    (shape,) = recorded[0]
    assert _is_symbolic(shape[0]) and not _is_symbolic(shape[1]) and shape[1] == 37


def test_the_backward_pass_has_static_vocabulary_and_matches_eager(recorded):
    math = HeadMath(temperature=1.0, scale=0.5, softcap=3.0)
    grad = head_kernels.fused("dense_grad", True)
    for rows in (5, 8, 3):
        raw = _chunk(rows, seed=3)
        lse, mean = head_kernels.dense_stats(raw, math)
        coef, g_entropy = -torch.rand(rows), torch.randn(rows)
        torch.testing.assert_close(
            grad(raw, lse, mean, coef, g_entropy, math),
            head_kernels.dense_grad(raw, lse, mean, coef, g_entropy, math),
            rtol=0,
            atol=1e-6,
        )
    assert len(recorded) == 1
    raw_shape, *vectors = recorded[0]
    assert _is_symbolic(raw_shape[0]) and raw_shape[1] == 37
    assert all(len(v) == 1 and _is_symbolic(v[0]) for v in vectors)


def test_all_dynamic_mode_makes_the_vocabulary_a_symbol_and_bad_values_are_refused(recorded):
    math = HeadMath(temperature=1.0, scale=1.0, softcap=None)
    stats = head_kernels.fused("dense_stats", True, KernelSettings(head_dynamic="all").head_dynamic)
    stats(_chunk(6), math)
    (shape,) = recorded[-1]
    assert _is_symbolic(shape[0]) and _is_symbolic(shape[1])
    with pytest.raises(ValueError, match="kernels.head_dynamic must be 'rows'"):
        head_kernels.fused("dense_stats", True, "vocab")
    with pytest.raises(ValueError, match="kernels.head_dynamic='vocab': use one of 'rows', 'all'"):
        KernelSettings(head_dynamic="vocab")
