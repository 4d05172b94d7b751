"""Depth-first layout of a row's trie into arrays (docs/algorithms.md §4.2).

`pack(row)` lays the trie out in DFS pre-order (children in insertion order), so every node's subtree is a
contiguous index range `[k, subtree_end[k])`. That gives the whole attention mask in one rule:

    key k is visible to query q  iff  k <= q < subtree_end[k]

(every token attends exactly its root path, the context it had when its sample was forwarded alone).

Unary chains are collapsed into segments for FlashAttention-style varlen kernels: a segment starts at a root or at
a child of a branching node and runs while the current node has exactly one child. Each segment's keys are its
root-to-segment path (`tree_kv_index`), and a bottom-right aligned causal mask over that path is the same rule.

Shape legend: N forwarded (unique) tokens, S segments, K gathered key rows, M loss terms,
Kt sampler top-k width, C sampling-mask width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from rlasync.packing.trie import TreeRow
from rlasync.records import PackableSample

IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True, eq=False)
class PackedRow:
    """One row, ready to become tensors. Loss terms are in sample order, then position order."""

    input_ids: np.ndarray  # [N] int64 unique tokens in DFS order
    position_ids: np.ndarray  # [N] int64 node depth (= position within every sample containing it)
    subtree_end: np.ndarray  # [N] int64 node k's subtree is [k, subtree_end[k])
    shift_labels: np.ndarray  # [N] int64 next token a position predicts if some sample trains it, else -100
    tree_cu_seqlens_q: np.ndarray  # [S+1] int32 segment boundaries (0, end_1, ..., N)
    tree_kv_index: np.ndarray  # [K] int64 per segment, packed positions of its root-to-segment path
    tree_cu_seqlens_k: np.ndarray  # [S+1] int32 boundaries of each segment's path inside tree_kv_index
    tree_max_seqlens: np.ndarray  # [2] int32 (longest segment, longest path)
    token_index: np.ndarray  # [M] int64 packed position whose output predicts the target
    target_ids: np.ndarray  # [M] int64 target token
    sampler_logprobs: np.ndarray  # [M] float32 sampler log-prob of the target
    advantages: np.ndarray  # [M] float32 advantage of the target's sample
    sample_index: np.ndarray  # [M] int64 index of the sample within the row (TRL: segment_id)
    sampler_topk_ids: np.ndarray | None  # [M, Kt] int64, -1 padded; None if no sample has top-k
    sampler_topk_logprobs: np.ndarray | None  # [M, Kt] float32, -inf padded; None if no sample has top-k
    sampling_mask: np.ndarray | None  # [M, C] int64 candidate ids, -1 padded; None if no sample has one
    has_sampling_mask: np.ndarray | None  # [M] bool False = whole vocabulary; None iff sampling_mask is None
    num_samples: int
    num_raw_tokens: int  # Σ sample lengths
    num_trained_tokens: int  # M
    load: int  # Σ (depth + 1) over the N tokens

    @property
    def num_tokens(self) -> int:
        """N, the unique tokens forwarded."""
        return int(self.input_ids.shape[0])


class _Layout(NamedTuple):
    packed_of_node: np.ndarray  # [n_nodes] int64 packed index of each trie node
    input_ids: np.ndarray  # [N] int64
    position_ids: np.ndarray  # [N] int64
    parents: np.ndarray  # [N] int64 packed index of the parent, -1 for a root
    subtree_end: np.ndarray  # [N] int64


class _Segments(NamedTuple):
    cu_seqlens_q: np.ndarray  # [S+1] int32
    kv_index: np.ndarray  # [K] int64
    cu_seqlens_k: np.ndarray  # [S+1] int32
    max_seqlens: np.ndarray  # [2] int32


class _LossTerms(NamedTuple):
    positions: list[np.ndarray]  # per sample, [M_i] int64 positions p >= 1 with completion_mask[p] = 1
    token_index: np.ndarray  # [M] int64
    target_ids: np.ndarray  # [M] int64
    sampler_logprobs: np.ndarray  # [M] float32
    advantages: np.ndarray  # [M] float32
    sample_index: np.ndarray  # [M] int64


def pack(row: TreeRow) -> PackedRow:
    """Lay `row` out depth-first and select its loss terms (docs/algorithms.md §4.2). An empty row gives empty arrays."""
    layout = _layout(row)
    segments = _segments(layout.parents)
    terms = _loss_terms(row.samples, row.sample_nodes, layout.packed_of_node)
    shift_labels = np.full(layout.input_ids.shape, IGNORE_INDEX, dtype=np.int64)
    shift_labels[terms.token_index] = terms.target_ids
    topk_ids, topk_logprobs = _gather_topk(row.samples, terms.positions)
    sampling_mask, has_sampling_mask = _gather_sampling_mask(row.samples, terms.positions)
    return PackedRow(
        input_ids=layout.input_ids,
        position_ids=layout.position_ids,
        subtree_end=layout.subtree_end,
        shift_labels=shift_labels,
        tree_cu_seqlens_q=segments.cu_seqlens_q,
        tree_kv_index=segments.kv_index,
        tree_cu_seqlens_k=segments.cu_seqlens_k,
        tree_max_seqlens=segments.max_seqlens,
        token_index=terms.token_index,
        target_ids=terms.target_ids,
        sampler_logprobs=terms.sampler_logprobs,
        advantages=terms.advantages,
        sample_index=terms.sample_index,
        sampler_topk_ids=topk_ids,
        sampler_topk_logprobs=topk_logprobs,
        sampling_mask=sampling_mask,
        has_sampling_mask=has_sampling_mask,
        num_samples=row.num_samples,
        num_raw_tokens=row.num_raw_tokens,
        num_trained_tokens=int(terms.token_index.shape[0]),
        load=row.load,
    )


def sample_positions(row: TreeRow) -> list[np.ndarray]:
    """Per sample, the packed index ([L_i] int64) of each of its positions, in `pack(row)`'s layout."""
    packed_of_node = _packed_of_node(_preorder(row))
    return [packed_of_node[nodes] for nodes in row.sample_nodes]


