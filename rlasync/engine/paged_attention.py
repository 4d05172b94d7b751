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

Attention backends (`PagedAttentionMetadata.backend`):
  varlen     CUDA: FlashAttention's varlen kernel reading the pool through `block_tables` (torch's
             `torch.nn.attention.varlen.varlen_attn`), one call per layer for the whole step, decodes and prefills
             alike, no gather; static shapes when the batch is padded (the decode CUDA-graph path).
  reference  everywhere (CPU, tests, torch without paged varlen): requests feeding one token are batched (keys
             gathered through the block table into [B, L_max], padding masked, one SDPA call); requests feeding
             several tokens (a prompt, a chunk of it, a recomputation) get one SDPA call each over their gathered
             keys, causal with the chunk's offset.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_NAME = "rlasync_paged"
DEFAULT_BLOCK_SIZES = (16, 256)  # tried in order on CUDA (FlashAttention-2's paged kernel may want 256-token pages)

logger = logging.getLogger(__name__)


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
class ReferencePlan:
    """The reference backend's split of a step: decoding requests batched, multi-token requests one by one.

    B_d = requests feeding one token, L = the longest of them after the step (tensors on device)."""

    decode_index: torch.Tensor  # [B_d] int64: row positions of the decoding requests' tokens
    decode_positions: torch.Tensor  # [B_d] int64
    decode_kv_slots: torch.Tensor  # [B_d, L] int64 (null slot past each request's end)
    decode_kv_valid: torch.Tensor  # [B_d, L] bool
    prefills: tuple[PrefillSegment, ...]

    @property
    def num_decodes(self) -> int:
        return int(self.decode_index.shape[0])


@dataclass(frozen=True, eq=False)
class PagedAttentionMetadata:
    """Everything a layer needs for one step, built once per step and shared by all layers.

    N = tokens in the flat row (padding included), B = requests (padding rows included). Tensors are on the
    model's device; `block_tables`, `query_start_loc` and `seq_lens` are what a paged kernel (FlashAttention's
    varlen with `block_table`) reads, in int32. Padding rows feed one token at position 0, write it to the null
    slot and read only the null block, so a fixed-size batch needs no branch.
    """

    pool: KVPool
    backend: str  # "reference" or "varlen"
    positions: torch.Tensor  # [N] int64: each token's position in its request
    slot_mapping: torch.Tensor  # [N] int64: where each token's K/V goes
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: each request's length after the step (its keys)
    seq_start_loc: torch.Tensor  # [B + 1] int32: cumulative seq_lens (FlashAttention's cu_seqlens_k)
    block_tables: torch.Tensor  # [B, max_blocks] int32, null-block padded
    max_query_len: int
    max_seq_len: int
    reference: ReferencePlan | None  # built for the reference backend only


def build_metadata(
    pool: KVPool,
    starts: list[int],
    lengths: list[int],
    block_ids: list[list[int]],
    device: torch.device,
    backend: str = "reference",
    max_blocks: int | None = None,
) -> PagedAttentionMetadata:
    """Metadata of a step where request i feeds `lengths[i]` tokens at positions `starts[i]...` (flat-row order).

    `max_blocks` fixes the block-table width (static shapes); default: the widest request of the step."""
    block_size = pool.block_size
    num_requests = len(starts)
    width = max_blocks if max_blocks is not None else max(len(blocks) for blocks in block_ids)
    null = pool.null_block
    table = torch.tensor([[*blocks, *[null] * (width - len(blocks))] for blocks in block_ids], dtype=torch.int64)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    starts_t = torch.tensor(starts, dtype=torch.int64)
    ends_t = starts_t + lengths_t
    if max(lengths) == 1:  # a decode step (the hot path): one token per request
        row_of_token = q_begin = torch.arange(num_requests)
        positions = starts_t
    else:
        row_of_token = torch.repeat_interleave(torch.arange(num_requests), lengths_t)
        q_begin = torch.cumsum(lengths_t, 0) - lengths_t
        positions = starts_t[row_of_token] + torch.arange(int(lengths_t.sum())) - q_begin[row_of_token]
    slot_mapping = table[row_of_token, positions // block_size] * block_size + positions % block_size
    reference = None
    if backend == "reference":
        reference = _reference_plan(pool, table, starts, lengths, q_begin, ends_t, device)
    elif backend not in ("varlen", "triton"):
        raise ValueError(f"unknown paged attention backend {backend!r}: use 'reference', 'triton' or 'varlen'")
    query_start_loc = torch.cat([q_begin, lengths_t.sum()[None]])
    seq_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(ends_t, 0)])
    return PagedAttentionMetadata(
        pool=pool,
        backend=backend,
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
        seq_lens=ends_t.to(device=device, dtype=torch.int32),
        seq_start_loc=seq_start_loc.to(device=device, dtype=torch.int32),
        block_tables=table.to(device=device, dtype=torch.int32),
        max_query_len=max(lengths),
        max_seq_len=int(ends_t.max()),
        reference=reference,
    )


