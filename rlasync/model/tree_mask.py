"""The attention masks of one packed row: the tree rule, dense masks and `TreeAttention` (docs/algorithms.md §4.2-4.3, docs/design.md §3
"Tree packing").

A packed row lays a prefix trie out depth-first, so node k's subtree is the index range [k, subtree_end[k]). One
rule gives the whole mask:

    key k is visible to query q  iff  k <= q < subtree_end[k]

(each token attends exactly its root path, the context it had when its sample was forwarded alone). Sliding-window
layers add `depth[q] - depth[k] < window` on depth positions, which along a root path equals the distance inside
the sample, so windows are exact too.

Backends (`TreeAttention.backend`):
  dense  a bool [N, N] mask through `scaled_dot_product_attention` (CPU, tests, reference);
  flex   one `BlockMask` per window built once per row directly from subtree_end (O(N) work, no [N, N] tensor),
         shared by all layers, through `torch.compile(flex_attention)` (CUDA); built in `rlasync.model.block_mask`.

Separate from `rlasync.model.attention` (the attention function transformers calls) because building masks is
pure tensor code, run once per row, that the learner and the tests use without a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlasync.model.block_mask import DEFAULT_BLOCK_SIZE, tree_block_mask

Backend = Literal["dense", "flex"]


@dataclass(frozen=True, eq=False)
class TreeAttention:
    """The attention masks of one packed row, built once and shared by every layer.

    `masks` maps a sliding window (None = full attention) to a bool [1, 1, N, N] tensor (dense) or a `BlockMask`
    (flex). `position_ids` ([N] depth) and `subtree_end` ([N]) are kept to build a window nobody announced.
    """

    backend: Backend
    subtree_end: torch.Tensor  # [N] int64
    position_ids: torch.Tensor  # [N] int64
    masks: dict[Any, Any]  # window -> mask; ("dense", window) -> the flex backend's dense fallback
    block_size: int = DEFAULT_BLOCK_SIZE
    compile: bool = True

    @property
    def num_tokens(self) -> int:
        return int(self.subtree_end.shape[0])

    @property
    def full_mask(self) -> Any:
        """The full-attention mask; passed to the model as its 4D `attention_mask` so it builds none itself."""
        return self.masks[None]

    def mask_for(self, sliding_window: int | None) -> Any:
        key = int(sliding_window) if sliding_window else None
        mask = self.masks.get(key)
        if mask is None:  # a window the config did not announce: build it now (eager only)
            mask = build_mask(self.backend, self.subtree_end, self.position_ids, key, self.block_size)
            self.masks[key] = mask
        return mask

    def dense_mask_for(self, sliding_window: int | None) -> torch.Tensor:
        """The row's dense [1, 1, N, N] mask for `sliding_window`, built once per row (the flex backend's fallback)."""
        key = ("dense", int(sliding_window) if sliding_window else None)
        mask = self.masks.get(key)
        if mask is None:
            mask = build_mask("dense", self.subtree_end, self.position_ids, key[1], 0)
            self.masks[key] = mask
        return mask


def build_tree_attention(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    backend: Backend | Literal["auto"] = "auto",
    windows: Iterable[int] = (),
    block_size: int = DEFAULT_BLOCK_SIZE,
    compile: bool = True,
) -> TreeAttention:
    """Build the masks of one row for full attention and each sliding window in `windows`.

    `backend="auto"` picks flex on CUDA and dense elsewhere. `compile=False` runs flex_attention eagerly (only
    meant for checking the flex path on CPU: eager FlexAttention materialises the scores).
    """
    if subtree_end.ndim != 1 or position_ids.shape != subtree_end.shape:
        raise ValueError(
            f"subtree_end and position_ids must both be [N], got {tuple(subtree_end.shape)} and "
            f"{tuple(position_ids.shape)}"
        )
    if backend == "auto":
        backend = "flex" if subtree_end.device.type == "cuda" else "dense"
    if backend not in ("dense", "flex"):
        raise ValueError(f"unknown tree attention backend {backend!r}: use 'auto', 'dense' or 'flex'")
    subtree_end = subtree_end.long()
    position_ids = position_ids.long()
    masks: dict[int | None, Any] = {}
    for window in (None, *sorted({int(w) for w in windows if w})):
        masks[window] = build_mask(backend, subtree_end, position_ids, window, block_size)
    return TreeAttention(backend, subtree_end, position_ids, masks, block_size, compile)


def build_mask(
    backend: Backend, subtree_end: torch.Tensor, position_ids: torch.Tensor, window: int | None, block_size: int
) -> Any:
    if backend == "dense":
        return dense_tree_mask(subtree_end, position_ids, window)[None, None]
    return tree_block_mask(subtree_end, position_ids, window, block_size)


def dense_tree_mask(
    subtree_end: torch.Tensor, position_ids: torch.Tensor | None = None, sliding_window: int | None = None
) -> torch.Tensor:
    """[N, N] bool, True where query q (row) may attend key k (column): k <= q < subtree_end[k] (and the window)."""
    n = subtree_end.shape[0]
    index = torch.arange(n, device=subtree_end.device)
    q, k = index[:, None], index[None, :]
    mask = (k <= q) & (q < subtree_end[None, :])
    if sliding_window:
        if position_ids is None:
            raise ValueError("a sliding-window tree mask needs position_ids (the depth of each token)")
        mask &= (position_ids[:, None] - position_ids[None, :]) < sliding_window
    return mask
