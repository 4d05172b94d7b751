"""The chunked head's backward for a chunk kept as softmax probabilities (`keep_as="probs"`, docs/algorithms.md
§5.1): without an entropy gradient, d loss / d raw logits = row_scale ⊙ π + S with S sparse at the target and extra
ids, so the row scale goes into the matmuls' operands and no [m, V] pass is made; with one, one dense pass from π.

Shape legend: m terms of the chunk, V vocabulary, H hidden size, L listed ids per term (target + K extra ids).
"""

from __future__ import annotations

import torch

from rlasync.model.head_kernels import fused, sparse_exact, sparse_fixup
from rlasync.model.head_matmul import accumulate_matmul, matmul_to


def _probs_chunk_grad(
    probs,
    z_at,
    math,
    compile_kernels,
    targets,
    extra,
    log_norm,
    mean_logit,
    grad_logprobs,
    grad_entropy,
    grad_extra,
    dynamic="rows",
):
    """A chunk kept as probabilities (no softcap, no candidate sets): (dense grad-logits, None) when the entropy has
    a gradient, else (None, (row_scale [m], ids [m, L], corr [m, L])) with d loss / d raw = row_scale ⊙ π + S and
    S[r, ids[r, j]] = corr[r, j] (each id once per row): the exact value at an id minus row_scale·π there."""
    dtype = log_norm.dtype
    weight_of_norm = torch.zeros_like(log_norm)
    ids, values, zs = [], [], []
    if grad_logprobs is not None:
        weight_of_norm += grad_logprobs.to(dtype)
        ids.append(targets[:, None])
        values.append(grad_logprobs.to(dtype)[:, None])
        zs.append(z_at[:, :1])
    if grad_extra is not None:
        grad_extra = grad_extra.to(dtype).masked_fill(extra < 0, 0.0)
        weight_of_norm += grad_extra.sum(-1)
        ids.append(extra.clamp(min=0))
        values.append(grad_extra)
        zs.append(z_at[:, 1:])
    coef = -weight_of_norm
    ids = torch.cat(ids, 1) if ids else targets[:, None][:, :0]
    values = torch.cat(values, 1) if values else log_norm[:, None][:, :0]
    zs = torch.cat(zs, 1) if zs else log_norm[:, None][:, :0]
    if grad_entropy is not None:
        grad_entropy = grad_entropy.to(dtype)
        dense = fused("dense_grad_probs", compile_kernels, dynamic)(
            probs, log_norm, mean_logit, coef, grad_entropy, math
        )
        if ids.shape[1]:
            sparse_fixup(dense, None, ids, values, log_norm, mean_logit, coef, grad_entropy, math, z_at=zs)
        return dense, None
    row_scale = coef * (math.scale / math.temperature)
    ids, first, exact = sparse_exact(None, ids, values, log_norm, mean_logit, coef, None, math, z_at=zs)
    corr = torch.where(first, exact - probs.gather(1, ids).to(dtype) * row_scale[:, None], 0.0)
    return None, (row_scale, ids, corr)


def _factored_chunk_grads(probs, h, w, factored, needs_hidden, needs_weight):
    """(grad_hidden rows in the reduction dtype, the row-scaled hidden states for the weight's matmul)."""
    row_scale, ids, corr = factored
    m, num_ids = ids.shape
    dtype = row_scale.dtype
    grad_hidden = scaled = None
    if needs_hidden:
        grad_hidden = (probs @ w).to(dtype) * row_scale[:, None]
        if num_ids:
            rows_of_w = w.index_select(0, ids.reshape(-1)).view(m, num_ids, -1).to(dtype)
            grad_hidden += torch.bmm(corr[:, None, :], rows_of_w).squeeze(1)
    if needs_weight:
        scaled = (h.to(dtype) * row_scale[:, None]).to(h.dtype)
    return grad_hidden, scaled


def _add_factored_weight_grad(grad_weight, probs, h, scaled, factored, single, weight_dtype):
    """grad_weight (+)= πᵀ·(c ⊙ h) + Sᵀ·h: one matmul into the accumulator (or the result), then an index_add of
    the sparse rows."""
    _, ids, corr = factored
    if single:
        grad_weight = matmul_to(probs.t(), scaled, weight_dtype)
    else:
        accumulate_matmul(grad_weight, probs.t(), scaled)
    if ids.shape[1]:
        m, num_ids = ids.shape
        rows = (corr[:, :, None] * h.to(corr.dtype)[:, None, :]).reshape(m * num_ids, -1)
        grad_weight.index_add_(0, ids.reshape(-1), rows.to(grad_weight.dtype))
    return grad_weight
