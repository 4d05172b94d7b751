"""The LM head's weight-gradient matmuls: bf16 inputs into a float32 result or accumulator in one pass where the
backend offers `out_dtype` (CUDA builds), else a matmul and a cast (docs/algorithms.md §5.1)."""

from __future__ import annotations

import torch


def _out_dtype_matmul(device: torch.device) -> bool:
    """Whether torch.mm / torch.addmm take bfloat16 inputs with a float32 output (out_dtype) on this device, and
    addmm accumulates in place into that output (CUDA builds); probed once per device type."""
    if device.type not in _OUT_DTYPE:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            acc = torch.ones(2, 2, dtype=torch.float32, device=device)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _OUT_DTYPE[device.type] = bool((acc == 3.0).all())
        except (RuntimeError, NotImplementedError, TypeError):
            _OUT_DTYPE[device.type] = False  # no out_dtype kernel on this backend: that is the probe's answer
    return _OUT_DTYPE[device.type]


_OUT_DTYPE: dict[str, bool] = {}


def matmul_to(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b returned in `dtype`, straight from the matmul's float32 accumulator where the backend can."""
    if a.dtype == dtype:
        return a @ b
    if dtype == torch.float32 and a.dtype in _HALF and _out_dtype_matmul(a.device):
        return torch.mm(a, b, out_dtype=dtype)
    return (a @ b).to(dtype)


def accumulate_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in one pass over acc (addmm into it), also for bfloat16 a, b into a float32 acc on CUDA."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.dtype == torch.float32 and a.dtype in _HALF and _out_dtype_matmul(a.device):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)


_HALF = (torch.bfloat16, torch.float16)