def align_blocks(
    row: PackedRow,
    block_size: int,
    max_pad: int | None = None,
    at: Literal["segments", "roots"] = "segments",
    pad_token_id: int = 0,
) -> PackedRow:
    """`row` with invisible padding tokens inserted so that segment starts fall on multiples of `block_size`.

    A FlexAttention block mask of `block_size`-token blocks computes every nonempty block whole and evaluates the
    mask per element in its partial blocks; a segment (a branch, a group) that starts on a block boundary leaves
    fewer of both, at the price of the padding tokens every other layer forwards (bench/block_layout.py counts it).

    `at="segments"`: every segment start (a root or a child of a branching node); `"roots"`: only the roots (the
    groups). A start needing more than `max_pad` padding tokens (default `block_size - 1`: none skipped) stays where
    it falls. The padding goes just before the start, as one chain hanging off the start's parent (a new root before
    a root), inside the block the start closes: under the tree rule a padding key is seen by the padding queries of
    its chain only, and a real query sees exactly the keys it saw before, so log-probs and gradients are unchanged
    (the varlen backend sees one more short segment per chain). `load` stays the real tokens' attention cost; loss terms
    are moved with their tokens (`shift_labels` -100 on padding).
    """
    if block_size < 1:
        raise ValueError(f"align_blocks: block_size must be >= 1, got {block_size}")
    max_pad = block_size - 1 if max_pad is None else max_pad
    if max_pad < 0:
        raise ValueError(f"align_blocks: max_pad must be >= 0 (or None for block_size - 1), got {max_pad}")
    if at not in ("segments", "roots"):
        raise ValueError(f"align_blocks: at must be 'segments' or 'roots', got {at!r}")
    parents = _parents(row.subtree_end)
    starts = row.tree_cu_seqlens_q[1:-1].astype(np.int64)
    if at == "roots":
        starts = starts[parents[starts] < 0]
    pads_before = np.zeros(row.num_tokens, dtype=np.int64)
    offset = 0
    for start in starts.tolist():
        need = -(start + offset) % block_size
        if need <= max_pad:
            pads_before[start] = need
            offset += need
    if offset == 0:
        return row
    moved = np.arange(row.num_tokens, dtype=np.int64) + np.cumsum(pads_before)
    n = row.num_tokens + offset
    is_pad = np.ones(n, dtype=bool)
    is_pad[moved] = False
    new_parents = np.full(n, -1, dtype=np.int64)
    new_parents[moved] = np.where(parents >= 0, moved[np.maximum(parents, 0)], -1)
    depths = np.zeros(n, dtype=np.int64)
    depths[moved] = row.position_ids
    starts_padded = np.flatnonzero(pads_before)
    runs = pads_before[starts_padded]
    owner = np.repeat(starts_padded, runs)  # the start each padding token precedes
    step = np.arange(owner.shape[0]) - np.repeat(np.cumsum(runs) - runs, runs)  # 0, 1, .. within each run
    pad_index = np.flatnonzero(is_pad)
    base = np.where(parents[owner] >= 0, moved[np.maximum(parents[owner], 0)], -1)
    new_parents[pad_index] = np.where(step == 0, base, pad_index - 1)  # a chain off the start's parent
    depths[pad_index] = np.where(base >= 0, depths[np.maximum(base, 0)] + 1, 0) + step
    input_ids = np.full(n, pad_token_id, dtype=np.int64)
    input_ids[moved] = row.input_ids
    shift_labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    shift_labels[moved] = row.shift_labels
    segments = _segments(new_parents)
    return dataclasses.replace(
        row,
        input_ids=input_ids,
        position_ids=depths,
        subtree_end=_subtree_end(new_parents.tolist()),
        shift_labels=shift_labels,
        tree_cu_seqlens_q=segments.cu_seqlens_q,
        tree_kv_index=segments.kv_index,
        tree_cu_seqlens_k=segments.cu_seqlens_k,
        tree_max_seqlens=segments.max_seqlens,
        token_index=moved[row.token_index],
    )


