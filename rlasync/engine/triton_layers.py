"""The decoder layer's elementwise work as a few Triton kernels (CUDA), for the engine's fused layers
(`rlasync.engine.fused_decoder`).

transformers' eager Llama/Qwen layer spends, per layer and step, about forty small kernels between its six
projections: each RMSNorm is six (cast, square, mean, add-eps and rsqrt, two multiplies), the rotary embedding five
per tensor (two multiplies, slices, a negation, a concatenation, an add), Qwen3's per-head q/k norms six each, the
residual adds, the SiLU and its product, the transposes and the KV pool's index copies. In a captured decode step at
256 requests each is a few microseconds of a mostly idle GPU, a third of the step in a profile (the projections and
attention are the rest). Here they are four kernels a layer:

    rms_norm(x, w)                 y = w * round(x * rsqrt(mean(x^2) + eps))
    add_rms_norm(x, r, w)          s = round(x + r);  y = rms_norm(s, w);  returns (y, s)
    rope_rows(...)                 per (token, head): optional RMSNorm over head_dim (Qwen3's q/k norm), the
                                   rotary embedding from HF's cos/sin, written to an output row or a KV pool slot;
                                   the values' copy into the pool is the same kernel without norm and rotation
    silu_mul(g, u)                 y = round(silu(g)) * u

`round` is the activations' dtype: each kernel computes in float32 and rounds where transformers' eager code
rounds between its ops (after the residual add, after the normalised value, after the activation), so the engine
keeps the learner's numbers; the rotary embedding rounds once where eager rounds after each multiply and add (at
most an ulp of bf16 apart, and nearer the learner's compiled layers, which fuse it the same way).

Triton is optional: on CPU the kernels run only under Triton's interpreter (the tests compare them with
transformers' layers).
"""

from __future__ import annotations

import torch

from rlasync.engine.triton_jit import available, jit

try:
    import triton.language as tl  # a module global of the kernels below
except ImportError:  # CPU builds of torch come without Triton
    tl = None

__all__ = ["add_rms_norm", "available", "rms_norm", "rope_rows", "silu_mul"]

ELEMENTWISE_BLOCK = 1024


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_cols,
    stride_x,
    stride_res,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=valid, other=0.0).to(tl.float32)
        s = (x + r).to(dtype)  # eager's `residual + hidden` rounds here
        tl.store(res_out_ptr + row * n_cols + cols, s, mask=valid)
        x = s.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * normed).to(dtype), mask=valid)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2D rows over its last dim, without a copy when its rows are evenly strided."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm over x's last dim (any leading shape): `weight * round(x * rsqrt(mean(x^2) + eps))`."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    jit(_rms_norm_kernel)[(rows.shape[0],)](
        rows, rows, weight, out, out, rows.shape[1], rows.stride(0), rows.stride(0), float(eps),
        HAS_RESIDUAL=False, BLOCK=_next_power_of_2(rows.shape[1]),
    )  # fmt: skip
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`rms_norm(s, weight)`, s) for s = round(x + residual): a layer's residual add and the next norm in one pass."""
    rows, res = _rows(x), _rows(residual)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    jit(_rms_norm_kernel)[(rows.shape[0],)](
        rows, res, weight, out, summed, rows.shape[1], rows.stride(0), res.stride(0), float(eps),
        HAS_RESIDUAL=True, BLOCK=_next_power_of_2(rows.shape[1]),
    )  # fmt: skip
    return out.view(x.shape), summed.view(x.shape)


def _rope_rows_kernel(
    src_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    dst_ptr,
    dst_index_ptr,
    num_heads,
    stride_src,
    stride_cos,
    stride_dst,
    eps,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ROTATE: tl.constexpr,
    HAS_INDEX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = tl.arange(0, HEAD_DIM // 2)
    dtype = dst_ptr.dtype.element_ty
    src = src_ptr + token * stride_src + head * HEAD_DIM
    x1 = tl.load(src + half).to(tl.float32)
    x2 = tl.load(src + HEAD_DIM // 2 + half).to(tl.float32)
    if HAS_NORM:  # Qwen3's q_norm / k_norm over the head, rounded as eager rounds its output
        act = src_ptr.dtype.element_ty
        variance = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM
        scale = tl.rsqrt(variance + eps)
        w1 = tl.load(w_ptr + half).to(tl.float32)
        w2 = tl.load(w_ptr + HEAD_DIM // 2 + half).to(tl.float32)
        x1 = (w1 * (x1 * scale).to(act).to(tl.float32)).to(act).to(tl.float32)
        x2 = (w2 * (x2 * scale).to(act).to(tl.float32)).to(act).to(tl.float32)
    if ROTATE:  # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        cos = cos_ptr + token * stride_cos
        sin = sin_ptr + token * stride_cos
        c1 = tl.load(cos + half).to(tl.float32)
        c2 = tl.load(cos + HEAD_DIM // 2 + half).to(tl.float32)
        s1 = tl.load(sin + half).to(tl.float32)
        s2 = tl.load(sin + HEAD_DIM // 2 + half).to(tl.float32)
        x1, x2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    if HAS_INDEX:  # a KV pool slot
        row = tl.load(dst_index_ptr + token).to(tl.int64)
    else:
        row = token
    dst = dst_ptr + row * stride_dst + head * HEAD_DIM
    tl.store(dst + half, x1.to(dtype))
    tl.store(dst + HEAD_DIM // 2 + half, x2.to(dtype))


def rope_rows(
    src: torch.Tensor,
    num_heads: int,
    head_dim: int,
    *,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per token t and head h of `src` [N, num_heads * head_dim] (a projection's output): RMSNorm over the head
    with `norm_weight` (if given), then the rotary embedding with cos/sin [N, head_dim] (if given), written to
    `out[slots[t], h]` (a KV pool layer [slots, num_heads, head_dim]) when `slots` is given, else to a new
    [N, num_heads, head_dim] tensor (or `out[t, h]`). Returns the tensor written."""
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"rope_rows: head_dim={head_dim} must be an even power of two")
    rows = _rows(src)
    num_tokens = rows.shape[0]
    if out is None:
        if slots is not None:
            raise ValueError("rope_rows: `slots` needs the pool layer as `out`")
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=src.dtype, device=src.device)
    rotate = cos is not None
    if rotate:
        cos, sin = _rows(cos), _rows(sin)
    if num_tokens == 0:
        return out
    jit(_rope_rows_kernel)[(num_tokens, num_heads)](
        rows,
        norm_weight if norm_weight is not None else rows,
        cos if rotate else rows,
        sin if rotate else rows,
        out,
        slots if slots is not None else rows,
        num_heads,
        rows.stride(0),
        cos.stride(0) if rotate else 0,
        out.stride(0),
        float(eps),
        HEAD_DIM=head_dim,
        HAS_NORM=norm_weight is not None,
        ROTATE=rotate,
        HAS_INDEX=slots is not None,
    )
    return out


def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < n
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # eager rounds the activation, then the product
    tl.store(out_ptr + offsets, (act * u).to(dtype), mask=valid)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`round(silu(gate)) * up`, as transformers' `act_fn(gate_proj(x)) * up_proj(x)` with SiLU."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        jit(_silu_mul_kernel)[(-(-n // ELEMENTWISE_BLOCK),)](gate, up, out, n, BLOCK=ELEMENTWISE_BLOCK)
    return out
