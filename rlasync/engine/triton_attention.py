"""Paged attention in one Triton kernel: every query of a step (decodes and prefill chunks alike) attends its own
request's keys straight from the paged KV pool, no gather, causal with each request's queries aligned to the end
of its keys; GQA and sliding windows. Reads what `PagedAttentionMetadata` already holds (`query_start_loc`,
`seq_lens`, `block_tables`), so it runs inside the decode CUDA graphs like FlashAttention's varlen kernel would.

    program (request b, query tile t, kv head h):
        rows   = BLOCK_Q query tokens x the G query heads sharing kv head h   (BLOCK_M = BLOCK_Q * G rows)
        keys   = positions 0 .. last query's position, TILE_N at a time, each key's page looked up in
                 block_tables[b, key // block_size] (a tile may span pages)
        online softmax over the tiles (fp32 accumulators), output written per row

Decode steps use BLOCK_Q = 1 (rows = the G heads of one token); prefill steps tile the chunk's queries. The grid is
(B x ceil(max_query_len / BLOCK_Q), Hkv); tiles past a request's query length return at once.

Triton is optional (it ships with CUDA builds of torch): `available()` says whether it imports. On CPU the kernel
runs under Triton's interpreter (`TRITON_INTERPRET=1`), which is how the tests check it against the reference.
"""

from __future__ import annotations

import torch

from rlasync.engine.triton_jit import available, jit

TILE_N = 64


try:
    import triton.language as tl  # a module global of the kernel below
except ImportError:  # CPU builds of torch come without Triton
    tl = None

__all__ = ["available"]


def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,  # q/out [N, Hq, D]; k/v [slots, Hkv, D]
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_kv_slot,
    stride_kv_head,
    stride_bt,
    window,  # 0: none; else keys with position > query position - window are visible
    q_tiles,  # query tiles per request (runtime: a constexpr would compile a kernel per prefill length)
    G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE: tl.constexpr,
    PAGE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = pid // q_tiles
    tile = pid % q_tiles
    q_begin = tl.load(query_start_loc_ptr + request)
    q_len = tl.load(query_start_loc_ptr + request + 1) - q_begin
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + request)
    context = seq_len - q_len  # keys before the first query

    rows = tl.arange(0, BLOCK_M)
    q_tok = tile * BLOCK_Q + rows // G
    head = kv_head * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (q_tok < q_len)
    q_pos = context + q_tok
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q_offsets = (q_begin + q_tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    last_pos = context + tl.minimum((tile + 1) * BLOCK_Q, q_len) - 1
    first_key = tl.where(window > 0, tl.maximum(context + tile * BLOCK_Q - window + 1, 0), 0)
    first_key = (first_key // TILE) * TILE
    cols = tl.arange(0, TILE)
    for start in range(first_key, last_pos + 1, TILE):
        key_pos = start + cols
        key_ok = key_pos <= last_pos
        page = tl.load(block_tables_ptr + request * stride_bt + key_pos // PAGE, mask=key_ok, other=0)
        slot = page.to(tl.int64) * PAGE + key_pos % PAGE
        kv_offsets = slot[:, None] * stride_kv_slot + kv_head * stride_kv_head + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        visible = (key_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
        visible = visible & ((window == 0) | (key_pos[None, :] > q_pos[:, None] - window))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_offsets = (q_begin + q_tok)[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def triton_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    block_size: int,
    max_query_len: int,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [N, Hq, D], k/v cache [slots, Hkv, D] (slot = page * block_size + offset) -> [N, Hq, D] in q's dtype.

    Request b's queries are q[query_start_loc[b] : query_start_loc[b + 1]] at the last positions of its
    seq_lens[b] keys, whose pages are block_tables[b]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    groups = num_heads // num_kv_heads
    q = q.to(k_cache.dtype).contiguous()
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    num_requests = int(seq_lens.shape[0])
    min_rows = 16  # tl.dot's smallest tile
    block_q = 1 if max_query_len == 1 else max(1, 64 // groups)
    block_m = max(min_rows, _next_pow2(block_q * groups))
    q_tiles = -(-max_query_len // block_q)
    grid = (num_requests * q_tiles, num_kv_heads)
    jit(_paged_attention_kernel)[grid](
        q,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        float(scale if scale is not None else head_dim**-0.5),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        int(sliding_window or 0),
        q_tiles,
        G=groups,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(min_rows, _next_pow2(head_dim)),
        TILE=TILE_N,
        PAGE=block_size,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