def _parents(subtree_end: np.ndarray) -> np.ndarray:
    """[N] int64 parent of each token (-1 for a root) from the layout's subtree ranges: the nearest earlier token
    whose subtree still holds it."""
    ends = subtree_end.tolist()
    parents = np.full(len(ends), -1, dtype=np.int64)
    open_ranges: list[int] = []
    for k in range(len(ends)):
        while open_ranges and ends[open_ranges[-1]] <= k:
            open_ranges.pop()
        if open_ranges:
            parents[k] = open_ranges[-1]
        open_ranges.append(k)
    return parents


# ---- layout ----------------------------------------------------------------------------------------------------


def _preorder(row: TreeRow) -> np.ndarray:
    """[N] int64 trie nodes in DFS pre-order, children in insertion order (iterative: chains can be 100k deep)."""
    order: list[int] = []
    stack = row.root_nodes[::-1]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(row.children(node)))
    return np.asarray(order, dtype=np.int64)


def _packed_of_node(order: np.ndarray) -> np.ndarray:
    packed_of_node = np.empty_like(order)
    packed_of_node[order] = np.arange(order.shape[0], dtype=np.int64)
    return packed_of_node


def _layout(row: TreeRow) -> _Layout:
    order = _preorder(row)
    packed_of_node = _packed_of_node(order)
    node_parents = np.asarray(row.node_parents, dtype=np.int64)[order]
    parents = np.where(node_parents >= 0, packed_of_node[np.maximum(node_parents, 0)], -1)
    return _Layout(
        packed_of_node=packed_of_node,
        input_ids=np.asarray(row.node_tokens, dtype=np.int64)[order],
        position_ids=np.asarray(row.node_depths, dtype=np.int64)[order],
        parents=parents,
        subtree_end=_subtree_end(parents.tolist()),
    )


def _subtree_end(parents: list[int]) -> np.ndarray:
    """[N] int64 end of each node's subtree; in pre-order a parent precedes its children, so sizes roll up."""
    sizes = [1] * len(parents)
    for k in range(len(parents) - 1, -1, -1):
        if parents[k] >= 0:
            sizes[parents[k]] += sizes[k]
    return np.arange(len(parents), dtype=np.int64) + np.asarray(sizes, dtype=np.int64)


