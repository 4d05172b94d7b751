"""Static row shapes (rlasync.model.row_shapes): padded rows give the same log-probs and gradients as unpadded ones
(fp32, <= 1e-5), tree-packed and padding-free, dense and FlexAttention masks; the buckets bound the shapes."""

import pytest
import torch

from rlasync.model import enable_tree_attention, packed_token_scores
from rlasync.model.row_shapes import MAX_BUCKETS, pad_row_tensors, padded_length, row_bucket
from rlasync.model.tree_mask import dense_tree_mask
from tests.unit.model.test_linear_attention import row_tensors

TOL = 1e-5


def test_buckets_are_block_multiples_and_few():
    assert row_bucket(8192) == 512 and row_bucket(4096) == 256 and row_bucket(1000) == 128 and row_bucket(0) == 128
    for budget in (100, 1000, 3000, 4096, 8192, 10_000, 65_536):
        bucket = row_bucket(budget)
        assert bucket % 128 == 0
        assert len({padded_length(n, bucket) for n in range(1, budget + 1)}) <= MAX_BUCKETS
    assert padded_length(1, 128) == 128 and padded_length(128, 128) == 128 and padded_length(129, 128) == 256
    assert padded_length(77, 0) == 77


def _row(seqs, prompts, share_prefixes=True):
    return row_tensors(seqs, prompts, share_prefixes)


def test_padding_is_one_invisible_chain():
    row = _row([[1, 2, 3, 4], [1, 2, 5]], [2, 2])
    n = row.num_tokens
    padded = pad_row_tensors(row, n + 3, pad_token_id=7)
    assert padded.input_ids[n:].tolist() == [7, 7, 7] and padded.position_ids[n:].tolist() == [0, 1, 2]
    mask = dense_tree_mask(padded.subtree_end)
    assert not mask[:n, n:].any() and not mask[n:, :n].any()  # no real query sees padding, and no padded one real
    assert torch.equal(mask[n:, n:], torch.ones(3, 3, dtype=torch.bool).tril())  # never an empty softmax row
    assert torch.equal(mask[:n, :n], dense_tree_mask(row.subtree_end))
    assert torch.equal(padded.token_index, row.token_index) and pad_row_tensors(row, n) is row
    with pytest.raises(ValueError, match="shorter than the row's"):
        pad_row_tensors(row, n - 1)


def _scores_and_grads(model, row, **kwargs):
    model.zero_grad(set_to_none=True)
    scores = packed_token_scores(model, row, **kwargs)
    weights = torch.randn(scores.logprobs.shape, generator=torch.Generator().manual_seed(5))
    ((weights * scores.logprobs).sum() + scores.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return scores.logprobs.detach(), grads


def _assert_same(a, b):
    assert a[0].shape == b[0].shape and (a[0] - b[0]).abs().max().item() <= TOL
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        assert torch.isfinite(b[1][name]).all(), name
        scale = max(1.0, a[1][name].abs().max().item())  # relative to the largest gradient (~10 with large weights)
        assert (a[1][name] - b[1][name]).abs().max().item() <= TOL * scale, name


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_sliding", "gemma2"])
@pytest.mark.parametrize("share_prefixes", [True, False], ids=["tree", "padding_free"])
def test_padded_rows_give_the_same_logprobs_and_gradients(make_model, scenarios, family, share_prefixes):
    model = enable_tree_attention(make_model(family)).train()
    seqs, prompts = scenarios("mixed")
    row = _row(seqs, prompts, share_prefixes)
    reference = _scores_and_grads(model, row, backend="dense")
    for length in (padded_length(row.num_tokens, 16), row.num_tokens + 37):
        assert length > row.num_tokens
        _assert_same(reference, _scores_and_grads(model, pad_row_tensors(row, length, pad_token_id=3), backend="dense"))


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("family", ["qwen3", "qwen3_sliding"])
def test_padded_rows_give_the_same_logprobs_under_flex_block_masks(make_model, scenarios, family):
    """FlexAttention has no CPU backward: values only, eager flex, blocks of 16 (padding spans whole blocks)."""
    model = enable_tree_attention(make_model(family))
    seqs, prompts = scenarios("mixed")
    row = _row(seqs, prompts)
    kwargs = {"backend": "flex", "block_size": 16, "compile_flex": False}
    with torch.no_grad():
        reference = packed_token_scores(model, row, **kwargs).logprobs
        for length in (padded_length(row.num_tokens, 16), row.num_tokens + 37):
            padded = packed_token_scores(model, pad_row_tensors(row, length), **kwargs).logprobs
            assert (padded - reference).abs().max().item() <= TOL


def test_a_padded_padding_free_row_of_a_linear_attention_hybrid_is_exact():
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    config = Qwen3NextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=0,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    model = enable_tree_attention(model).train()
    row = _row([[5, 6, 7, 8, 9], [10, 11, 12, 13], [14, 15, 16]], [2, 2, 1], share_prefixes=False)
    reference = _scores_and_grads(model, row)
    _assert_same(reference, _scores_and_grads(model, pad_row_tensors(row, 32)))
