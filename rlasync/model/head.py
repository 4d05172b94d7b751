"""Chunked LM head: per-term log-probs, entropy and extra-id log-probs without [M, vocab] logits (docs/algorithms.md §5.1, §5.3).

From hidden states gathered at the loss terms ([M, H]) and the LM head weight ([V, H]), each term's logits are
post-processed in docs/algorithms.md §5.1's order

    z = h·Wᵀ (+ b)  ->  z · logit_scale  ->  c·tanh(z / c) (final-logit softcap)  ->  z / temperature

and reduced, chunk by chunk of terms, to:
  logprobs        log π(y_t) = z[y_t] − logsumexp(z)
  entropy         H_t = −Σ_v π(v) log π(v) over the full vocabulary
  extra_logprobs  log π(v) at up to K extra ids per term (the sampler's top-K ids for score centering); -1 → -inf

Candidate-set renormalisation (docs/algorithms.md §5.3, "sampling-mask renormalisation"): a term with `has_candidates` uses
log π̃(v) = log π(v) − logsumexp_{u∈S_t} log π(u) = z[v] − logsumexp_{u∈S_t} z[u] for its target and extra ids,
i.e. log_softmax of the logits masked to S_t: π̃ has support S_t, so an id outside S_t (target or extra) gets −inf
and no gradient (the renormalised top-K mass never exceeds 1). Candidate lists are -1 padded; duplicate ids count
once; a term whose list is empty is not renormalised. Entropy stays over the full vocabulary.

Memory and passes: a custom autograd.Function keeps the inputs, three [M] statistics and, within
`keep_logits_bytes`, the raw logits of the first chunks; backward recomputes the others, so gradients w.r.t. the
hidden states, the weight (and bias) are exact and one chunk's [m, V] working buffers exist at a time.
With `keep_as="probs"` a kept chunk holds π = softmax(z) instead (same size): then d loss / d raw logits is
(s/T)·(c_r·π + S) with c_r a per-term scale and S sparse at the target and extra ids, so backward folds c_r into
the two matmuls (grad_hidden = c ⊙ (π·W) + S·W, grad_weight = πᵀ·(c ⊙ h) + Sᵀ·h) and makes no dense pass over
[m, V] unless the entropy has a gradient. It applies where the logit transform is a constant factor (no softcap),
without candidate sets and without a head bias; other heads keep logits. Per chunk
one dense pass forward and one backward (rlasync/model/head_kernels.py, torch.compile'd on CUDA); chunks are sized
by `chunk_bytes`; the weight gradient is one matmul when one chunk holds every term, else addmm accumulations into
a float32 buffer (docs/algorithms.md §5.1). Logits are computed in the weight's dtype (autocast's when it is on,
like the model's own lm_head) and reduced in float32 (float64 inputs stay float64, for exact checks).

Shape legend: M loss terms, H hidden size, V vocabulary, K extra ids per term, C candidate ids per term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rlasync.model.head_kernels import HeadMath, check_dynamic, fused, reduce_dtype, sparse_fixup, transform
from rlasync.model.head_matmul import accumulate_matmul, matmul_to
from rlasync.model.head_probs import _add_factored_weight_grad, _factored_chunk_grads, _probs_chunk_grad

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHUNK_ELEMENTS = 1 << 27  # the CPU default chunk: about 2^27 logits per [m, V] buffer
WORKSPACE_BYTES_PER_LOGIT = 16  # working memory of a chunk per logit (raw logits, grad-logits, float32 temporaries)


@dataclass(frozen=True)
class TokenScores:
    """Per loss term scores from the chunked head (float32)."""

    logprobs: torch.Tensor  # [M] log π(target), renormalised over S_t where the term has a sampling mask
    entropy: torch.Tensor  # [M] full-vocabulary entropy at the temperature (differentiable)
    extra_logprobs: torch.Tensor | None  # [M, K] log π at the extra ids (-inf at -1 / outside S_t), None if none


@dataclass(frozen=True)
class LogitTransform:
    """Post-processing of the raw head logits (docs/algorithms.md §5.1): multiply by `scale`, then softcap if `softcap` is set."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> LogitTransform:
        """Read the logit scale and final-logit softcap a transformers config declares (1 / none by default).

        Scale: `logit_scale` (Cohere), `output_multiplier`, `lm_head_multiplier`, or `1 / logits_scaling` (Granite;
        HyperCLOVA X multiplies by `logits_scaling` itself). Softcap: `final_logit_softcapping` (Gemma 2/3).
        """
        get_text_config = getattr(config, "get_text_config", None)
        text = get_text_config() if get_text_config is not None else config
        scale = 1.0
        for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
            value = getattr(text, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                scale *= float(value)
        logits_scaling = getattr(text, "logits_scaling", None)
        if isinstance(logits_scaling, (int, float)) and not isinstance(logits_scaling, bool) and logits_scaling:
            is_hyperclova = "hyperclova" in str(getattr(text, "model_type", "")).lower()
            scale *= float(logits_scaling) if is_hyperclova else 1.0 / float(logits_scaling)
        softcap = getattr(text, "final_logit_softcapping", None)
        return cls(scale=scale, softcap=float(softcap) if softcap else None)


def default_chunk_size(vocab_size: int) -> int:
    """The chunk on CPU when neither `chunk_size` nor `chunk_bytes` is given: about CHUNK_ELEMENTS logits."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab_size))


def chunked_token_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    transform: LogitTransform | None = None,
    extra_ids: torch.Tensor | None = None,
    candidate_ids: torch.Tensor | None = None,
    has_candidates: torch.Tensor | None = None,
    chunk_size: int | None = None,
    chunk_bytes: int | None = None,
    keep_logits_bytes: int | None = None,
    keep_as: str = "logits",
    compile_kernels: bool | None = None,
    dynamic: str = "rows",
) -> TokenScores:
    """Score M terms: hidden [M, H], weight [V, H], target_ids [M]; extra_ids [M, K] and candidate_ids [M, C]
    (-1 padded) with has_candidates [M] bool (None = every row that lists a candidate). See the module docstring.

    chunk_size: terms per chunk; None sizes chunks by `chunk_bytes`, the working memory of one chunk (default: an
    eighth of the free CUDA memory, about CHUNK_ELEMENTS logits on CPU). keep_logits_bytes: how much memory the raw
    logits kept from forward to backward may take (default: a quarter of the free CUDA memory, 0 on CPU).
    keep_as: what a kept chunk holds, "logits" or "probs" (see the module docstring).
    compile_kernels: torch.compile the two dense passes (default: on CUDA). dynamic: which sizes of the compiled
    passes are dynamic, "rows" or "all" (`rlasync.model.head_kernels.fused`). The learner sets these three from
    its `KernelSettings` (head_keep, head_compile, head_dynamic)."""
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [M, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    num_terms = hidden.shape[0]
    if target_ids.shape != (num_terms,):
        raise ValueError(f"target_ids must be [{num_terms}], got {tuple(target_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if keep_logits_bytes is not None and keep_logits_bytes < 0:
        raise ValueError(
            f"keep_logits_bytes must be >= 0 (0 recomputes the logits in backward), got {keep_logits_bytes}"
        )
    transform = transform or LogitTransform()
    device = hidden.device
    extra = _ids_or_empty(extra_ids, num_terms, device, "extra_ids")
    candidates, has = _prepare_candidates(candidate_ids, has_candidates, num_terms, device)
    mm_dtype = _matmul_dtype(weight)
    chunk = plan_chunk_size(num_terms, weight.shape[0], device, chunk_size=chunk_size, chunk_bytes=chunk_bytes)
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    keep = 0
    if wants_grad:
        keep = _default_keep_bytes(device) if keep_logits_bytes is None else int(keep_logits_bytes)
    keep_chunks = plan_kept_chunks(num_terms, chunk, weight.shape[0], mm_dtype, keep)
    math = HeadMath(float(temperature), float(transform.scale), transform.softcap)
    keep_probs = _keep_as(keep_as) == "probs" and math.softcap is None and candidates.shape[1] == 0 and bias is None
    compiled = device.type == "cuda" if compile_kernels is None else bool(compile_kernels)
    config = _HeadConfig(math, chunk, keep_chunks, mm_dtype, compiled, keep_probs, check_dynamic(dynamic))
    logprobs, entropy, extra_logprobs = _ChunkedHead.apply(
        hidden, weight, bias, target_ids.long(), extra, candidates, has, config
    )
    return TokenScores(logprobs, entropy, extra_logprobs if extra_ids is not None else None)


def plan_chunk_size(
    num_terms: int,
    vocab_size: int,
    device: torch.device,
    *,
    chunk_size: int | None = None,
    chunk_bytes: int | None = None,
) -> int:
    """Terms per chunk: `chunk_size`, else as many as `chunk_bytes` of working memory hold (WORKSPACE_BYTES_PER_LOGIT
    per logit), then evened out so that the chunks of `num_terms` differ by at most one term."""
    if chunk_size is not None:
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1 (or None to size chunks by memory), got {chunk_size}")
        size = int(chunk_size)
    else:
        if chunk_bytes is not None and chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0 (or None for the default), got {chunk_bytes}")
        budget = _default_chunk_bytes(device, vocab_size) if chunk_bytes is None else int(chunk_bytes)
        size = max(1, budget // (max(1, vocab_size) * WORKSPACE_BYTES_PER_LOGIT))
    if num_terms <= size:
        return max(1, num_terms)
    num_chunks = -(-num_terms // size)
    return -(-num_terms // num_chunks)


def plan_kept_chunks(num_terms: int, chunk_size: int, vocab_size: int, dtype: torch.dtype, keep_bytes: int) -> int:
    """How many chunks (the first ones) keep their raw [chunk, V] logits within `keep_bytes`; the rest recompute."""
    num_chunks = -(-num_terms // chunk_size)
    chunk_bytes = chunk_size * vocab_size * torch.empty((), dtype=dtype).element_size()
    return min(num_chunks, keep_bytes // max(1, chunk_bytes))


def _free_cuda_bytes(device: torch.device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _default_chunk_bytes(device: torch.device, vocab_size: int) -> int:
    if device.type == "cuda":
        return _free_cuda_bytes(device) // 8
    return default_chunk_size(vocab_size) * max(1, vocab_size) * WORKSPACE_BYTES_PER_LOGIT


def _default_keep_bytes(device: torch.device) -> int:
    return _free_cuda_bytes(device) // 4 if device.type == "cuda" else 0


def _keep_as(keep_as: str) -> str:
    if keep_as not in ("logits", "probs"):
        raise ValueError(f"keep_as must be 'logits' or 'probs' (kernels.head_keep), got {keep_as!r}")
    return keep_as


def _matmul_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the logits are computed in: autocast's where it is on (float64 stays float64), else the weight's."""
    device_type = weight.device.type
    if weight.dtype != torch.float64 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


@dataclass(frozen=True)
class _HeadConfig:
    math: HeadMath
    chunk_size: int
    keep_chunks: int  # the first `keep_chunks` chunks keep their raw logits from forward to backward
    mm_dtype: torch.dtype
    compile_kernels: bool
    keep_probs: bool = False  # kept chunks hold softmax probabilities (and z at the sparse ids), not raw logits
    dynamic: str = "rows"  # which sizes of the compiled passes are dynamic (head_kernels.fused)


def _ids_or_empty(ids: torch.Tensor | None, num_terms: int, device: torch.device, name: str) -> torch.Tensor:
    if ids is None:
        return torch.empty(num_terms, 0, dtype=torch.long, device=device)
    if ids.ndim != 2 or ids.shape[0] != num_terms:
        raise ValueError(f"{name} must be [{num_terms}, K], got {tuple(ids.shape)}")
    return ids.long()


def _prepare_candidates(
    candidate_ids: torch.Tensor | None, has_candidates: torch.Tensor | None, num_terms: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending candidates with -1 (first) at pads and repeated ids ([M, C]); `has` false where a row lists none."""
    candidates = _ids_or_empty(candidate_ids, num_terms, device, "candidate_ids")
    if candidates.shape[1] == 0:
        return candidates, torch.zeros(num_terms, dtype=torch.bool, device=device)
    candidates = torch.sort(candidates, dim=1).values
    repeated = torch.zeros_like(candidates, dtype=torch.bool)
    repeated[:, 1:] = candidates[:, 1:] == candidates[:, :-1]
    candidates = torch.sort(candidates.masked_fill(repeated | (candidates < 0), -1), dim=1).values.contiguous()
    has = candidates[:, -1] >= 0
    if has_candidates is not None:
        if has_candidates.shape != (num_terms,):
            raise ValueError(f"has_candidates must be [{num_terms}], got {tuple(has_candidates.shape)}")
        has = has & has_candidates.to(device=device, dtype=torch.bool)
    return candidates, has


def _raw_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(hidden, weight, bias)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, extra, candidates, has, config: _HeadConfig):
        num_terms = hidden.shape[0]
        device = hidden.device
        dtype = reduce_dtype(hidden.dtype)  # float32, or float64 for exact checks
        logprobs = torch.empty(num_terms, dtype=dtype, device=device)
        entropy = torch.empty_like(logprobs)
        extra_logprobs = torch.empty(extra.shape, dtype=dtype, device=device)
        log_norm = torch.empty_like(logprobs)  # logsumexp over the vocabulary
        log_norm_target = torch.empty_like(logprobs)  # ... or over S_t where the term renormalises
        mean_logit = torch.empty_like(logprobs)  # E_π[z], for the entropy's gradient
        stats = fused("dense_stats", config.compile_kernels, config.dynamic)
        stats_probs = fused("dense_stats_probs", config.compile_kernels, config.dynamic)
        math = config.math
        kept, kept_z = [], []  # per kept chunk: raw logits, or probabilities and z at [target, extra ids]
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            w, b = _cast(weight, bias, config.mm_dtype)
            for index, start in enumerate(range(0, num_terms, config.chunk_size)):
                rows = slice(start, min(start + config.chunk_size, num_terms))
                raw = _raw_logits(hidden[rows].to(config.mm_dtype), w, b)
                as_probs = config.keep_probs and index < config.keep_chunks
                if as_probs:
                    lse, mean, probs = stats_probs(raw, math)
                else:
                    lse, mean = stats(raw, math)
                entropy[rows] = lse - mean
                norm = _renormaliser(raw, lse, candidates[rows], has[rows], math)
                z_at = transform(raw.gather(1, targets[rows, None]), math)
                values = z_at.squeeze(1) - norm
                outside = _outside(targets[rows, None], candidates[rows], has[rows]).squeeze(1)
                logprobs[rows] = values.masked_fill(outside, float("-inf"))
                if extra.shape[1]:
                    z_extra = transform(raw.gather(1, extra[rows].clamp(min=0)), math)
                    z_at = torch.cat([z_at, z_extra], 1)
                    invalid = _invalid_extra(extra[rows], candidates[rows], has[rows])
                    extra_logprobs[rows] = (z_extra - norm[:, None]).masked_fill(invalid, float("-inf"))
                log_norm[rows], log_norm_target[rows], mean_logit[rows] = lse, norm, mean
                if as_probs:
                    kept.append(probs)
                    kept_z.append(z_at)
                elif index < config.keep_chunks:
                    kept.append(raw)
        ctx.save_for_backward(
            hidden,
            weight,
            bias,
            targets,
            extra,
            candidates,
            has,
            log_norm,
            log_norm_target,
            mean_logit,
            *kept,
            *kept_z,
        )
        ctx.config = config
        ctx.set_materialize_grads(False)
        return logprobs, entropy, extra_logprobs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, grad_extra):
        hidden, weight, bias, targets, extra, candidates, has, log_norm, log_norm_target, mean_logit, *kept = (
            ctx.saved_tensors
        )
        config: _HeadConfig = ctx.config
        kept_z = []
        if config.keep_probs:
            kept, kept_z = kept[: len(kept) // 2], kept[len(kept) // 2 :]
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        if grad_extra is not None and extra.shape[1] == 0:
            grad_extra = None
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            grads = _head_backward(
                hidden,
                weight,
                bias,
                targets,
                extra,
                candidates,
                has,
                log_norm,
                log_norm_target,
                mean_logit,
                kept,
                kept_z,
                config,
                grad_logprobs,
                grad_entropy,
                grad_extra,
                needs_hidden,
                needs_weight,
                needs_bias,
            )
        return (*grads, None, None, None, None, None)


def _cast(weight, bias, dtype):
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _head_backward(
    hidden,
    weight,
    bias,
    targets,
    extra,
    candidates,
    has,
    log_norm,
    log_norm_target,
    mean_logit,
    kept,
    kept_z,
    config: _HeadConfig,
    grad_logprobs,
    grad_entropy,
    grad_extra,
    needs_hidden,
    needs_weight,
    needs_bias,
):
    """Chunk by chunk: the grad-logits of a chunk (kept or recomputed logits), then its grad_hidden rows and its
    addition to grad_weight / grad_bias (float32 accumulators when there are several chunks). A chunk kept as
    probabilities without an entropy gradient goes through `_factored_chunk_grads` instead: no grad-logits."""
    num_terms = hidden.shape[0]
    w, b = _cast(weight, bias, config.mm_dtype)
    single = num_terms <= config.chunk_size
    accumulate = reduce_dtype(weight.dtype)
    grad_hidden = torch.empty_like(hidden) if needs_hidden and not single else None
    grad_weight = None  # one chunk: a single matmul; several: a float32 (or wider) accumulator
    if needs_weight and (not single or num_terms == 0):
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
    grad_bias = torch.zeros(bias.shape, dtype=accumulate, device=bias.device) if needs_bias else None
    for index, start in enumerate(range(0, num_terms, config.chunk_size)):
        rows = slice(start, min(start + config.chunk_size, num_terms))
        h = hidden[rows].to(config.mm_dtype)
        incoming = [_rows_of(g, rows, num_terms) for g in (grad_logprobs, grad_entropy, grad_extra)]
        if index < len(kept_z):
            probs = kept[index]
            grad_raw, factored = _probs_chunk_grad(
                probs,
                kept_z[index],
                config.math,
                config.compile_kernels,
                targets[rows],
                extra[rows],
                log_norm[rows],
                mean_logit[rows],
                *incoming,
                dynamic=config.dynamic,
            )
            if factored is not None:
                part = _factored_chunk_grads(probs, h, w, factored, needs_hidden, needs_weight)
                if needs_hidden:
                    if single:
                        grad_hidden = part[0].to(hidden.dtype)
                    else:
                        grad_hidden[rows] = part[0]
                if needs_weight:
                    grad_weight = _add_factored_weight_grad(
                        grad_weight, probs, h, part[1], factored, single, weight.dtype
                    )
                continue
        else:
            raw = kept[index] if index < len(kept) else _raw_logits(h, w, b)
            grad_raw = _chunk_grad_logits(
                raw,
                config.math,
                config.compile_kernels,
                targets[rows],
                extra[rows],
                candidates[rows],
                has[rows],
                log_norm[rows],
                log_norm_target[rows],
                mean_logit[rows],
                *incoming,
                dynamic=config.dynamic,
            )
            del raw
        if needs_hidden:
            if single:
                grad_hidden = (grad_raw @ w).to(hidden.dtype)
            else:
                grad_hidden[rows] = grad_raw @ w
        if needs_weight:
            if single:
                grad_weight = matmul_to(grad_raw.t(), h, weight.dtype)  # no [V, H] accumulator pass
            else:
                accumulate_matmul(grad_weight, grad_raw.t(), h)
        if needs_bias:
            grad_bias += grad_raw.sum(0, dtype=accumulate)
    if needs_hidden and num_terms == 0:
        grad_hidden = torch.zeros_like(hidden)
    return (
        grad_hidden,
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(bias.dtype),
    )


def _rows_of(grad: torch.Tensor | None, rows: slice, num_terms: int) -> torch.Tensor | None:
    return None if grad is None else grad[rows]


def _renormaliser(
    raw: torch.Tensor, lse: torch.Tensor, candidates: torch.Tensor, has: torch.Tensor, math
) -> torch.Tensor:
    """[m] logsumexp over S_t for renormalising terms, over the vocabulary otherwise."""
    if candidates.shape[1] == 0:
        return lse
    candidate_logits = transform(raw.gather(1, candidates.clamp(min=0)), math).masked_fill(
        candidates < 0, float("-inf")
    )
    return torch.where(has, torch.logsumexp(candidate_logits, dim=-1), lse)


def _outside(ids: torch.Tensor, candidates: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """[m, K] True where an id lies outside S_t on a renormalising term (candidates ascending: a binary search)."""
    if candidates.shape[1] == 0:
        return torch.zeros_like(ids, dtype=torch.bool)
    position = torch.searchsorted(candidates, ids.contiguous()).clamp(max=candidates.shape[1] - 1)
    inside = (candidates.gather(1, position) == ids) & (ids >= 0)
    return has[:, None] & ~inside


def _invalid_extra(extra: torch.Tensor, candidates: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """[m, K] True where an extra id gets -inf: a -1 pad, or outside S_t on a renormalising term."""
    return (extra < 0) | _outside(extra, candidates, has)


def _chunk_grad_logits(
    raw,
    math,
    compile_kernels,
    targets,
    extra,
    candidates,
    has,
    log_norm,
    log_norm_target,
    mean_logit,
    grad_logprobs,
    grad_entropy,
    grad_extra,
    dynamic="rows",
) -> torch.Tensor:
    """d loss / d raw logits ([m, V], in the logits' dtype) for one chunk: one dense pass, then the sparse ids."""
    dtype = log_norm.dtype
    weight_of_norm = torch.zeros_like(log_norm)  # Σ of the incoming grads of the terms normalised by `norm`
    ids, values = [], []
    if grad_logprobs is not None:
        grad_logprobs = grad_logprobs.to(dtype).masked_fill(_outside(targets[:, None], candidates, has).squeeze(1), 0.0)
        weight_of_norm += grad_logprobs
        ids.append(targets[:, None])
        values.append(grad_logprobs[:, None])
    if grad_extra is not None:
        grad_extra = grad_extra.to(dtype).masked_fill(_invalid_extra(extra, candidates, has), 0.0)
        weight_of_norm += grad_extra.sum(-1)
        ids.append(extra.clamp(min=0))
        values.append(grad_extra)
    if candidates.shape[1] and ids:
        # renormalising terms: d norm / dz = softmax over S_t, sparse at the candidates
        logits = transform(raw.gather(1, candidates.clamp(min=0)), math)
        candidate_probs = torch.exp(logits - log_norm_target[:, None]).masked_fill(candidates < 0, 0.0)
        ids.append(candidates.clamp(min=0))
        values.append(-(weight_of_norm * has)[:, None] * candidate_probs)
    coef = -weight_of_norm.masked_fill(has, 0.0)
    grad_entropy = None if grad_entropy is None else grad_entropy.to(dtype)
    dense = fused("dense_grad", compile_kernels, dynamic)(raw, log_norm, mean_logit, coef, grad_entropy, math)
    if ids:
        sparse_fixup(
            dense, raw, torch.cat(ids, 1), torch.cat(values, 1), log_norm, mean_logit, coef, grad_entropy, math
        )
    return dense
