"""Tree attention as FlashAttention varlen over root-path segments (the `varlen` backend of `TreeAttention`).

A packed row lays each prefix trie out depth-first; key k is visible to query q iff k <= q < subtree_end[k], i.e.
each token attends its root path. Cut the row into *segments*: maximal runs [a, b) in which every token's parent
is the token before it. All tokens of a segment share one root path up to a (the ancestors of a) and then attend
causally inside the segment. So one segment is exactly one causal attention problem whose keys are

    ancestors(a) ++ [a, b)        (ancestors(a) = {k < a : subtree_end[k] > a}, in row order = depth order)

with its queries aligned to the end of its keys: query i of the segment sees keys j <= i + len(ancestors(a)).
That is FlashAttention's varlen kernel with `causal` (bottom-right aligned when queries are fewer than keys), one
call per layer for the whole row: queries stay where they are (the segments tile the row), keys and values are
gathered by `key_index` (the shared prompt's keys are read once per completion; their gradients are summed back
by the gather's backward). A prompt with G completions is G segments (the first continues the prompt), G * (P +
C) keys: no masked pair is computed beyond the kernel's diagonal tiles, where FlexAttention's block mask wastes
the partial blocks of every branch.

Sliding windows are exact too: the key sequence is the root path, so a key's offset in it is its depth and the
window `depth[q] - depth[k] < W` is the kernel's left window W - 1.

The plan (`segment_plan`) is built on the host from the row's numpy arrays (O(N) plus the ancestors), before the
row goes to the device, so the forward needs no device-to-host read. On CUDA in 16-bit `segment_attention` calls
`torch.nn.attention.varlen.varlen_attn`; elsewhere (CPU tests, fp32) a reference loop over the segments with SDPA.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rlasync.model.devices import to_device

LENGTH_QUANTUM = 128  # max_q / max_k are rounded up to this: few distinct values for compiled callers


@dataclass(frozen=True, eq=False)
class SegmentPlan:
    """The segments of one row: queries `query_start[s]:query_start[s+1]` (the row's own positions), keys
    `key_index[key_start[s]:key_start[s+1]]`. `num_tokens`, `num_keys`, `max_query`, `max_key` are host ints."""

    query_start: torch.Tensor  # [S + 1] int32
    key_start: torch.Tensor  # [S + 1] int32
    key_index: torch.Tensor  # [num_keys] int64 row positions
    num_tokens: int
    num_keys: int
    max_query: int
    max_key: int

    @property
    def num_segments(self) -> int:
        return int(self.query_start.shape[0]) - 1

    def to(self, device: torch.device | str) -> SegmentPlan:
        move = functools.partial(to_device, device=device)
        return SegmentPlan(
            move(self.query_start),
            move(self.key_start),
            move(self.key_index),
            self.num_tokens,
            self.num_keys,
            self.max_query,
            self.max_key,
        )

    def with_chain(self, length: int) -> SegmentPlan:
        """This plan plus one chain of `length` tokens after the row (a new root: its own segment, its own keys),
        as `rlasync.model.row_shapes.pad_row_tensors` pads a row. No device-to-host read."""
        if length <= 0:
            return self
        n, keys = self.num_tokens, self.num_keys
        chain = torch.arange(n, n + length, dtype=self.key_index.dtype, device=self.key_index.device)
        return SegmentPlan(
            torch.cat([self.query_start, self.query_start[-1:] + length]),  # on the device: no copy to wait for
            torch.cat([self.key_start, self.key_start[-1:] + length]),
            torch.cat([self.key_index, chain]),
            n + length,
            keys + length,
            max(self.max_query, _rounded(length)),
            max(self.max_key, _rounded(length)),
        )


def segment_plan(subtree_end: Any, position_ids: Any) -> SegmentPlan:
    """The `SegmentPlan` of a row from its `subtree_end` and `position_ids` (numpy or CPU tensors, [N]). Raises
    ValueError when they do not describe depth-first tries (a token whose root path is not its ancestors)."""
    end = np.asarray(subtree_end, dtype=np.int64)
    depth = np.asarray(position_ids, dtype=np.int64)
    n = int(end.shape[0])
    if end.ndim != 1 or depth.shape != end.shape:
        raise ValueError(f"segment_plan: subtree_end and position_ids must both be [N], got {end.shape}, {depth.shape}")
    if n == 0:
        empty = torch.zeros(1, dtype=torch.int32)
        return SegmentPlan(empty, empty.clone(), torch.zeros(0, dtype=torch.int64), 0, 0, 0, 0)
    index = np.arange(n)
    continues = (depth[1:] == depth[:-1] + 1) & (end[:-1] > index[1:])  # token t's parent is t - 1
    starts = np.r_[0, 1 + np.flatnonzero(~continues)]
    bounds = np.r_[starts, n]
    roots = np.maximum.accumulate(np.where(depth == 0, index, 0))  # the root of each token's trie
    pieces: list[np.ndarray] = []
    key_lengths = np.empty(len(starts), dtype=np.int64)
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        root = roots[a]
        ancestors = root + np.flatnonzero(end[root:a] > a)
        if len(ancestors) != depth[a] or (len(ancestors) and depth[ancestors[-1]] != depth[a] - 1):
            raise ValueError(
                f"segment_plan: token {a} (depth {depth[a]}) has {len(ancestors)} ancestors: subtree_end and "
                "position_ids are not a depth-first trie layout (rlasync.packing)"
            )
        pieces += [ancestors, np.arange(a, b)]
        key_lengths[s] = len(ancestors) + (b - a)
    key_index = np.concatenate(pieces)
    query_start = torch.from_numpy(bounds.astype(np.int32))
    key_start = torch.from_numpy(np.r_[0, np.cumsum(key_lengths)].astype(np.int32))
    return SegmentPlan(
        query_start,
        key_start,
        torch.from_numpy(key_index),
        n,
        int(key_index.shape[0]),
        _rounded(int(np.diff(bounds).max())),
        _rounded(int(key_lengths.max())),
    )


def _rounded(length: int) -> int:
    return LENGTH_QUANTUM * math.ceil(length / LENGTH_QUANTUM)


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: SegmentPlan,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """query [1, Hq, N, D], key/value [1, Hkv, N, D] -> [1, N, Hq, D]: tree attention over `plan`'s segments."""
    if query.shape[0] != 1 or query.shape[2] != plan.num_tokens:
        raise ValueError(
            f"segment attention: the plan has {plan.num_tokens} tokens, the layer got {tuple(query.shape)}"
        )
    q = query[0].transpose(0, 1).contiguous()  # [N, Hq, D]
    k = key[0].transpose(0, 1).index_select(0, plan.key_index)  # [num_keys, Hkv, D]
    v = value[0].transpose(0, 1).index_select(0, plan.key_index)
    use_kernel = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)  # the kernel's dtypes; fp32: the loop
    kernel = _varlen if use_kernel else reference_segment_attention
    return kernel(q, k, v, plan, scaling, sliding_window)[None]


