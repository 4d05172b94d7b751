"""The chunked LM head's per-chunk math over one chunk's raw logits [m, V] (docs/algorithms.md §5.1, §5.3).

Two dense passes, each written so that it fuses into one kernel under torch.compile (elementwise math feeding row
reductions, no [m, V] temporaries kept between ops):

  dense_stats   forward: logsumexp and the softmax mean of the post-processed logits, from which the entropy
                H = lse − E_π[z] follows; reads the raw logits once
  dense_grad    backward: the dense part of d loss / d raw logits, −π(v)·(w_norm + g_H·(z[v] − E_π[z])) times the
                chain factor of the logit transform, written in the logits' dtype; reads the raw logits once

When the head keeps probabilities instead of logits from forward to backward (no softcap: the chain factor is a
constant), `dense_stats_probs` also writes π = softmax(z) in the logits' dtype, and the backward needs no dense pass
unless the entropy has a gradient, when `dense_grad_probs` forms the same dense value from π, using
z − E_π[z] = log π + lse − E_π[z] (π = 0 contributes 0).

Everything sparse (the target, the K extra ids, the C candidate ids) is a gather at [m, L] ids: `sparse_fixup`
adds those ids' contributions (onehot terms, the candidate-set softmax of renormalising terms) to the dense value at
the same ids, recomputed in float32, and writes each listed id once (repeated ids are summed first, so every write
of one id carries the same value): the grad-logits are rounded to their dtype once, as a float32 buffer would.

`transform`/`chain` are the logit post-processing z = (c·tanh(s·raw / c)) / T and its derivative dz/draw.
Reductions run in float32 (float64 for float64 logits, for exact checks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadMath:
    """The logit post-processing of docs/algorithms.md §5.1: scale, optional final-logit softcap, temperature."""

    temperature: float
    scale: float
    softcap: float | None


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def transform(raw: torch.Tensor, math: HeadMath) -> torch.Tensor:
    """Post-processed logits (float32 or wider) from raw logits of any shape."""
    z = raw.to(reduce_dtype(raw.dtype))
    if math.scale != 1.0:
        z = z * math.scale
    if math.softcap is not None:
        z = torch.tanh(z / math.softcap) * math.softcap
    if math.temperature != 1.0:
        z = z / math.temperature
    return z


def chain(raw: torch.Tensor, math: HeadMath) -> torch.Tensor | float:
    """dz/draw of `transform`, elementwise (a float when it is a constant)."""
    factor = math.scale / math.temperature
    if math.softcap is None:
        return factor
    tanh = torch.tanh(raw.to(reduce_dtype(raw.dtype)) * (math.scale / math.softcap))
    return (1.0 - tanh * tanh) * factor


def dense_stats(raw: torch.Tensor, math: HeadMath) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of raw logits [m, V]: (logsumexp z, E_π[z]) in the reduction dtype."""
    z = transform(raw, math)
    peak = z.amax(dim=-1, keepdim=True)
    e = torch.exp(z - peak)
    total = e.sum(dim=-1)
    mean = (e * z).sum(dim=-1) / total
    return peak.squeeze(-1) + torch.log(total), mean


