"""Rows aligned to mask blocks (rlasync.packing.align_blocks) give the same log-probs and gradients as the rows
as packed (fp32, <= 1e-5): tree-packed and padding-free, full and sliding-window layers, dense masks, and the values
under FlexAttention's block masks."""

import pytest
import torch

from rlasync.model import enable_tree_attention, packed_row_to_tensors, packed_token_scores
from rlasync.packing import TreeRow, align_blocks, pack
from rlasync.records import RolloutSample
from tests.unit.model.test_row_shapes import _assert_same, _scores_and_grads

TOL = 1e-5


def packed_row(seqs, prompts, share_prefixes=True):
    row = TreeRow(share_prefixes=share_prefixes)
    for seq, prompt in zip(seqs, prompts):
        mask = [0] * prompt + [1] * (len(seq) - prompt)
        row.add(RolloutSample(seq, mask, [0.0] * len(seq), advantage=0.0, group_id=0))
    return pack(row)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_sliding", "gemma2"])
@pytest.mark.parametrize("share_prefixes", [True, False], ids=["tree", "padding_free"])
def test_aligned_rows_give_the_same_logprobs_and_gradients(make_model, scenarios, family, share_prefixes):
    model = enable_tree_attention(make_model(family)).train()
    seqs, prompts = scenarios("mixed")
    row = packed_row(seqs, prompts, share_prefixes)
    reference = _scores_and_grads(model, packed_row_to_tensors(row), backend="dense")
    for block_size, at in ((8, "segments"), (5, "segments"), (8, "roots")):
        aligned = align_blocks(row, block_size, at=at, pad_token_id=3)
        assert aligned.num_tokens > row.num_tokens
        _assert_same(reference, _scores_and_grads(model, packed_row_to_tensors(aligned), backend="dense"))


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("family", ["qwen3", "qwen3_sliding"])
def test_aligned_rows_give_the_same_logprobs_under_flex_block_masks(make_model, scenarios, family):
    """FlexAttention has no CPU backward: values only, eager flex, rows aligned to its blocks of 16."""
    model = enable_tree_attention(make_model(family))
    seqs, prompts = scenarios("mixed")
    row = packed_row(seqs, prompts)
    kwargs = {"backend": "flex", "block_size": 16, "compile_flex": False}
    with torch.no_grad():
        reference = packed_token_scores(model, packed_row_to_tensors(row), **kwargs).logprobs
        aligned = packed_token_scores(model, packed_row_to_tensors(align_blocks(row, 16)), **kwargs).logprobs
    assert (aligned - reference).abs().max().item() <= TOL


def test_aligned_rows_plan_and_score_on_the_varlen_backend(make_model, scenarios):
    """Each padding chain is a segment of its own for the varlen tree attention (its CPU reference loop)."""
    model = enable_tree_attention(make_model("qwen3")).train()
    seqs, prompts = scenarios("mixed")
    row = packed_row(seqs, prompts)
    reference = _scores_and_grads(model, packed_row_to_tensors(row), backend="dense")
    aligned = packed_row_to_tensors(align_blocks(row, 8), segments=True)
    assert aligned.segments.num_segments > len(row.tree_cu_seqlens_q) - 1
    _assert_same(reference, _scores_and_grads(model, aligned, backend="varlen"))
