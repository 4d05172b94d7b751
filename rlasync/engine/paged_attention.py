"""Paged attention for Hugging Face decoders: a preallocated KV pool and an `AttentionInterface` function.

How it plugs into transformers (no module is patched), as `rlasync.model.attention` does for tree attention:
  * `ATTENTION_NAME` ("rlasync_paged") is registered in `AttentionInterface` (the function below) and in
    `AttentionMaskInterface` (transformers' own `sdpa_mask`), so a plain forward of the same model (the engine's
    teacher-forced `score`) builds its usual causal mask and runs transformers' SDPA function.
  * An engine step runs the decoder on one flat row (batch 1: every scheduled token of every request concatenated,
    explicit `position_ids`) and passes `paged_attention=PagedAttentionMetadata`, a keyword argument the decoder
    forwards to every attention call. It also passes a 0-size 4D `attention_mask`, which transformers returns
    unchanged, so it builds no [N, N] mask of its own.
  * For each layer the function writes the step's new keys/values into the pool at `slot_mapping`, then attends
    every query over its own request's cached keys up to its own position.

KV layout (`KVPool.kv`): [num_layers, 2, num_slots, num_kv_heads, head_dim] with slot = block * block_size + offset,
i.e. per layer K and V are [num_blocks + 1, block_size, num_kv_heads, head_dim] (the paged layout FlashAttention's
`block_table` kernels read). The extra last block is the null block: padded tokens of a fixed-size batch write there
and padded block-table entries point there, so shapes can stay static (CUDA graphs) without branches.

Attention backends (the seam for a GPU kernel is `_decode_attention` / `_prefill_attention`):
  decode   requests feeding one token: keys gathered through the block table into [B, L_max] (padding masked),
           one batched SDPA call;
  prefill  requests feeding several tokens (a prompt, a chunk of it, or a recomputation): one SDPA call each over
           their gathered keys, causal with the chunk's offset.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_NAME = "rlasync_paged"


class KVPool:
    """Preallocated K/V storage of every layer; `num_blocks` usable blocks plus the null block."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.null_block = num_blocks
        num_slots = (num_blocks + 1) * block_size
        self.kv = torch.zeros(num_layers, 2, num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)

    @property
    def null_slot(self) -> int:
        return self.null_block * self.block_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def keys(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]


@dataclass(frozen=True, eq=False)
class PrefillSegment:
    """One multi-token request of the step: queries `[q_start, q_end)` of the flat row attend keys at `kv_slots`."""

    q_start: int
    q_end: int
    kv_slots: torch.Tensor  # [L] int64: slots of positions 0 .. L-1 of the request (L = its length after the step)
    positions: torch.Tensor  # [q_end - q_start] int64, the queries' positions (L - q .. L - 1)


@dataclass(frozen=True, eq=False)
class PagedAttentionMetadata:
    """Everything a layer needs for one step, built once per step and shared by all layers (tensors on device).

    N = tokens in the flat row, B_d = decoding requests, L = longest decoding request after the step.
    """

    pool: KVPool
    positions: torch.Tensor  # [N] int64: each token's position in its request
    slot_mapping: torch.Tensor  # [N] int64: where each token's K/V goes
    decode_index: torch.Tensor  # [B_d] int64: row positions of the decoding requests' tokens
    decode_positions: torch.Tensor  # [B_d] int64
    decode_kv_slots: torch.Tensor  # [B_d, L] int64 (null slot past each request's end)
    decode_kv_valid: torch.Tensor  # [B_d, L] bool
    prefills: tuple[PrefillSegment, ...]

    @property
    def num_decodes(self) -> int:
        return int(self.decode_index.shape[0])


