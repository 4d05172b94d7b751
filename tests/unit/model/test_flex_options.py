"""$RLASYNC_FLEX_KERNEL_OPTIONS: FlexAttention's kernel options for tuning on a GPU, parsed once, passed through."""

import pytest
import torch

from rlasync.model import attention
from rlasync.model.tree_mask import build_tree_attention


@pytest.fixture(autouse=True)
def fresh_cache():
    attention.reset_flex_kernel_options()
    yield
    attention.reset_flex_kernel_options()


def test_unset_passes_no_kernel_options_and_a_json_object_is_passed_through(monkeypatch):
    seen = []

    def fake_flex(query, key, value, **kwargs):
        seen.append(kwargs)
        return query

    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "flex_attention", fake_flex)
    q = torch.zeros(1, 2, 4, 8)
    monkeypatch.delenv(attention.FLEX_KERNEL_OPTIONS_ENV, raising=False)
    attention._flex_attention(q, q, q, None, None, None, compile=False)
    assert "kernel_options" not in seen[-1]
    attention.reset_flex_kernel_options()
    monkeypatch.setenv(attention.FLEX_KERNEL_OPTIONS_ENV, '{"BLOCK_M1": 32, "BLOCK_N1": 64}')
    attention._flex_attention(q, q, q, None, None, None, compile=False)
    assert seen[-1]["kernel_options"] == {"BLOCK_M1": 32, "BLOCK_N1": 64}


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"BLOCK_M"'])
def test_a_bad_value_names_the_variable(monkeypatch, text):
    monkeypatch.setenv(attention.FLEX_KERNEL_OPTIONS_ENV, text)
    with pytest.raises(ValueError, match="RLASYNC_FLEX_KERNEL_OPTIONS"):
        attention.flex_kernel_options()


def test_a_compiled_layer_reads_the_options_without_breaking_its_graph(monkeypatch):
    # the learner compiles each decoder layer; the attention inside reads the options while Dynamo traces it.
    # Parsed eagerly by build_tree_attention first, the read is a constant: fullgraph compiles (JSON parsing under
    # Dynamo is a graph break, which split every layer in two on a GPU)
    monkeypatch.setenv(attention.FLEX_KERNEL_OPTIONS_ENV, '{"BLOCK_M": 64}')
    build_tree_attention(torch.tensor([2, 2]), torch.tensor([0, 1]), backend="flex", compile=False)

    @torch.compile(fullgraph=True, backend="eager")
    def layer(x):
        return x * attention.flex_kernel_options()["BLOCK_M"]

    assert float(layer(torch.ones(2)).sum()) == 128.0