def _segments(parents: np.ndarray) -> _Segments:
    """Collapse unary chains into segments and list each segment's root-to-segment path."""
    n = parents.shape[0]
    num_children = np.bincount(parents[parents >= 0], minlength=n)
    is_start = (parents < 0) | (num_children[np.maximum(parents, 0)] >= 2)
    starts = np.flatnonzero(is_start)
    ends = np.append(starts[1:], n)
    segment_of = np.cumsum(is_start) - 1
    paths: list[np.ndarray] = []
    for start, end in zip(starts.tolist(), ends.tolist()):
        own = np.arange(start, end, dtype=np.int64)
        parent = int(parents[start])
        paths.append(own if parent < 0 else np.concatenate([paths[segment_of[parent]], own]))
    path_lengths = np.asarray([len(path) for path in paths], dtype=np.int64)
    return _Segments(
        cu_seqlens_q=np.append(starts, n).astype(np.int32),
        kv_index=np.concatenate(paths) if paths else np.zeros(0, dtype=np.int64),
        cu_seqlens_k=np.concatenate([[0], np.cumsum(path_lengths)]).astype(np.int32),
        max_seqlens=np.asarray(
            [(ends - starts).max(initial=0), path_lengths.max(initial=0)],
            dtype=np.int32,
        ),
    )


# ---- loss terms ------------------------------------------------------------------------------------------------


def _loss_terms(
    samples: list[PackableSample], sample_nodes: list[np.ndarray], packed_of_node: np.ndarray
) -> _LossTerms:
    """One term per sample and position p >= 1 with completion_mask[p] = 1, predicted from node(p - 1)."""
    positions = [np.flatnonzero(sample.completion_mask[1:]) + 1 for sample in samples]
    token_index = [packed_of_node[nodes[p - 1]] for nodes, p in zip(sample_nodes, positions)]
    counts = [len(p) for p in positions]
    return _LossTerms(
        positions=positions,
        token_index=_concat(token_index, np.int64),
        target_ids=_concat([s.input_ids[p] for s, p in zip(samples, positions)], np.int64),
        sampler_logprobs=_concat([s.sampler_logprobs[p] for s, p in zip(samples, positions)], np.float32),
        advantages=_concat([np.full(c, s.advantage, np.float32) for s, c in zip(samples, counts)], np.float32),
        sample_index=_concat([np.full(c, i, np.int64) for i, c in enumerate(counts)], np.int64),
    )


def _concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)


def _gather_topk(
    samples: list[PackableSample], positions: list[np.ndarray]
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """[M, Kt] top-k ids / log-probs at each target; samples without top-k (and narrower ones) are padded -1 / -inf."""
    if all(s.sampler_topk_ids is None for s in samples):
        return None, None
    ids = _gather_rows([s.sampler_topk_ids for s in samples], positions, -1, np.int64)
    logprobs = _gather_rows([s.sampler_topk_logprobs for s in samples], positions, -np.inf, np.float32)
    return ids, logprobs


def _gather_sampling_mask(
    samples: list[PackableSample], positions: list[np.ndarray]
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """[M, C] candidate ids at each target (-1 padded) and [M] whether the term has a candidate set at all."""
    if all(s.sampling_mask is None for s in samples):
        return None, None
    mask = _gather_rows([s.sampling_mask for s in samples], positions, -1, np.int64)
    has_mask = _concat([np.full(len(p), s.sampling_mask is not None) for s, p in zip(samples, positions)], np.bool_)
    return mask, has_mask


def _gather_rows(
    per_sample: list[np.ndarray | None], positions: list[np.ndarray], fill: float, dtype: type
) -> np.ndarray:
    """Stack `per_sample[i][positions[i]]` into [M, width], padding narrow or missing samples with `fill`."""
    width = max(a.shape[1] for a in per_sample if a is not None)
    out = np.full((sum(len(p) for p in positions), width), fill, dtype=dtype)
    offset = 0
    for values, p in zip(per_sample, positions):
        if values is not None:
            out[offset : offset + len(p), : values.shape[1]] = values[p]
        offset += len(p)
    return out
