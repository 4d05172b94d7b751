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

Memory: a custom autograd.Function keeps only the inputs and two [M] statistics; backward recomputes each chunk's
logits, so gradients w.r.t. the hidden states, the weight (and bias) are exact and at most one chunk's [m, V]
buffers exist at a time. Logits are computed in the weight's dtype (like the model's own lm_head) and reduced in
float32 (float64 inputs stay float64, for exact checks).

Shape legend: M loss terms, H hidden size, V vocabulary, K extra ids per term, C candidate ids per term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 27  # default chunk: about 2^27 logits (512 MiB in float32) per [m, V] buffer; fewer,
# larger chunks cut launches and the float32 accumulations of the head weight gradient


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
    def from_config(cls, config: Any) -> LogitTransform:
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
    return max(1, min(4096, CHUNK_ELEMENTS // max(1, vocab_size)))


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
) -> TokenScores:
    """Score M terms: hidden [M, H], weight [V, H], target_ids [M]; extra_ids [M, K] and candidate_ids [M, C]
    (-1 padded) with has_candidates [M] bool (None = every row that lists a candidate). See the module docstring."""
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [M, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    num_terms = hidden.shape[0]
    if target_ids.shape != (num_terms,):
        raise ValueError(f"target_ids must be [{num_terms}], got {tuple(target_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    transform = transform or LogitTransform()
    device = hidden.device
    extra = _ids_or_empty(extra_ids, num_terms, device, "extra_ids")
    candidates, has = _prepare_candidates(candidate_ids, has_candidates, num_terms, device)
    chunk = int(chunk_size) if chunk_size else default_chunk_size(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    config = _HeadConfig(float(temperature), float(transform.scale), transform.softcap, chunk)
    logprobs, entropy, extra_logprobs = _ChunkedHead.apply(
        hidden, weight, bias, target_ids.long(), extra, candidates, has, config
    )
    return TokenScores(logprobs, entropy, extra_logprobs if extra_ids is not None else None)


@dataclass(frozen=True)
class _HeadConfig:
    temperature: float
    scale: float
    softcap: float | None
    chunk_size: int


def _ids_or_empty(ids: torch.Tensor | None, num_terms: int, device: torch.device, name: str) -> torch.Tensor:
    if ids is None:
        return torch.empty(num_terms, 0, dtype=torch.long, device=device)
    if ids.ndim != 2 or ids.shape[0] != num_terms:
        raise ValueError(f"{name} must be [{num_terms}, K], got {tuple(ids.shape)}")
    return ids.long()


def _prepare_candidates(
    candidate_ids: torch.Tensor | None, has_candidates: torch.Tensor | None, num_terms: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted candidates with -1 at pads and repeated ids ([M, C]); `has` false where a row lists none ([M])."""
    candidates = _ids_or_empty(candidate_ids, num_terms, device, "candidate_ids")
    if candidates.shape[1] == 0:
        return candidates, torch.zeros(num_terms, dtype=torch.bool, device=device)
    candidates = torch.sort(candidates, dim=1).values
    repeated = torch.zeros_like(candidates, dtype=torch.bool)
    repeated[:, 1:] = candidates[:, 1:] == candidates[:, :-1]
    candidates = candidates.masked_fill(repeated | (candidates < 0), -1)
    has = (candidates >= 0).any(dim=1)
    if has_candidates is not None:
        if has_candidates.shape != (num_terms,):
            raise ValueError(f"has_candidates must be [{num_terms}], got {tuple(has_candidates.shape)}")
        has = has & has_candidates.to(device=device, dtype=torch.bool)
    return candidates, has


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: _HeadConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Post-processed float32 logits [m, V] and, with a softcap, tanh(scaled / cap) for the backward."""
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if config.scale != 1.0:
        logits = logits * config.scale
    tanh = None
    if config.softcap is not None:
        tanh = torch.tanh(logits / config.softcap)
        logits = tanh * config.softcap
    if config.temperature != 1.0:
        logits = logits / config.temperature
    return logits, tanh


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, extra, candidates, has, config: _HeadConfig):
        num_terms = hidden.shape[0]
        device = hidden.device
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for exact checks
        logprobs = torch.empty(num_terms, dtype=dtype, device=device)
        entropy = torch.empty_like(logprobs)
        extra_logprobs = torch.empty(extra.shape, dtype=dtype, device=device)
        log_norm = torch.empty_like(logprobs)  # logsumexp over the vocabulary
        log_norm_target = torch.empty_like(logprobs)  # ... or over S_t where the term renormalises
        with torch.no_grad():
            for start in range(0, num_terms, config.chunk_size):
                rows = slice(start, min(start + config.chunk_size, num_terms))
                logits, _ = _chunk_logits(hidden[rows], weight, bias, config)
                lse = torch.logsumexp(logits, dim=-1)
                probs = torch.exp(logits - lse[:, None])
                entropy[rows] = lse - (probs * logits).sum(-1)
                del probs
                norm = _renormaliser(logits, lse, candidates[rows], has[rows])
                values = logits.gather(1, targets[rows, None]).squeeze(1) - norm
                outside = _outside(targets[rows, None], candidates[rows], has[rows]).squeeze(1)
                logprobs[rows] = values.masked_fill(outside, float("-inf"))
                if extra.shape[1]:
                    values = logits.gather(1, extra[rows].clamp(min=0)) - norm[:, None]
                    invalid = _invalid_extra(extra[rows], candidates[rows], has[rows])
                    extra_logprobs[rows] = values.masked_fill(invalid, float("-inf"))
                log_norm[rows] = lse
                log_norm_target[rows] = norm
        ctx.save_for_backward(hidden, weight, bias, targets, extra, candidates, has, log_norm, log_norm_target)
        ctx.config = config
        device_type = hidden.device.type  # backward runs outside autocast: it re-enters the forward's state
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.set_materialize_grads(False)
        return logprobs, entropy, extra_logprobs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, grad_extra):
        hidden, weight, bias, targets, extra, candidates, has, log_norm, log_norm_target = ctx.saved_tensors
        config: _HeadConfig = ctx.config
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=accumulate, device=bias.device) if needs_bias else None
        if grad_extra is not None and extra.shape[1] == 0:
            grad_extra = None
        device_type, autocast_on, autocast_dtype = ctx.autocast
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
            _head_backward(hidden, weight, bias, targets, extra, candidates, has, log_norm, log_norm_target, config,
                           grad_logprobs, grad_entropy, grad_extra, grad_hidden, grad_weight, grad_bias)  # fmt: skip
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def _head_backward(hidden, weight, bias, targets, extra, candidates, has, log_norm, log_norm_target, config,
                   grad_logprobs, grad_entropy, grad_extra, grad_hidden, grad_weight, grad_bias) -> None:  # fmt: skip
    """Chunk by chunk: accumulate the head's gradients into grad_hidden / grad_weight / grad_bias (float32 or wider
    accumulators; under autocast the matmuls run in its dtype)."""
    num_terms = hidden.shape[0]
    for start in range(0, num_terms, config.chunk_size):
        rows = slice(start, min(start + config.chunk_size, num_terms))
        grad_logits = _chunk_grad_logits(
            hidden[rows], weight, bias, config, targets[rows], extra[rows], candidates[rows], has[rows],
            log_norm[rows], log_norm_target[rows],
            None if grad_logprobs is None else grad_logprobs[rows],
            None if grad_entropy is None else grad_entropy[rows],
            None if grad_extra is None else grad_extra[rows],
        )  # fmt: skip
        grad_logits = grad_logits.to(weight.dtype)
        if grad_hidden is not None:
            grad_hidden[rows] = grad_logits @ weight
        if grad_weight is not None:
            grad_weight += grad_logits.t() @ hidden[rows].to(weight.dtype)
        if grad_bias is not None:
            grad_bias += grad_logits.sum(0)


def _renormaliser(logits: torch.Tensor, lse: torch.Tensor, candidates: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """[m] logsumexp over S_t for renormalising terms, over the vocabulary otherwise."""
    if candidates.shape[1] == 0:
        return lse
    candidate_logits = logits.gather(1, candidates.clamp(min=0)).masked_fill(candidates < 0, float("-inf"))
    return torch.where(has, torch.logsumexp(candidate_logits, dim=-1), lse)


def _outside(ids: torch.Tensor, candidates: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """[m, K] True where an id lies outside S_t on a renormalising term."""
    if candidates.shape[1] == 0:
        return torch.zeros_like(ids, dtype=torch.bool)
    inside = (ids[:, :, None] == candidates[:, None, :]).any(-1)
    return has[:, None] & ~inside


def _invalid_extra(extra: torch.Tensor, candidates: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """[m, K] True where an extra id gets -inf: a -1 pad, or outside S_t on a renormalising term."""
    return (extra < 0) | _outside(extra, candidates, has)


def _chunk_grad_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: _HeadConfig,
    targets: torch.Tensor,
    extra: torch.Tensor,
    candidates: torch.Tensor,
    has: torch.Tensor,
    log_norm: torch.Tensor,
    log_norm_target: torch.Tensor,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    grad_extra: torch.Tensor | None,
) -> torch.Tensor:
    """d loss / d raw logits ([m, V], float32 or float64) for one chunk, recomputing its logits."""
    with torch.no_grad():
        logits, tanh = _chunk_logits(hidden, weight, bias, config)
        probs = torch.exp(logits - log_norm[:, None])  # full-vocabulary softmax
        grad = torch.zeros_like(logits)
        # log-prob terms: d(z[v] - norm)/dz = onehot(v) - softmax under the norm (vocabulary or S_t)
        weight_of_norm = torch.zeros_like(log_norm)
        if grad_logprobs is not None:
            grad_logprobs = grad_logprobs.masked_fill(_outside(targets[:, None], candidates, has).squeeze(1), 0.0)
            weight_of_norm += grad_logprobs
            grad.scatter_add_(1, targets[:, None], grad_logprobs[:, None])
        if grad_extra is not None:
            grad_extra = grad_extra.masked_fill(_invalid_extra(extra, candidates, has), 0.0)
            weight_of_norm += grad_extra.sum(-1)
            grad.scatter_add_(1, extra.clamp(min=0), grad_extra)
        if candidates.shape[1]:
            candidate_probs = torch.exp(
                logits.gather(1, candidates.clamp(min=0)) - log_norm_target[:, None]
            ).masked_fill(candidates < 0, 0.0)
            renormalised = torch.zeros_like(logits).scatter_add_(1, candidates.clamp(min=0), candidate_probs)
            grad -= weight_of_norm[:, None] * torch.where(has[:, None], renormalised, probs)
        else:
            grad -= weight_of_norm[:, None] * probs
        # entropy: dH/dz[v] = -p[v] (z[v] - E_p[z])
        if grad_entropy is not None:
            mean_logit = (probs * logits).sum(-1, keepdim=True)
            grad -= grad_entropy[:, None] * probs * (logits - mean_logit)
        # back through / temperature, softcap and scale
        if config.temperature != 1.0:
            grad = grad / config.temperature
        if tanh is not None:
            grad = grad * (1.0 - tanh * tanh)
        if config.scale != 1.0:
            grad = grad * config.scale
    return grad
