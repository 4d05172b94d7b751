"""The tree masks built from subtree_end equal a slow reference read off the samples themselves."""

import numpy as np
import pytest
import torch

from rlasync.model.block_mask import BLOCK_FIELDS, tree_block_mask, tree_block_sparsity, tree_mask_mod
from rlasync.model.tree_mask import dense_tree_mask
from rlasync.packing import TreeRow, pack, sample_positions
from rlasync.records import RolloutSample


def random_row(seed: int) -> TreeRow:
    """Groups sharing prompts, multi-turn extensions and unrelated samples, with random lengths."""
    rng = np.random.default_rng(seed)
    row, made = TreeRow(), []
    for _ in range(int(rng.integers(1, 9))):
        kind = rng.integers(0, 3)
        if kind == 0 or not made:
            ids = rng.integers(0, 5, int(rng.integers(1, 12))).tolist()  # small alphabet: accidental sharing
        elif kind == 1:
            base = made[int(rng.integers(len(made)))]
            ids = base[: int(rng.integers(1, len(base) + 1))] + rng.integers(0, 5, int(rng.integers(0, 6))).tolist()
        else:
            ids = made[int(rng.integers(len(made)))] + rng.integers(0, 5, int(rng.integers(1, 6))).tolist()
        made.append(ids)
        row.add(
            RolloutSample(
                input_ids=ids,
                completion_mask=[1] * len(ids),
                sampler_logprobs=[0.0] * len(ids),
                advantage=0,
                group_id=0,
            )
        )
    return row


def reference_mask(row: TreeRow, num_tokens: int, window: int | None = None) -> torch.Tensor:
    """Slow: token j of a sample is visible from token p of the same sample iff j <= p (and p - j < window)."""
    mask = torch.zeros(num_tokens, num_tokens, dtype=torch.bool)
    for positions in sample_positions(row):
        for p, q in enumerate(positions.tolist()):
            for j, k in enumerate(positions.tolist()[: p + 1]):
                if window is None or p - j < window:
                    mask[q, k] = True
    return mask


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("window", [None, 1, 3])
def test_dense_mask_from_subtree_end_equals_the_samples_own_causal_masks(seed, window):
    row = random_row(seed)
    packed = pack(row)
    mask = dense_tree_mask(torch.as_tensor(packed.subtree_end), torch.as_tensor(packed.position_ids), window)
    assert torch.equal(mask, reference_mask(row, packed.num_tokens, window))


def _block_map(num_blocks, indices):
    out = torch.zeros(indices.shape[-1], indices.shape[-1], dtype=torch.bool)
    for i in range(out.shape[0]):
        out[i, indices[0, 0, i, : num_blocks[0, 0, i]].long()] = True
    return out


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("window", [None, 2, 7])
def test_block_mask_is_exact_without_window_and_sound_with_one(seed, window):
    from torch.nn.attention.flex_attention import create_block_mask

    block = 4
    packed = pack(random_row(seed))
    end, depth = torch.as_tensor(packed.subtree_end), torch.as_tensor(packed.position_ids)
    n = packed.num_tokens
    padded = -(-n // block) * block
    partial, full = tree_block_sparsity(end, depth, window, block)
    mine = tree_block_mask(end, depth, window, block)
    assert torch.equal(_block_map(mine.kv_num_blocks, mine.kv_indices), partial)
    assert torch.equal(_block_map(mine.full_kv_num_blocks, mine.full_kv_indices), full)
    assert mine.seq_lengths == (n, n)
    # create_block_mask evaluates the mask_mod on every pair: the ground truth at block level
    truth = create_block_mask(tree_mask_mod(end, depth, window, padded), 1, 1, n, n, device="cpu", BLOCK_SIZE=block)
    true_partial = _block_map(truth.kv_num_blocks, truth.kv_indices)
    true_full = _block_map(truth.full_kv_num_blocks, truth.full_kv_indices)
    if window is None:
        assert torch.equal(partial, true_partial) and torch.equal(full, true_full)
    else:  # never drops a visible block, never calls a partly masked block full
        assert not ((true_partial | true_full) & ~(partial | full)).any()
        assert not (full & ~true_full).any()
    # and the mask_mod itself is the dense rule
    q, k = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    mask_mod = tree_mask_mod(end, depth, window, padded)
    assert torch.equal(mask_mod(0, 0, q, k), dense_tree_mask(end, depth, window))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("seed", range(4))
def test_eager_flex_attention_with_the_block_mask_equals_dense_sdpa(seed):
    from torch.nn.attention.flex_attention import flex_attention

    packed = pack(random_row(seed + 100))
    end, depth = torch.as_tensor(packed.subtree_end), torch.as_tensor(packed.position_ids)
    n = packed.num_tokens
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, 8, generator=g) for h in (4, 2, 2))
    for window in (None, 3):
        flex = flex_attention(q, k, v, block_mask=tree_block_mask(end, depth, window, 4), enable_gqa=True)
        mask = dense_tree_mask(end, depth, window)
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(flex, dense, atol=1e-5, rtol=0)


def chain_block_mask(n: int, block_size: int, device: str = "cpu"):
    """One sample of n tokens (plain causal attention) as a tree row's block mask."""
    return tree_block_mask(torch.arange(1, n + 1, device=device), torch.arange(n, device=device), None, block_size)


def test_the_block_masks_block_dims_are_marked_dynamic_for_the_compiler():
    """A compiled layer would otherwise specialize on the first row's block count (see the CUDA test below); the
    mark is Dynamo's own attribute on the tensor."""
    block_mask = chain_block_mask(96, 32)
    for name in BLOCK_FIELDS:
        tensor = getattr(block_mask, name)
        if tensor is not None:
            assert set(range(2, tensor.dim())) <= getattr(tensor, "_dynamo_weak_dynamic_indices", set()), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor's FlexAttention lowering specializes on CUDA")
@pytest.mark.filterwarnings("ignore")
def test_a_compiled_layer_keeps_one_graph_across_row_lengths_on_cuda():
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    class Tree:  # as TreeAttention: the row's masks in a dict on an object passed as a keyword
        def __init__(self, block_mask):
            self.masks = {None: block_mask}

    def layer(x, *, tree):
        q = x.transpose(1, 2)
        return flex_attention(q, q, q, block_mask=tree.masks[None]).transpose(1, 2).sum(-1)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, dynamic=True)
    for n in (1024, 896, 768):
        compiled(
            torch.randn(1, n, 2, 64, device="cuda", dtype=torch.bfloat16), tree=Tree(chain_block_mask(n, 128, "cuda"))
        )
    assert counters["stats"]["unique_graphs"] == 1
