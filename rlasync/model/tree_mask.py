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
         shared by all layers, through `torch.compile(flex_attention)` (CUDA); built in `rlasync.model.block_mask`;
  varlen the row cut into root-path segments, each one causal problem for FlashAttention's varlen kernel (CUDA;
         a reference loop on CPU): `rlasync.model.segment_attention`, planned on the host.

"auto" is flex on CUDA and dense elsewhere; a run chooses with its config's `kernels.tree_attention`
(`rlasync.config.kernels.KernelSettings`, handed to the `TreeScorer`).

Separate from `rlasync.model.attention` (the attention function transformers calls) because building masks is
pure tensor code, run once per row, that the learner and the tests use without a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlasync.model.block_mask import DEFAULT_BLOCK_SIZE, tree_block_mask
from rlasync.model.segment_attention import SegmentPlan, segment_plan, varlen_available

Backend = Literal["dense", "flex", "varlen"]
BACKENDS = ("dense", "flex", "varlen")


@dataclass(frozen=True, eq=False)
class TreeAttention:
    """The attention masks of one packed row, built once and shared by every layer.

    `masks` maps a sliding window (None = full attention) to a bool [1, 1, N, N] tensor (dense) or a `BlockMask`
    (flex); varlen keeps its `segments` (every window uses them) and a placeholder full mask. `position_ids` ([N]
    depth) and `subtree_end` ([N]) are kept to build a window nobody announced. `kernel_options`: FlexAttention's
    (`KernelSettings.flex_kernel_options`), a constant every compiled layer reads.
    """

    backend: Backend
    subtree_end: torch.Tensor  # [N] int64
    position_ids: torch.Tensor  # [N] int64
    masks: dict[Any, Any]  # window -> mask; ("dense", window) -> the flex backend's dense fallback
    block_size: int = DEFAULT_BLOCK_SIZE
    compile: bool = True
    segments: SegmentPlan | None = None  # varlen
    kernel_options: dict[str, Any] | None = None  # flex: FlexAttention's kernel_options (None: torch chooses)

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
    segments: SegmentPlan | None = None,
    kernel_options: dict[str, Any] | None = None,
) -> TreeAttention:
    """Build the masks of one row for full attention and each sliding window in `windows`.

    `backend="auto"`: see `resolve_backend`. `compile=False` runs flex_attention eagerly (only meant for checking
    the flex path on CPU: eager FlexAttention materialises the scores). `segments`: the varlen backend's plan,
    made on the host (`segment_plan`); without it the plan is made here from a copy of the row on the CPU.
    `kernel_options`: the flex backend's FlexAttention kernel options (`KernelSettings.flex_kernel_options`).
    """
    if subtree_end.ndim != 1 or position_ids.shape != subtree_end.shape:
        raise ValueError(
            f"subtree_end and position_ids must both be [N], got {tuple(subtree_end.shape)} and "
            f"{tuple(position_ids.shape)}"
        )
    backend = resolve_backend(backend, subtree_end.device)
    subtree_end = subtree_end.long()
    position_ids = position_ids.long()
    if backend == "varlen":
        if segments is None:
            segments = segment_plan(subtree_end.cpu(), position_ids.cpu()).to(subtree_end.device)
        n = subtree_end.shape[0]  # the model is handed a 4D mask so it builds none; the attention reads `segments`
        placeholder = torch.ones((), dtype=torch.bool, device=subtree_end.device).expand(1, 1, n, n)
        return TreeAttention(backend, subtree_end, position_ids, {None: placeholder}, block_size, compile, segments)
    masks: dict[int | None, Any] = {}
    for window in (None, *sorted({int(w) for w in windows if w})):
        masks[window] = build_mask(backend, subtree_end, position_ids, window, block_size)
    options = kernel_options if backend == "flex" else None
    return TreeAttention(backend, subtree_end, position_ids, masks, block_size, compile, kernel_options=options)


def resolve_backend(backend: str, device: torch.device) -> Backend:
    """`backend`, or for "auto": flex on CUDA, dense elsewhere (`KernelSettings.tree_attention` chooses another)."""
    if backend == "auto":
        backend = "flex" if device.type == "cuda" else "dense"
    if backend not in BACKENDS:
        raise ValueError(f"unknown tree attention backend {backend!r}: use 'auto', {', '.join(map(repr, BACKENDS))}")
    if backend == "varlen" and device.type == "cuda" and not varlen_available():
        raise ValueError(
            f"tree attention 'varlen' needs torch.nn.attention.varlen.varlen_attn with window_size "
            f"(torch >= 2.10; this is {torch.__version__}): use 'flex'"
        )
    return backend  # type: ignore[return-value]


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
