"""Static row shapes: a packed row's unique tokens padded up to a bucket (docs/algorithms.md §5.5).

Rows are planned to a fixed token budget, so their lengths N vary below it. Compiled decoder layers (and CUDA
graphs over them) want few distinct shapes: `pad_row_tensors` pads N up to a multiple of `row_bucket(budget)`
(at most `MAX_BUCKETS` shapes per budget, each a multiple of the FlexAttention block size).

The padding is invisible. It is one extra chain of tokens after the row: positions 0..P-1 and
`subtree_end = N + P` for every padded token, so under the tree rule (key k visible to query q iff k <= q <
subtree_end[k]) a padded key sits after every real query (k > q: visible to none of them), a real key's subtree
ends before every padded query, and each padded query sees the padded keys before it (never an empty softmax
row). Loss terms index real positions only (`token_index` is unchanged), so padding carries no loss term; a
padding-free row (linear-attention models, docs/algorithms.md §4.3) stays padding-free, one more chain.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rlasync.model.block_mask import DEFAULT_BLOCK_SIZE
from rlasync.model.forward import PackedRowTensors

MAX_BUCKETS = 16  # distinct padded lengths per token budget


def row_bucket(token_budget: int, block_size: int = DEFAULT_BLOCK_SIZE, max_buckets: int = MAX_BUCKETS) -> int:
    """The padding multiple for rows planned under `token_budget`: a multiple of `block_size`, wide enough that at
    most `max_buckets` lengths exist up to the budget (the waste stays under budget / max_buckets tokens)."""
    if block_size <= 0 or max_buckets <= 0:
        raise ValueError(f"row_bucket: block_size={block_size} and max_buckets={max_buckets} must be positive")
    if token_budget <= 0:
        return block_size
    return block_size * max(1, math.ceil(token_budget / (max_buckets * block_size)))


def padded_length(num_tokens: int, bucket: int) -> int:
    """`num_tokens` rounded up to a multiple of `bucket` (`bucket` <= 0: unchanged)."""
    if bucket <= 0:
        return num_tokens
    return max(bucket, math.ceil(num_tokens / bucket) * bucket)


def pad_row_tensors(row: PackedRowTensors, length: int, pad_token_id: int = 0) -> PackedRowTensors:
    """`row` with its N-length tensors (input_ids, position_ids, subtree_end) padded to `length` tokens by one
    invisible chain (see the module docstring); the loss-term tensors are unchanged."""
    n = row.num_tokens
    if length < n:
        raise ValueError(f"pad_row_tensors: length={length} is shorter than the row's {n} tokens")
    if length == n:
        return row
    pad = length - n
    device = row.input_ids.device
    ids = torch.full((pad,), int(pad_token_id), dtype=row.input_ids.dtype, device=device)
    positions = torch.arange(pad, dtype=row.position_ids.dtype, device=device)
    ends = torch.full((pad,), length, dtype=row.subtree_end.dtype, device=device)
    return dataclasses.replace(
        row,
        input_ids=torch.cat([row.input_ids, ids]),
        position_ids=torch.cat([row.position_ids, positions]),
        subtree_end=torch.cat([row.subtree_end, ends]),
        segments=None if row.segments is None else row.segments.with_chain(pad),
    )


__all__ = ["MAX_BUCKETS", "pad_row_tensors", "padded_length", "row_bucket"]