def varlen_available() -> bool:
    """Whether this torch has FlashAttention varlen with causal windows (`varlen_attn(..., window_size=)`)."""
    return _varlen_parameters() is not None


@functools.cache
def _varlen_parameters() -> frozenset[str] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = frozenset(inspect.signature(varlen_attn).parameters)
    return parameters if "window_size" in parameters else None


def _varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SegmentPlan,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    parameters = _varlen_parameters() or frozenset()  # resolve_backend refused 'varlen' where it is missing
    extra = {"enable_gqa": True} if "enable_gqa" in parameters and q.shape[1] != k.shape[1] else {}
    return varlen_attn(
        q,
        k,
        v,
        plan.query_start,
        plan.key_start,
        plan.max_query,
        plan.max_key,
        scale=scaling,
        window_size=(sliding_window - 1, 0) if sliding_window else (-1, 0),
        **extra,
    )


def reference_segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SegmentPlan,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """What the varlen kernel computes, one segment at a time with SDPA: q [N, Hq, D], gathered k/v [num_keys, Hkv,
    D] -> [N, Hq, D]. Each segment's queries are aligned to the end of its keys (causal), within the window."""
    query_start, key_start = plan.query_start.tolist(), plan.key_start.tolist()
    groups = q.shape[1] // k.shape[1]
    outputs = []
    for s in range(plan.num_segments):
        qs = q[query_start[s] : query_start[s + 1]].transpose(0, 1)[None]  # [1, Hq, Lq, D]
        ks = k[key_start[s] : key_start[s + 1]].transpose(0, 1)[None]
        vs = v[key_start[s] : key_start[s + 1]].transpose(0, 1)[None]
        lq, lk = qs.shape[2], ks.shape[2]
        offset = torch.arange(lq, device=q.device)[:, None] + (lk - lq) - torch.arange(lk, device=q.device)[None, :]
        mask = offset >= 0
        if sliding_window:
            mask &= offset < sliding_window
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs) if outputs else q.new_zeros(q.shape)