def _reference_plan(
    pool: KVPool,
    table: torch.Tensor,
    starts: list[int],
    lengths: list[int],
    q_begin: torch.Tensor,
    ends: torch.Tensor,
    device: torch.device,
) -> ReferencePlan:
    block_size = pool.block_size
    offsets = torch.arange(block_size, dtype=torch.int64)
    request_slots = (table[:, :, None] * block_size + offsets).reshape(table.shape[0], -1)
    decode_rows = [i for i, n in enumerate(lengths) if n == 1]
    if decode_rows:
        rows = torch.tensor(decode_rows, dtype=torch.int64)
        max_len = int(ends[rows].max())
        decode_kv_valid = torch.arange(max_len)[None, :] < ends[rows, None]
        decode_kv_slots = request_slots[rows, :max_len].masked_fill(~decode_kv_valid, pool.null_slot)
        decode_index, decode_positions = q_begin[rows], ends[rows] - 1
    else:
        decode_index = decode_positions = torch.zeros(0, dtype=torch.int64)
        decode_kv_slots, decode_kv_valid = decode_index.view(0, 0), torch.zeros(0, 0, dtype=torch.bool)
    prefills = tuple(
        PrefillSegment(
            q_start=int(q_begin[i]),
            q_end=int(q_begin[i]) + n,
            kv_slots=request_slots[i, : int(ends[i])].to(device),
            positions=torch.arange(starts[i], int(ends[i]), dtype=torch.int64, device=device),
        )
        for i, n in enumerate(lengths)
        if n != 1
    )
    return ReferencePlan(
        decode_index=decode_index.to(device),
        decode_positions=decode_positions.to(device),
        decode_kv_slots=decode_kv_slots.to(device),
        decode_kv_valid=decode_kv_valid.to(device),
        prefills=prefills,
    )


