"""Tree attention as two varlen attentions merged by their log-sum-exp (the varlen backend's full-attention path).

`rlasync.model.segment_attention` cuts a packed row into root-path segments: runs [a, b) in which each token's
parent is the token before it. A segment's queries see (i) the segment itself, causally, and (ii) every token of
its root path before a (its ancestors), all of them. Gathering `ancestors ++ segment` as one key sequence per
segment (the windowed path) copies a prompt's keys once per completion and sums their gradients back with an
index_add that contends on the same rows. Here the two parts are two kernel calls instead:

    self   every segment against itself, causal: the row's own q/k/v, no copy (cu_seqlens = the segment bounds);
    cross  the segments that branch from the same token p, their queries stacked, against the root path up to
           p, with no mask (every ancestor is visible to every query of such a segment): one entry per branch
           point, so a prompt with G completions is read once, by one [(G-1) C x P] dense block.

Softmax over the union of two disjoint key sets is the weighted sum of the two partial results,

    lse = logaddexp(lse_self, lse_cross),   out = exp(lse_self - lse) out_self + exp(lse_cross - lse) out_cross,

and the backward of attention needs only (dO, q, k, v, out, lse): each part's backward, called with the merged
`out` and `lse`, returns exactly its share of dq and the gradients of its keys (P = exp(S - lse) is already the
merged probability, and D = rowsum(dO * out) is the merged one), so dq is the sum of the two and the cross keys'
gradients are scattered back to their rows. This is how ring attention combines blocks.

The kernels are FlashAttention varlen (`torch.ops.aten._flash_attention_forward/_backward`) on CUDA in 16-bit, and
a reference loop (the same formulas, one entry at a time) elsewhere; both sit inside one custom op with its own
backward, so a compiled decoder layer sees one opaque call.
"""

from __future__ import annotations

import math

import torch


def uses_flash_kernel(query: torch.Tensor) -> bool:
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention over entries (queries cu_q[e]:cu_q[e+1] against keys cu_k[e]:cu_k[e+1]; `causal` aligns
    the queries to the end of the keys) returning (out, lse [Hq, Nq])."""
    if uses_flash_kernel(query):
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            query, key, value, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
        )
        return out, lse
    return _reference_forward(query, key, value, cu_q, cu_k, causal, scale)


def attention_with_lse_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `attention_with_lse` given the output and lse to differentiate through (they may be the
    merged ones of a larger attention that this call is one part of)."""
    if uses_flash_kernel(query):
        rng = torch.zeros(2, dtype=torch.uint64, device=query.device)  # no dropout: the kernel ignores them
        unused = torch.empty(0, device=query.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out, query, key, value, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale
        )
        return dq, dk, dv
    return _reference_backward(grad_out, query, key, value, out, lse, cu_q, cu_k, causal, scale)


def _entry_mask(lq: int, lk: int, causal: bool, device: torch.device) -> torch.Tensor | None:
    if not causal:
        return None
    offset = torch.arange(lq, device=device)[:, None] + (lk - lq) - torch.arange(lk, device=device)[None, :]
    return offset >= 0


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def lse_dtype(query: torch.Tensor) -> torch.dtype:
    """float32 (the kernel's), float64 for float64 inputs (the reference loop, in tests)."""
    return _compute_dtype(query)