def dense_stats_probs(raw: torch.Tensor, math: HeadMath) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dense_stats` and π = softmax(z) [m, V] in raw's dtype (no softcap: backward then needs no logits)."""
    z = transform(raw, math)
    peak = z.amax(dim=-1, keepdim=True)
    e = torch.exp(z - peak)
    total = e.sum(dim=-1, keepdim=True)
    mean = (e * z).sum(dim=-1) / total.squeeze(-1)
    return peak.squeeze(-1) + torch.log(total.squeeze(-1)), mean, (e / total).to(raw.dtype)


def dense_grad_probs(probs, lse, mean, coef, grad_entropy, math: HeadMath) -> torch.Tensor:
    """`dense_grad` from kept probabilities π [m, V] (no softcap): π·(coef − g_H·(log π + lse − E_π[z]))·s/T."""
    p = probs.to(reduce_dtype(probs.dtype))
    centred = torch.where(p > 0, torch.log(p) + (lse - mean)[:, None], 0.0)
    scale = coef[:, None] - grad_entropy[:, None] * centred
    return (p * scale * (math.scale / math.temperature)).to(probs.dtype)


def _pre_chain(z, lse, mean, coef, grad_entropy):  # elementwise, broadcast over [m, V] or [m, L]
    probs = torch.exp(z - lse[:, None])
    scale = coef[:, None]
    if grad_entropy is not None:
        scale = scale - grad_entropy[:, None] * (z - mean[:, None])
    return probs * scale


def dense_grad(raw, lse, mean, coef, grad_entropy, math: HeadMath) -> torch.Tensor:
    """[m, V] in raw's dtype: (π(v)·(coef − g_H·(z[v] − E_π[z]))) · dz/draw; coef = −w_norm on terms normalised over
    the vocabulary (0 on renormalising ones: their normaliser's part is sparse), g_H the entropy's incoming grad."""
    z = transform(raw, math)
    return (_pre_chain(z, lse, mean, coef, grad_entropy) * chain(raw, math)).to(raw.dtype)


def sparse_fixup(out, raw, ids, values, lse, mean, coef, grad_entropy, math: HeadMath, z_at=None) -> None:
    """out[r, ids[r, j]] = round((dense pre-chain value + Σ values at that id) · dz/draw) for every listed id.
    z_at: the post-processed logits at `ids` when `raw` is not at hand (kept probabilities; no softcap)."""
    ids, starts, exact = sparse_exact(raw, ids, values, lse, mean, coef, grad_entropy, math, z_at)
    out.scatter_(1, ids, exact.to(out.dtype))


def sparse_exact(raw, ids, values, lse, mean, coef, grad_entropy, math: HeadMath, z_at=None):
    """(ids sorted per row, first-occurrence mask, the exact d loss / d raw at each of them in float32)."""
    ids, order = torch.sort(ids, dim=1)
    values = values.gather(1, order)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    segment = starts.long().cumsum(dim=1) - 1
    summed = torch.zeros_like(values).scatter_add_(1, segment, values).gather(1, segment)
    if z_at is None:
        raw_at = raw.gather(1, ids)
        z, factor = transform(raw_at, math), chain(raw_at, math)
    else:
        z, factor = z_at.gather(1, order), chain(z_at, math)  # a constant: z_at is only given without softcap
    return ids, starts, (_pre_chain(z, lse, mean, coef, grad_entropy) + summed) * factor


_COMPILED: dict[tuple[str, str], Callable] = {}
COMPILE_FAILURES: list[str] = []  # the first failure to compile a pass: both passes run eagerly from then on
DYNAMIC_MODES = ("rows", "all")


def fused(name: str, compile_kernels: bool, dynamic: str = "rows") -> Callable:
    """`dense_stats`, `dense_grad`, `dense_stats_probs` or `dense_grad_probs`, torch.compile'd when
    `compile_kernels`; a pass that fails to compile (a GPU or torch build inductor cannot serve) warns once and runs
    eagerly from then on: the same values, more kernels.

    Only the chunk's length (dim 0 of every tensor argument) is dynamic: the vocabulary is a constant of the graph,
    so the [m, V] passes index rows by a constant divisor and size their reduction loops for V, not for a symbol.
    `dynamic="all"` (`kernels.head_dynamic`) compiles every size dynamic instead (how the passes were compiled
    before; kept for the A/B on a GPU)."""
    function = {
        "dense_stats": dense_stats,
        "dense_grad": dense_grad,
        "dense_stats_probs": dense_stats_probs,
        "dense_grad_probs": dense_grad_probs,
    }[name]
    if not compile_kernels or COMPILE_FAILURES:
        return function
    mode = check_dynamic(dynamic)
    if (name, mode) not in _COMPILED:
        if mode == "all":
            compiled = torch.compile(function, dynamic=True, fullgraph=True)
        else:
            compiled = _rows_dynamic(torch.compile(function, fullgraph=True))
        _COMPILED[name, mode] = _falling_back(compiled, function)
    return _COMPILED[name, mode]


def check_dynamic(mode: str) -> str:
    """`mode` if it is a dynamic mode of the compiled passes, else a `ValueError` naming the setting."""
    if mode not in DYNAMIC_MODES:
        raise ValueError(
            f"kernels.head_dynamic must be 'rows' (the default: only the chunk length is dynamic) or 'all', "
            f"got {mode!r}"
        )
    return mode


def _rows_dynamic(compiled: Callable) -> Callable:
    """`compiled` with dim 0 (the chunk's rows) of each tensor argument marked dynamic before the call, every other
    size static: one graph serves every chunk length of a vocabulary."""

    def run(*args: Any) -> Any:
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return compiled(*args)

    return run


def _falling_back(compiled: Callable, eager: Callable) -> Callable:
    from rlasync.model.attention import _compile_errors

    def run(*args: Any) -> Any:
        if COMPILE_FAILURES:
            return eager(*args)
        try:
            return compiled(*args)
        except _compile_errors() as exc:
            COMPILE_FAILURES.append(f"{type(exc).__name__}: {exc}")
            logger.warning(
                "the LM head's compiled passes failed to compile (%s); they run eagerly from now on "
                "(same values, more kernels; kernels.head_compile=false skips compiling)",
                COMPILE_FAILURES[0][:300],
            )
            return eager(*args)

    return run
