"""Rectangular stacking of a micro-batch's packed rows (docs/algorithms.md §4.6, step 1-2).

`pad_rows(packed_rows, pad_token_id)` pads every array across the P rows to the longest row and stacks them, so
the micro-batch can be broadcast/dispatched along dim 0 (one row per rank). Each rank strips its padding again:
N-length arrays where `attention_mask == 1`, M-length arrays where `token_index >= 0`, tree index arrays where
`>= 0`.

Pad values: `input_ids` -> pad id; `shift_labels` -> -100; `token_index`, `tree_kv_index`, `tree_cu_seqlens_q`,
`tree_cu_seqlens_k` -> -1; `sampler_topk_ids` / `sampling_mask` -> -1 and `sampler_topk_logprobs` -> -inf (their
in-row padding too); everything else -> 0 (False for `has_sampling_mask`; `subtree_end` 0 hides padding keys).

Broadcast scalars (one copy per row): `global_n_tokens` = Σ loss terms M over the rows, `global_n_forward_tokens`
= Σ unique tokens N over the rows, `mean_seq_len` = global_n_forward_tokens / #samples (unique tokens per sample).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlasync.packing.layout import IGNORE_INDEX, PackedRow

# name -> (pad value, dtype) of the per-row arrays that are stacked.
_PADDED_FIELDS: dict[str, tuple[float, type]] = {
    "input_ids": (0, np.int64),  # pad value replaced by pad_token_id
    "position_ids": (0, np.int64),
    "subtree_end": (0, np.int64),
    "shift_labels": (IGNORE_INDEX, np.int64),
    "tree_cu_seqlens_q": (-1, np.int32),
    "tree_kv_index": (-1, np.int64),
    "tree_cu_seqlens_k": (-1, np.int32),
    "tree_max_seqlens": (0, np.int32),
    "token_index": (-1, np.int64),
    "target_ids": (0, np.int64),
    "sampler_logprobs": (0, np.float32),
    "advantages": (0, np.float32),
    "sample_index": (0, np.int64),
}

# Optional [M, width] extras: name -> (pad value, dtype); a row without them contributes all-pad rows.
_OPTIONAL_FIELDS: dict[str, tuple[float, type]] = {
    "sampler_topk_ids": (-1, np.int64),
    "sampler_topk_logprobs": (-np.inf, np.float32),
    "sampling_mask": (-1, np.int64),
}

_ROW_SCALARS = ("num_samples", "num_raw_tokens", "num_trained_tokens", "load")


def pad_rows(packed_rows: Sequence[PackedRow], pad_token_id: int) -> dict[str, np.ndarray]:
    """Stack P packed rows into [P, ...] arrays, plus `attention_mask` [P, max N] and the broadcast scalars [P].

    Optional extras (`sampler_topk_*`, `sampling_mask` + `has_sampling_mask`) are present only if some row has them.
    Per-row scalars (`num_samples`, `num_raw_tokens`, `num_trained_tokens`, `load`) come as [P] int64.
    """
    if not packed_rows:
        raise ValueError("pad_rows: no row to stack")
    num_samples = sum(row.num_samples for row in packed_rows)
    if num_samples == 0:
        raise ValueError("pad_rows: the rows hold no sample")
    batch = {name: _stack([getattr(row, name) for row in packed_rows], *spec) for name, spec in _PADDED_FIELDS.items()}
    batch["input_ids"][_padding(packed_rows)] = pad_token_id
    batch["attention_mask"] = (~_padding(packed_rows)).astype(np.int64)
    batch.update(_stack_optional(packed_rows))
    for name in _ROW_SCALARS:
        batch[name] = np.asarray([getattr(row, name) for row in packed_rows], dtype=np.int64)
    batch.update(_broadcast_scalars(packed_rows, num_samples))
    return batch


def _padding(packed_rows: Sequence[PackedRow]) -> np.ndarray:
    """[P, max N] bool, True on padding slots."""
    lengths = np.asarray([row.num_tokens for row in packed_rows])
    return np.arange(lengths.max(initial=0))[None, :] >= lengths[:, None]


def _stack(arrays: Sequence[np.ndarray], fill: float, dtype: type) -> np.ndarray:
    """[P, max len, max width...] of `arrays` (1-D or 2-D), padded with `fill`."""
    shape = tuple(max(a.shape[d] for a in arrays) for d in range(arrays[0].ndim))
    out = np.full((len(arrays), *shape), fill, dtype=dtype)
    for i, array in enumerate(arrays):
        out[(i, *(slice(0, n) for n in array.shape))] = array
    return out


def _stack_optional(packed_rows: Sequence[PackedRow]) -> dict[str, np.ndarray]:
    batch: dict[str, np.ndarray] = {}
    for name, (fill, dtype) in _OPTIONAL_FIELDS.items():
        if all(getattr(row, name) is None for row in packed_rows):
            continue
        arrays = [_or_blank(getattr(row, name), row.num_trained_tokens, dtype) for row in packed_rows]
        batch[name] = _stack(arrays, fill, dtype)
    if "sampling_mask" in batch:
        has_mask = [
            row.has_sampling_mask if row.has_sampling_mask is not None else np.zeros(row.num_trained_tokens, np.bool_)
            for row in packed_rows
        ]
        batch["has_sampling_mask"] = _stack(has_mask, False, np.bool_)
    return batch


def _or_blank(array: np.ndarray | None, num_terms: int, dtype: type) -> np.ndarray:
    """`array`, or an [M, 0] placeholder that stacking fills entirely with the pad value."""
    return array if array is not None else np.zeros((num_terms, 0), dtype=dtype)


def _broadcast_scalars(packed_rows: Sequence[PackedRow], num_samples: int) -> dict[str, np.ndarray]:
    num_rows = len(packed_rows)
    n_tokens = sum(row.num_trained_tokens for row in packed_rows)
    n_forward = sum(row.num_tokens for row in packed_rows)
    return {
        "global_n_tokens": np.full(num_rows, n_tokens, dtype=np.int64),
        "global_n_forward_tokens": np.full(num_rows, n_forward, dtype=np.int64),
        "mean_seq_len": np.full(num_rows, n_forward / num_samples, dtype=np.float32),
    }