def _reference_forward(query, key, value, cu_q, cu_k, causal, scale):
    dtype, heads, groups = _compute_dtype(query), query.shape[1], query.shape[1] // key.shape[1]
    out = torch.zeros(query.shape, dtype=dtype, device=query.device)
    lse = torch.full((heads, query.shape[0]), -math.inf, dtype=lse_dtype(query), device=query.device)
    qs, ks = cu_q.tolist(), cu_k.tolist()
    for e in range(len(qs) - 1):
        if qs[e + 1] == qs[e] or ks[e + 1] == ks[e]:
            continue
        q = query[qs[e] : qs[e + 1]].to(dtype).transpose(0, 1)  # [Hq, Lq, D]
        k = key[ks[e] : ks[e + 1]].to(dtype).repeat_interleave(groups, dim=1).transpose(0, 1)
        v = value[ks[e] : ks[e + 1]].to(dtype).repeat_interleave(groups, dim=1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * scale
        mask = _entry_mask(q.shape[1], k.shape[1], causal, query.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        entry_lse = torch.logsumexp(scores, dim=-1)  # [Hq, Lq]
        out[qs[e] : qs[e + 1]] = (torch.exp(scores - entry_lse[..., None]) @ v).transpose(0, 1)
        lse[:, qs[e] : qs[e + 1]] = entry_lse.to(lse.dtype)
    return out.to(query.dtype), lse


def _reference_backward(grad_out, query, key, value, out, lse, cu_q, cu_k, causal, scale):
    dtype, groups = _compute_dtype(query), query.shape[1] // key.shape[1]
    dq = torch.zeros(query.shape, dtype=dtype, device=query.device)
    dk = torch.zeros(key.shape, dtype=dtype, device=query.device)
    dv = torch.zeros(value.shape, dtype=dtype, device=query.device)
    qs, ks = cu_q.tolist(), cu_k.tolist()
    for e in range(len(qs) - 1):
        if qs[e + 1] == qs[e] or ks[e + 1] == ks[e]:
            continue
        rows, cols = slice(qs[e], qs[e + 1]), slice(ks[e], ks[e + 1])
        q = query[rows].to(dtype).transpose(0, 1)  # [Hq, Lq, D]
        k = key[cols].to(dtype).repeat_interleave(groups, dim=1).transpose(0, 1)  # [Hq, Lk, D]
        v = value[cols].to(dtype).repeat_interleave(groups, dim=1).transpose(0, 1)
        do = grad_out[rows].to(dtype).transpose(0, 1)
        o = out[rows].to(dtype).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * scale
        probs = torch.exp(scores - lse[:, rows].to(dtype)[..., None])
        mask = _entry_mask(q.shape[1], k.shape[1], causal, query.device)
        if mask is not None:
            probs = probs.masked_fill(~mask, 0.0)
        d = (do * o).sum(-1, keepdim=True)  # [Hq, Lq, 1]
        dscores = probs * (do @ v.transpose(1, 2) - d)
        dq[rows] = (dscores @ k * scale).transpose(0, 1)
        hk = key.shape[1]
        dk_e = (dscores.transpose(1, 2) @ q * scale).view(hk, groups, -1, q.shape[-1]).sum(1)  # heads of a group
        dv_e = (probs.transpose(1, 2) @ do).view(hk, groups, -1, q.shape[-1]).sum(1)
        dk[cols] += dk_e.transpose(0, 1)
        dv[cols] += dv_e.transpose(0, 1)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def _merge(out_self, lse_self, out_cross, lse_cross, cross_query_index):
    """(out, lse) of the union of the two key sets; `out_cross`/`lse_cross` cover the rows `cross_query_index`."""
    lse_part = lse_self.index_select(1, cross_query_index)
    lse_union = torch.logaddexp(lse_part, lse_cross)
    w_self = torch.exp(lse_part - lse_union).t()[..., None]  # [Nc, Hq, 1]
    w_cross = torch.exp(lse_cross - lse_union).t()[..., None]
    mixed = out_self.index_select(0, cross_query_index).to(w_self.dtype) * w_self + out_cross.to(w_self.dtype) * w_cross
    out = out_self.index_copy(0, cross_query_index, mixed.to(out_self.dtype))
    lse = lse_self.index_copy(1, cross_query_index, lse_union)
    return out, lse


@torch.library.custom_op("rlasync::cascade_tree_attention", mutates_args=())
def cascade_tree_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    self_start: torch.Tensor,
    cross_query_index: torch.Tensor,
    cross_query_start: torch.Tensor,
    cross_key_index: torch.Tensor,
    cross_key_start: torch.Tensor,
    max_self: int,
    max_cross_query: int,
    max_cross_key: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = attention_with_lse(query, key, value, self_start, self_start, max_self, max_self, True, scale)
    if cross_query_index.numel() == 0:
        return out, lse
    out_cross, lse_cross = attention_with_lse(
        query.index_select(0, cross_query_index), key.index_select(0, cross_key_index),
        value.index_select(0, cross_key_index), cross_query_start, cross_key_start, max_cross_query, max_cross_key,
        False, scale,
    )  # fmt: skip
    return _merge(out, lse, out_cross, lse_cross, cross_query_index)


@cascade_tree_attention_op.register_fake
def _(query, key, value, self_start, cross_query_index, cross_query_start, cross_key_index, cross_key_start,
      max_self, max_cross_query, max_cross_key, scale):  # fmt: skip
    lse = query.new_empty((query.shape[1], query.shape[0]), dtype=lse_dtype(query))
    return torch.empty_like(query), lse


@torch.library.custom_op("rlasync::cascade_tree_attention_backward", mutates_args=())
def cascade_tree_attention_backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    self_start: torch.Tensor,
    cross_query_index: torch.Tensor,
    cross_query_start: torch.Tensor,
    cross_key_index: torch.Tensor,
    cross_key_start: torch.Tensor,
    max_self: int,
    max_cross_query: int,
    max_cross_key: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_out = grad_out.contiguous()
    dq, dk, dv = attention_with_lse_backward(
        grad_out, query, key, value, out, lse, self_start, self_start, max_self, max_self, True, scale
    )
    if cross_query_index.numel() == 0:
        return dq, dk, dv
    dq_cross, dk_cross, dv_cross = attention_with_lse_backward(
        grad_out.index_select(0, cross_query_index), query.index_select(0, cross_query_index),
        key.index_select(0, cross_key_index), value.index_select(0, cross_key_index),
        out.index_select(0, cross_query_index), lse.index_select(1, cross_query_index).contiguous(),
        cross_query_start, cross_key_start, max_cross_query, max_cross_key, False, scale,
    )  # fmt: skip
    dq.index_add_(0, cross_query_index, dq_cross)  # the self part's gradients are this op's own buffers
    dk.index_add_(0, cross_key_index, dk_cross)
    dv.index_add_(0, cross_key_index, dv_cross)
    return dq, dk, dv


@cascade_tree_attention_backward_op.register_fake
def _(grad_out, query, key, value, out, lse, self_start, cross_query_index, cross_query_start, cross_key_index,
      cross_key_start, max_self, max_cross_query, max_cross_key, scale):  # fmt: skip
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, *plan, max_self, max_cross_query, max_cross_key, scale = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, *plan)
    ctx.mark_non_differentiable(lse)
    ctx.sizes = (max_self, max_cross_query, max_cross_key, scale)


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, *plan = ctx.saved_tensors
    dq, dk, dv = cascade_tree_attention_backward_op(grad_out, query, key, value, out, lse, *plan, *ctx.sizes)
    return (dq, dk, dv) + (None,) * 9


cascade_tree_attention_op.register_autograd(_backward, setup_context=_setup_context)