def varlen_paged_available() -> bool:
    """Whether this torch has FlashAttention varlen with a paged KV cache (`block_table`, CUDA only)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "block_table" in inspect.signature(varlen_attn).parameters


def probe_varlen(
    block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> str | None:
    """Run the varlen backend once on a small mixed step and compare it with the reference; None if it works, else
    why not (the kernel refused the layout, or disagreed)."""
    if not (device.type == "cuda" and varlen_paged_available()):
        return "needs CUDA and a torch whose varlen_attn takes a block_table"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashAttention runs in 16-bit, the model is {dtype}"
    return _probe("varlen", block_size, num_heads, num_kv_heads, head_dim, dtype, device)


def probe_triton(
    block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> str | None:
    """Like `probe_varlen` for the Triton kernel (`rlasync.engine.triton_attention`)."""
    from rlasync.engine import triton_attention

    if device.type != "cuda" or not triton_attention.available():
        return "needs CUDA and Triton"
    return _probe("triton", block_size, num_heads, num_kv_heads, head_dim, dtype, device)


def _probe(
    backend: str,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> str | None:
    generator = torch.Generator(device=device).manual_seed(0)
    pool = KVPool(1, 8, block_size, num_kv_heads, head_dim, dtype, device)
    pool.kv.normal_(generator=generator)
    starts, lengths, block_ids = [block_size + 3, 0, 2], [1, 5, 4], [[5, 2], [7], [0]]
    shapes = {"query": num_heads, "key": num_kv_heads, "value": num_kv_heads}
    tensors = {
        name: torch.randn(1, heads, sum(lengths), head_dim, dtype=dtype, device=device, generator=generator)
        for name, heads in shapes.items()
    }
    module = _ProbeLayer()
    outputs = []
    try:
        for name in ("reference", backend):
            meta = build_metadata(pool, starts, lengths, block_ids, device, name)
            outputs.append(paged_attention_forward(module, **tensors, attention_mask=None, paged_attention=meta)[0])
    except Exception as error:  # a kernel that cannot compile or launch here: fall back, saying why
        return f"{backend} failed: {type(error).__name__}: {error}"
    error = (outputs[0].float() - outputs[1].float()).abs().max().item()
    return None if error < 5e-2 else f"{backend} disagrees with the reference (max abs error {error:.3g})"


class _ProbeLayer:
    layer_idx = 0


def choose_layout(
    backend: str,
    block_size: int | None,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[str, int]:
    """(backend, block_size) for an engine. "auto" on CUDA: FlashAttention varlen where `probe_varlen` passes (trying
    `block_size`, or 16 then 256 when none is given), else the Triton kernel where `probe_triton` passes, else the
    reference backend, logging why; "varlen"/"triton" raise if their probe fails. CPU: the reference backend."""
    if backend not in ("auto", "varlen", "triton", "reference"):
        raise ValueError(f"attention_backend={backend!r}: use 'auto', 'varlen', 'triton' or 'reference'")
    candidates = (block_size,) if block_size else DEFAULT_BLOCK_SIZES
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return "reference", candidates[0]
    reasons = []
    if backend in ("auto", "varlen"):
        for size in candidates:
            reason = probe_varlen(size, num_heads, num_kv_heads, head_dim, dtype, device)
            if reason is None:
                return "varlen", size
            reasons.append(f"varlen, block_size {size}: {reason}")
    if backend in ("auto", "triton"):
        reason = probe_triton(candidates[0], num_heads, num_kv_heads, head_dim, dtype, device)
        if reason is None:
            if reasons:
                logger.info("paged attention uses the Triton kernel (%s)", "; ".join(reasons))
            return "triton", candidates[0]
        reasons.append(f"triton, block_size {candidates[0]}: {reason}")
    if backend != "auto":
        raise ValueError(f"attention_backend={backend!r} cannot run here ({'; '.join(reasons)})")
    logger.warning("paged attention falls back to the reference backend (gather + SDPA): %s", "; ".join(reasons))
    return "reference", candidates[0]


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
    k_cache, v_cache = meta.pool.keys(layer), meta.pool.values(layer)
    k_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))
    return attend_cached(q, layer, meta, scaling, sliding_window)[None], None


def attend_cached(
    q: torch.Tensor,
    layer: int,
    meta: PagedAttentionMetadata,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """q [N, Hq, D] over layer `layer`'s pool, whose keys and values of this step's tokens are already written at
    `meta.slot_mapping` -> [N, Hq, D] in q's dtype, through `meta.backend`."""
    k_cache, v_cache = meta.pool.keys(layer), meta.pool.values(layer)
    if meta.backend == "varlen":
        return _varlen_attention(q, k_cache, v_cache, meta, scaling, sliding_window)
    if meta.backend == "triton":
        from rlasync.engine.triton_attention import triton_paged_attention

        return triton_paged_attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            block_size=meta.pool.block_size,
            max_query_len=meta.max_query_len,
            scale=scaling,
            sliding_window=sliding_window,
        ).to(q.dtype)
    return _reference_attention(q, k_cache, v_cache, meta.reference, scaling, sliding_window)


def _varlen_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """FlashAttention over the paged pool: one kernel for the whole step (decodes and prefills), causal with each
    request's queries aligned to the end of its keys."""
    from torch.nn.attention.varlen import varlen_attn

    pages_shape = (-1, meta.pool.block_size, *k_cache.shape[1:])
    return varlen_attn(
        q.to(k_cache.dtype),
        k_cache.view(pages_shape),
        v_cache.view(pages_shape),
        meta.query_start_loc,
        meta.seq_start_loc,
        meta.max_query_len,
        meta.max_seq_len,
        scale=scaling,
        window_size=(sliding_window - 1, 0) if sliding_window else (-1, 0),
        enable_gqa=q.shape[1] != k_cache.shape[1],
        seqused_k=meta.seq_lens,
        block_table=meta.block_tables,
    ).to(q.dtype)


def _reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: ReferencePlan,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    output = torch.empty_like(q)
    if plan.num_decodes:
        output[plan.decode_index] = _decode_attention(
            q[plan.decode_index], k_cache, v_cache, plan, scaling, sliding_window
        )
    for segment in plan.prefills:
        output[segment.q_start : segment.q_end] = _prefill_attention(
            q[segment.q_start : segment.q_end], k_cache, v_cache, segment, scaling, sliding_window
        )
    return output


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: ReferencePlan,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """q [B, Hq, D] (one token per request) -> [B, Hq, D]."""
    keys = k_cache[plan.decode_kv_slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[plan.decode_kv_slots].transpose(1, 2)
    valid = plan.decode_kv_valid
    if sliding_window:
        key_positions = torch.arange(valid.shape[1], device=valid.device)
        valid = valid & (key_positions[None, :] > plan.decode_positions[:, None] - sliding_window)
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

    # opaque to torch.compile: a compiled decoder layer (the engine's `compiled_layers`) breaks its graph around it
    AttentionInterface.register(ATTENTION_NAME, torch.compiler.disable(paged_attention_forward))
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