def build_metadata(
    pool: KVPool,
    starts: list[int],
    lengths: list[int],
    block_ids: list[list[int]],
    device: torch.device,
) -> PagedAttentionMetadata:
    """Metadata of a step where request i feeds `lengths[i]` tokens at positions `starts[i]...` (flat-row order)."""
    block_size = pool.block_size
    num_requests = len(starts)
    max_blocks = max(len(blocks) for blocks in block_ids)
    table = torch.full((num_requests, max_blocks), pool.null_block, dtype=torch.int64)
    for i, blocks in enumerate(block_ids):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    offsets = torch.arange(block_size, dtype=torch.int64)
    request_slots = (table[:, :, None] * block_size + offsets).reshape(num_requests, max_blocks * block_size)

    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    starts_t = torch.tensor(starts, dtype=torch.int64)
    row_of_token = torch.repeat_interleave(torch.arange(num_requests), lengths_t)
    q_begin = torch.cumsum(lengths_t, 0) - lengths_t
    positions = starts_t[row_of_token] + torch.arange(int(lengths_t.sum())) - q_begin[row_of_token]
    slot_mapping = request_slots[row_of_token, positions]

    is_decode = [n == 1 for n in lengths]
    decode_rows = [i for i, decode in enumerate(is_decode) if decode]
    ends = starts_t + lengths_t
    if decode_rows:
        rows = torch.tensor(decode_rows, dtype=torch.int64)
        max_len = int(ends[rows].max())
        decode_kv_slots = request_slots[rows, :max_len]
        decode_kv_valid = torch.arange(max_len)[None, :] < ends[rows, None]
        decode_kv_slots = decode_kv_slots.masked_fill(~decode_kv_valid, pool.null_slot)
        decode_index, decode_positions = q_begin[rows], starts_t[rows]
    else:
        empty = torch.zeros(0, dtype=torch.int64)
        decode_index, decode_positions = empty, empty
        decode_kv_slots, decode_kv_valid = empty.view(0, 0), torch.zeros(0, 0, dtype=torch.bool)
    prefills = tuple(
        PrefillSegment(
            q_start=int(q_begin[i]),
            q_end=int(q_begin[i] + lengths[i]),
            kv_slots=request_slots[i, : int(ends[i])].to(device),
            positions=torch.arange(starts[i], int(ends[i]), dtype=torch.int64, device=device),
        )
        for i, decode in enumerate(is_decode)
        if not decode
    )
    return PagedAttentionMetadata(
        pool=pool,
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        decode_index=decode_index.to(device),
        decode_positions=decode_positions.to(device),
        decode_kv_slots=decode_kv_slots.to(device),
        decode_kv_valid=decode_kv_valid.to(device),
        prefills=prefills,
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    paged_attention: PagedAttentionMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [1, Hq, N, D], key/value [1, Hkv, N, D] -> ([1, N, Hq, D], None).

    Without `paged_attention` this is a plain forward through transformers' SDPA function.
    """
    if paged_attention is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        kwargs = {**kwargs, "sliding_window": sliding_window} if sliding_window else kwargs
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise ValueError("paged attention does not support attention softcapping or sinks")
    if query.shape[0] != 1:
        raise ValueError(f"paged attention runs on one flat row (batch 1), got batch {query.shape[0]}")
    meta = paged_attention
    layer = module.layer_idx
    q = query[0].transpose(0, 1)  # [N, Hq, D]
    k = key[0].transpose(0, 1)  # [N, Hkv, D]
    v = value[0].transpose(0, 1)
    k_cache, v_cache = meta.pool.keys(layer), meta.pool.values(layer)
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    output = torch.empty_like(q)
    if meta.num_decodes:
        output[meta.decode_index] = _decode_attention(
            q[meta.decode_index], k_cache, v_cache, meta, scaling, sliding_window
        )
    for segment in meta.prefills:
        q_segment = q[segment.q_start : segment.q_end]
        output[segment.q_start : segment.q_end] = _prefill_attention(
            q_segment, k_cache, v_cache, segment, scaling, sliding_window
        )
    return output[None], None


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """q [B, Hq, D] (one token per request) -> [B, Hq, D]."""
    keys = k_cache[meta.decode_kv_slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[meta.decode_kv_slots].transpose(1, 2)
    valid = meta.decode_kv_valid
    if sliding_window:
        key_positions = torch.arange(valid.shape[1], device=valid.device)
        valid = valid & (key_positions[None, :] > meta.decode_positions[:, None] - sliding_window)
    out = F.scaled_dot_product_attention(
        q[:, :, None].to(keys.dtype),
        keys,
        values,
        attn_mask=valid[:, None, None, :],
        scale=scaling,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out[:, :, 0].to(q.dtype)


def _prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    segment: PrefillSegment,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """q [Q, Hq, D] of one request -> [Q, Hq, D], causal over its cached keys (queries are its last Q positions)."""
    keys = k_cache[segment.kv_slots].transpose(0, 1)  # [Hkv, L, D]
    values = v_cache[segment.kv_slots].transpose(0, 1)
    num_queries, num_keys = q.shape[0], keys.shape[1]
    mask = None
    if sliding_window or num_queries != num_keys:
        key_positions = torch.arange(num_keys, device=q.device)
        mask = key_positions[None, :] <= segment.positions[:, None]
        if sliding_window:
            mask &= key_positions[None, :] > segment.positions[:, None] - sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).to(keys.dtype),
        keys,
        values,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scaling,
        enable_gqa=q.shape[1] != keys.shape[0],
    )
    return out.transpose(0, 1).to(q.dtype)


@functools.cache
def register_paged_attention() -> None:
    """Register `ATTENTION_NAME` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
