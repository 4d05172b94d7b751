"""`kernels.flex_kernel_options`: FlexAttention's kernel options for tuning on a GPU, a config field handed to the
row's `TreeAttention` and passed through to every flex call."""

import pytest
import torch

from rlasync.config import AsyncGRPOConfig, KernelSettings
from rlasync.model import attention
from rlasync.model.tree_mask import build_tree_attention


def test_unset_passes_no_kernel_options_and_a_mapping_is_passed_through(monkeypatch):
    seen = []

    def fake_flex(query, key, value, **kwargs):
        seen.append(kwargs)
        return query

    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "flex_attention", fake_flex)
    q = torch.zeros(1, 2, 4, 8)
    attention._flex_attention(q, q, q, None, None, None, compile=False)
    assert "kernel_options" not in seen[-1]
    options = KernelSettings(flex_kernel_options='{"BLOCK_M1": 32, "BLOCK_N1": 64}').flex_kernel_options
    attention._flex_attention(q, q, q, None, None, None, compile=False, kernel_options=options)
    assert seen[-1]["kernel_options"] == {"BLOCK_M1": 32, "BLOCK_N1": 64}


def test_the_row_carries_the_options_of_the_flex_backend_only():
    end, depth = torch.tensor([2, 2]), torch.tensor([0, 1])
    flex = build_tree_attention(end, depth, backend="flex", compile=False, kernel_options={"BLOCK_M": 64})
    assert flex.kernel_options == {"BLOCK_M": 64}
    assert build_tree_attention(end, depth, backend="dense", kernel_options={"BLOCK_M": 64}).kernel_options is None


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"BLOCK_M"'])
def test_a_bad_value_names_the_field(text):
    with pytest.raises(ValueError, match="kernels.flex_kernel_options"):
        KernelSettings(flex_kernel_options=text)
    with pytest.raises(ValueError, match="kernels.flex_kernel_options"):
        AsyncGRPOConfig(kernels={"flex_kernel_options": text})


def test_a_compiled_layer_reads_the_options_without_breaking_its_graph():
    # the learner compiles each decoder layer; the attention inside reads the options of the row's TreeAttention
    # while Dynamo traces it: a constant, so fullgraph compiles (a graph break split every layer in two on a GPU)
    tree = build_tree_attention(
        torch.tensor([2, 2]), torch.tensor([0, 1]), backend="flex", compile=False, kernel_options={"BLOCK_M": 64}
    )

    @torch.compile(fullgraph=True, backend="eager")
    def layer(x, tree_attention):
        return x * tree_attention.kernel_options["BLOCK_M"]

    assert float(layer(torch.ones(2), tree).sum()) == 128.0
