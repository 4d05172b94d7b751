"""Optional Triton for the engine's kernels: it ships with CUDA builds of torch, not with CPU ones.

A kernel module keeps its kernel a plain function (with `triton.language as tl` imported as a module global, which
the kernel body and Triton's interpreter read) and jits it on first use with `jit`, so `TRITON_INTERPRET=1` set
before that (the CPU tests) takes effect.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

try:
    import triton
except ImportError:
    triton = None


def available() -> bool:
    return triton is not None


@functools.cache
def jit(kernel: Callable[..., Any]) -> Any:
    """`triton.jit(kernel)`, once per kernel; a clear error without Triton."""
    if triton is None:
        raise RuntimeError(f"{kernel.__name__} needs Triton (it ships with CUDA builds of torch)")
    return triton.jit(kernel)
