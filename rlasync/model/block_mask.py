"""FlexAttention block masks of the tree rule (`k <= q < subtree_end[k]`, see `rlasync.model.tree_mask`).

`tree_block_mask` builds a row's `BlockMask` from subtree_end in O(N + nb²) (nb = blocks of `block_size` tokens),
never evaluating the mask on [N, N]: block sparsity from per-block extrema (`tree_block_sparsity`) plus the exact
per-element `mask_mod` (`tree_mask_mod`) for the partial blocks.

Separate from the dense masks because it is the one part that needs FlexAttention (imported lazily: the dense path
and the tests of the sparsity maps run on any torch) and because its correctness argument is its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

DEFAULT_BLOCK_SIZE = 128


def tree_mask_mod(
    subtree_end: torch.Tensor, position_ids: torch.Tensor, sliding_window: int | None, padded_length: int
) -> Callable:
    """FlexAttention mask_mod of the tree rule. The captured tensors are padded to `padded_length` (a multiple of
    the block size) so reads at out-of-range indices of the last partial block stay in bounds (padding: invisible)."""
    n = subtree_end.shape[0]
    end = F.pad(subtree_end, (0, padded_length - n), value=0)
    if not sliding_window:

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < end[kv_idx])

        return mask_mod

    depth = F.pad(position_ids, (0, padded_length - n), value=0)

    def windowed_mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < end[kv_idx]) & (depth[q_idx] - depth[kv_idx] < sliding_window)

    return windowed_mask_mod


def tree_block_sparsity(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    sliding_window: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-level ([nb, nb] bool, query block x key block) `(partial, full)` maps of the tree mask, in O(N + nb²).

    Key block j holds keys [jB, (j+1)B). Key k is visible to the contiguous query range [k, subtree_end[k]), so
    block j reaches exactly the query blocks j .. (max_k subtree_end[k] - 1) // B. It is full for query block i
    > j iff every key's subtree covers the whole block: (i+1)B <= min_k subtree_end[k]. A window can only drop
    blocks (depth differences all >= window) or spoil fullness (some difference >= window); both are bounded with
    per-block depth extrema, so the map never drops a visible pair and never calls a masked pair full.
    """
    n = subtree_end.shape[0]
    num_blocks = max(1, math.ceil(n / block_size))
    pad = num_blocks * block_size - n
    device = subtree_end.device
    end_max = F.pad(subtree_end, (0, pad), value=0).view(num_blocks, block_size).amax(1)
    end_min = F.pad(subtree_end, (0, pad), value=n).view(num_blocks, block_size).amin(1)
    blocks = torch.arange(num_blocks, device=device)
    q_block, k_block = blocks[:, None], blocks[None, :]
    last_reached = torch.div(end_max - 1, block_size, rounding_mode="floor")
    nonempty = (k_block <= q_block) & (q_block <= last_reached[None, :])
    full = (k_block < q_block) & ((q_block + 1) * block_size <= end_min[None, :])
    if sliding_window:
        big = torch.iinfo(torch.int64).max // 4
        depth_max = F.pad(position_ids, (0, pad), value=-big).view(num_blocks, block_size).amax(1)
        depth_min = F.pad(position_ids, (0, pad), value=big).view(num_blocks, block_size).amin(1)
        nonempty &= (depth_min[:, None] - depth_max[None, :]) < sliding_window
        full &= (depth_max[:, None] - depth_min[None, :]) < sliding_window
    return nonempty & ~full, full & nonempty


def tree_block_mask(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    sliding_window: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Any:
    """The row's FlexAttention `BlockMask`, built from subtree_end without evaluating the mask on [N, N]."""
    from torch.nn.attention.flex_attention import BlockMask

    n = subtree_end.shape[0]
    partial, full = tree_block_sparsity(subtree_end, position_ids, sliding_window, block_size)
    num_blocks = partial.shape[0]
    kv_num_blocks, kv_indices = _ordered_blocks(partial)
    full_kv_num_blocks, full_kv_indices = _ordered_blocks(full)
    mask_mod = tree_mask_mod(subtree_end, position_ids, sliding_window, num_blocks * block_size)
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks[None, None],
        kv_indices[None, None],
        full_kv_num_blocks[None, None],
        full_kv_indices[None, None],
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(n, n),
    )
    mark_block_dims_dynamic(block_mask)
    return block_mask


BLOCK_FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def mark_block_dims_dynamic(block_mask: Any) -> None:
    """Mark the block dims of a `BlockMask`'s tensors dynamic for torch.compile. A decoder layer compiled with
    `dynamic=True` still specialized on the first row's block count on CUDA (Inductor's FlexAttention lowering
    guards on it) and compiled again at the first row of another padded length: 13 s at step 6 of the SmolLM2 sums
    run on an H100 with cold caches. Marked, one graph serves every row length (`bench/flex_recompile.py`). No
    effect in eager mode."""
    for name in BLOCK_FIELDS:
        tensor = getattr(block_mask, name, None)
        if isinstance(tensor, torch.Tensor):
            for dim in range(2, tensor.dim()):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _ordered_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nb, nb] bool -> (count per row [nb] int32, the present column indices first [nb, nb] int32)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts, order.to(torch.int32)
