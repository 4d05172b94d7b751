"""On-policy distillation loss: generalised JSD between the student and a teacher's sparse top-k (docs/algorithms.md §9.3, §8.4).

Shapes (N positions with teacher signal on this rank, H hidden size, V vocabulary, W support width: K+1 for β = 0,
2 for 0 < β < 1, 1 for β = 1; T teachers):

  hidden            [N, H]  the student's hidden states at the trained positions (position j predicts token j+1)
  head_weight       [V, H]  LM head weight (head_bias [V] or None)
  support_ids       [N, W]  long, candidate token ids (-1 = no candidate)
  teacher_lp        [N, W]  the teacher's log-probs of those ids (at `teacher_temperature`, computed server-side)
  valid             [N, W]  bool, which slots carry a teacher log-prob
  teacher_index     [N]     long, index of the teacher that scored each position (MOPD only)

Per chunk of positions (docs/algorithms.md §9.3 "Chunked LM head"):

    z = h·Wᵀ (+ b) in fp32  ->  z · logit_scale  ->  s·tanh(z / s) (softcap)  ->  z / τ
    log S = log_softmax(z) over the full vocabulary
    s_lp = log S at the support ids, t_lp = teacher log-probs (both −inf outside `valid`)
    add_tail_bucket: append log(1 − Σ_support p) (as log(−expm1(min(logsumexp, −1e−7)))) to both sides
    else:            renormalise both over the valid support
    D = generalized_jsd(s_lp, t_lp, β, mask), loss = Σ D

Each chunk runs under non-reentrant activation checkpointing, so only one chunk's [c, V] logits live at a time
(they are recomputed in backward; `torch.utils.checkpoint` re-enters the forward's autocast state itself).

Statistics (no grad, float64, fixed size `4 + 3·T` so that every rank all-reduces the same tensor):
  [jsd_sum, entropy_sum, teacher_entropy_sum, count, tokens[T], jsd_sum[T], teacher_entropy_sum[T]]
with the per-teacher slots filled only under MOPD (`num_teachers > 1` and a `teacher_index`); `count` counts the
positions with at least one valid slot. `distillation_metrics` turns the reduced tensor into docs/algorithms.md §8.4's metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rlasync.losses.normalize import Metrics, normalize_loss

if TYPE_CHECKING:
    from rlasync.config import AsyncDistillationConfig

#: Default number of positions per LM-head chunk (peak logits memory CHUNK_SIZE × V).
CHUNK_SIZE = 256
#: Upper clamp of the support's log-mass before the tail bucket: keeps the tail mass strictly positive.
TAIL_LOG_MASS_MAX = -1e-7

# Layout of the statistics tensor.
STAT_JSD, STAT_ENTROPY, STAT_TEACHER_ENTROPY, STAT_COUNT = 0, 1, 2, 3
NUM_GLOBAL_STATS = 4


def num_stats(num_teachers: int = 1) -> int:
    """Length of the statistics tensor for `num_teachers` teachers (4 + 3·T)."""
    return NUM_GLOBAL_STATS + 3 * num_teachers


@dataclass(frozen=True)
class DistillLossConfig:
    """Settings of the distillation loss (TRL field names in `from_config`)."""

    beta: float = 0.0
    teacher_temperature: float = 1.0
    add_tail_bucket: bool = True
    chunk_size: int = CHUNK_SIZE

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0.0, 1.0], got {self.beta}.")
        if not self.teacher_temperature > 0:
            raise ValueError(f"teacher_temperature must be > 0, got {self.teacher_temperature}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")

    @classmethod
    def from_config(cls, config: AsyncDistillationConfig) -> DistillLossConfig:
        """The loss fields of an `AsyncDistillationConfig`."""
        return cls(
            beta=config.beta, teacher_temperature=config.teacher_temperature, add_tail_bucket=config.add_tail_bucket
        )


# ---------------------------------------------------------------------------------------------------------------
# Support selection
# ---------------------------------------------------------------------------------------------------------------


def narrow_support(
    teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, actual_ids: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(support ids, teacher log-probs, valid) for `beta` (docs/algorithms.md §9.3 "Narrowed support for β ≠ 0").

    teacher_ids / teacher_logprobs [N, K+1] (-1 / -inf padded, rank order: slot 0 is the teacher's top-1),
    actual_ids [N] the realised next tokens.
      β = 0:      the full K+1 support, valid where the id is not -1.
      β = 1:      [actual] with the teacher's log-prob of it (valid iff the teacher reported it).
      0 < β < 1:  [top-1, actual]; the second slot is invalid when actual is missing or equals the top-1.
    """
    valid_wide = teacher_ids != -1
    if beta == 0:
        return teacher_ids, teacher_logprobs, valid_wide
    actual = actual_ids.to(teacher_ids.dtype)
    match = (teacher_ids == actual[:, None]) & valid_wide
    has_actual = match.any(-1)
    actual_lp = torch.where(match, teacher_logprobs, torch.full_like(teacher_logprobs, -math.inf)).amax(-1)
    if beta == 1:
        return actual[:, None], actual_lp[:, None], has_actual[:, None]
    top1 = teacher_ids[:, 0]
    ids = torch.stack([top1, actual], dim=1)
    lps = torch.stack([teacher_logprobs[:, 0], actual_lp], dim=1)
    valid = torch.stack([valid_wide[:, 0], has_actual & (top1 != actual)], dim=1)
    return ids, lps, valid


# ---------------------------------------------------------------------------------------------------------------
# Divergence on a masked support
# ---------------------------------------------------------------------------------------------------------------


def _p_log_ratio(p: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """p · (log p − log q), 0 where p = 0 (the 0·log 0 limit; also keeps gradients finite)."""
    positive = p > 0
    log_p = torch.where(positive, log_p, torch.zeros_like(log_p))
    return torch.where(positive, p * (log_p - log_q), torch.zeros_like(p))


def generalized_jsd(
    student_lp: torch.Tensor, teacher_lp: torch.Tensor, beta: float, mask: torch.Tensor
) -> torch.Tensor:
    """Per-slot generalised JSD terms (same shape as the inputs), 0 outside `mask`, `nan_to_num(·, 0)`.

    β = 0: P_T (log P_T − log P_S) (forward KL(T‖S)); β = 1: P_S (log P_S − log P_T) (reverse KL(S‖T));
    else with M = (1−β) P_S + β P_T, log M = log(max(M, tiny)):
    β · P_T (log P_T − log M) + (1−β) · P_S (log P_S − log M).
    Single slots can be negative; the sum over a position's support is ≥ 0.
    """
    zero = torch.zeros((), dtype=student_lp.dtype, device=student_lp.device)
    s = torch.where(mask, student_lp, zero)  # outside the mask: harmless finite values, no gradient
    t = torch.where(mask, teacher_lp.to(student_lp.dtype), zero)
    p_s, p_t = s.exp(), t.exp()
    if beta == 0:
        terms = _p_log_ratio(p_t, t, s)
    elif beta == 1:
        terms = _p_log_ratio(p_s, s, t)
    else:
        mixture = (1 - beta) * p_s + beta * p_t
        log_m = mixture.clamp_min(torch.finfo(mixture.dtype).tiny).log()
        terms = beta * _p_log_ratio(p_t, t, log_m) + (1 - beta) * _p_log_ratio(p_s, s, log_m)
    terms = torch.nan_to_num(terms, nan=0.0)
    return torch.where(mask, terms, zero)


def _masked_logsumexp(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp over the masked entries of each row [..], whether the row has any); −inf for an empty row,
    without NaN gradients."""
    has_any = mask.any(-1)
    x = torch.where(mask, x, torch.full_like(x, -math.inf))
    x = torch.where(has_any[..., None], x, torch.zeros_like(x))
    lse = torch.logsumexp(x, dim=-1)
    return torch.where(has_any, lse, torch.full_like(lse, -math.inf)), has_any


def add_tail_bucket(logprobs: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append the leftover-mass element: Λ = min(logsumexp(x), −1e−7), tail = log(−expm1(Λ)).

    logprobs [.., W] (entries outside `valid` are ignored), valid [.., W] -> ([.., W+1], mask [.., W+1]).
    """
    lse, _ = _masked_logsumexp(logprobs, valid)
    tail = torch.log(-torch.expm1(lse.clamp_max(TAIL_LOG_MASS_MAX)))
    masked = torch.where(valid, logprobs, torch.full_like(logprobs, -math.inf))
    support_mask = torch.cat([valid, torch.ones_like(valid[..., :1])], dim=-1)
    return torch.cat([masked, tail[..., None]], dim=-1), support_mask


def renormalize(logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """x − logsumexp(x) over the valid support (−inf outside it)."""
    lse, has_any = _masked_logsumexp(logprobs, valid)
    lse = torch.where(has_any, lse, torch.zeros_like(lse))
    return torch.where(valid, logprobs - lse[..., None], torch.full_like(logprobs, -math.inf))


def support_divergence(
    student_lp: torch.Tensor, teacher_lp: torch.Tensor, valid: torch.Tensor, beta: float, tail_bucket: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tail bucket (or renormalisation) on both sides, then per-slot D.

    Returns (D [.., W'], the teacher's log-probs on the final support [.., W'], the final mask [.., W']) with
    W' = W + 1 under the tail bucket, else W."""
    teacher_lp = teacher_lp.to(student_lp.dtype)
    if tail_bucket:
        s_lp, mask = add_tail_bucket(student_lp, valid)
        t_lp, _ = add_tail_bucket(teacher_lp, valid)
    else:
        s_lp, t_lp, mask = renormalize(student_lp, valid), renormalize(teacher_lp, valid), valid
    return generalized_jsd(s_lp, t_lp, beta, mask), t_lp, mask


def _teacher_entropy(t_lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """−Σ_support P_T log P_T per position (0·log 0 = 0)."""
    p = t_lp.exp()
    keep = mask & (p > 0)
    return -torch.where(keep, p * torch.where(keep, t_lp, torch.zeros_like(t_lp)), torch.zeros_like(p)).sum(-1)


# ---------------------------------------------------------------------------------------------------------------
# Chunked loss over hidden states
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ChunkSpec:
    beta: float
    temperature: float
    tail_bucket: bool
    logit_scale: float
    softcap: float | None
    num_teachers: int


def _student_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: _ChunkSpec
) -> torch.Tensor:
    """[c, V] post-processed logits in float32 (float64 inputs stay float64)."""
    z = F.linear(hidden, weight, bias)
    z = z.to(torch.promote_types(hidden.dtype, torch.float32))
    if spec.logit_scale != 1.0:
        z = z * spec.logit_scale
    if spec.softcap is not None:
        z = spec.softcap * torch.tanh(z / spec.softcap)
    if spec.temperature != 1.0:
        z = z / spec.temperature
    return z


def _chunk_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    teacher_lp: torch.Tensor,
    valid: torch.Tensor,
    teacher_index: torch.Tensor | None,
    spec: _ChunkSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ D over the chunk, its statistics tensor) — the function each checkpointed chunk runs."""
    log_probs = torch.log_softmax(_student_logits(hidden, weight, bias, spec), dim=-1)
    gathered = log_probs.gather(1, ids.clamp(min=0))
    s_lp = torch.where(valid, gathered, torch.full_like(gathered, -math.inf))
    t_lp = torch.where(valid, teacher_lp.to(s_lp.dtype), torch.full_like(s_lp, -math.inf))
    terms, t_sup, mask = support_divergence(s_lp, t_lp, valid, spec.beta, spec.tail_bucket)
    per_position = terms.sum(-1)
    with torch.no_grad():
        has = valid.any(-1)
        weight_pos = has.to(torch.float64)
        entropy = -(log_probs.exp() * log_probs).sum(-1).to(torch.float64)
        teacher_entropy = _teacher_entropy(t_sup, mask).to(torch.float64)
        jsd = per_position.detach().to(torch.float64)
        stats = torch.zeros(num_stats(spec.num_teachers), dtype=torch.float64, device=hidden.device)
        stats[STAT_JSD] = (jsd * weight_pos).sum()
        stats[STAT_ENTROPY] = (entropy * weight_pos).sum()
        stats[STAT_TEACHER_ENTROPY] = (teacher_entropy * weight_pos).sum()
        stats[STAT_COUNT] = weight_pos.sum()
        if teacher_index is not None and spec.num_teachers > 1:
            t = spec.num_teachers
            routed = has & (teacher_index >= 0) & (teacher_index < t)
            index = teacher_index.clamp(0, t - 1)
            w = routed.to(torch.float64)
            base = NUM_GLOBAL_STATS
            stats[base : base + t] = torch.zeros(t, dtype=torch.float64, device=hidden.device).index_add_(0, index, w)
            stats[base + t : base + 2 * t] = torch.zeros_like(stats[:t]).index_add_(0, index, jsd * w)
            stats[base + 2 * t :] = torch.zeros_like(stats[:t]).index_add_(0, index, teacher_entropy * w)
    return per_position.sum(), stats


def distillation_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    head_bias: torch.Tensor | None,
    support_ids: torch.Tensor,
    teacher_lp: torch.Tensor,
    valid: torch.Tensor,
    beta: float,
    teacher_temperature: float,
    add_tail_bucket: bool,
    chunk_size: int = CHUNK_SIZE,
    teacher_index: torch.Tensor | None = None,
    num_teachers: int = 1,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over positions and support of D — differentiable, 0-d —, statistics [4 + 3·T] float64, detached).

    See the module docstring. Positions without any valid slot contribute 0 and are not counted.
    """
    if hidden.ndim != 2 or head_weight.ndim != 2 or hidden.shape[1] != head_weight.shape[1]:
        raise ValueError(
            f"expected hidden [N, H] and head_weight [V, H], got {tuple(hidden.shape)} and {tuple(head_weight.shape)}"
        )
    n = hidden.shape[0]
    for name, value in (("support_ids", support_ids), ("teacher_lp", teacher_lp), ("valid", valid)):
        if value.ndim != 2 or value.shape[0] != n or value.shape != support_ids.shape:
            raise ValueError(f"{name} must be [N={n}, W] like support_ids, got {tuple(value.shape)}")
    if teacher_index is not None and teacher_index.shape != (n,):
        raise ValueError(f"teacher_index must be [{n}], got {tuple(teacher_index.shape)}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0.0, 1.0], got {beta}.")
    if not teacher_temperature > 0:
        raise ValueError(f"teacher_temperature must be > 0, got {teacher_temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if num_teachers < 1:
        raise ValueError(f"num_teachers must be >= 1, got {num_teachers}")
    spec = _ChunkSpec(
        float(beta),
        float(teacher_temperature),
        bool(add_tail_bucket),
        float(logit_scale),
        None if softcap is None else float(softcap),
        int(num_teachers),
    )
    support_ids, valid = support_ids.long(), valid.bool()
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    loss = torch.zeros((), dtype=dtype, device=hidden.device)
    stats = torch.zeros(num_stats(num_teachers), dtype=torch.float64, device=hidden.device)
    for start in range(0, n, chunk_size):
        rows = slice(start, min(start + chunk_size, n))
        chunk_teacher = None if teacher_index is None else teacher_index[rows].long()
        chunk_loss, chunk_stats = checkpoint(
            _chunk_loss,
            hidden[rows],
            head_weight,
            head_bias,
            support_ids[rows],
            teacher_lp[rows],
            valid[rows],
            chunk_teacher,
            spec,
            use_reentrant=False,
        )
        loss = loss + chunk_loss
        stats += chunk_stats
    return loss, stats


# ---------------------------------------------------------------------------------------------------------------
# One packed row: next-token shift, zero-signal edge case, normaliser
# ---------------------------------------------------------------------------------------------------------------


def distillation_row_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    head_bias: torch.Tensor | None,
    input_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    *,
    config: DistillLossConfig,
    global_n_tokens: float,
    num_processes: int = 1,
    grad_accum_steps: int = 1,
    teacher_id_idx: torch.Tensor | None = None,
    num_teachers: int = 1,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's normalised loss of one packed row (padding stripped) and its statistics (docs/algorithms.md §9.3).

    hidden [L, H] (the backbone's output for every position of the row), input_ids / completion_mask [L],
    teacher_topk_ids / teacher_topk_logprobs [L, K+1] (row j = the teacher's distribution for token j),
    teacher_id_idx [L] (MOPD only). Hidden position j predicts token j+1 and is compared with teacher row j+1;
    it is trained when completion_mask[j+1] and the teacher sent a usable candidate there. With no such
    position the loss is 0·(Σ hidden + Σ weight [+ Σ bias]) so that every parameter still gets a gradient.
    The summed divergence is divided by max(global_n_tokens / P, 1) / GA (`normalize_loss`).
    """
    length = input_ids.shape[0]
    if hidden.ndim != 2 or hidden.shape[0] != length:
        raise ValueError(f"hidden must be [L={length}, H], got {tuple(hidden.shape)}")
    for name, value in (("teacher_topk_ids", teacher_topk_ids), ("teacher_topk_logprobs", teacher_topk_logprobs)):
        if value.ndim != 2 or value.shape[0] != length:
            raise ValueError(f"{name} must be [L={length}, K+1], got {tuple(value.shape)}")
    if completion_mask.shape != (length,):
        raise ValueError(f"completion_mask must be [{length}], got {tuple(completion_mask.shape)}")
    cmask = completion_mask[1:].bool()
    t_ids, t_lps = teacher_topk_ids[1:].long(), teacher_topk_logprobs[1:]
    actual = input_ids[1:].long()
    ids, lps, valid = narrow_support(t_ids, t_lps, actual, config.beta)
    use = cmask & valid.any(-1)
    if not bool(use.any()):
        anchor = hidden.sum() + head_weight.sum()
        if head_bias is not None:
            anchor = anchor + head_bias.sum()
        return 0.0 * anchor, torch.zeros(num_stats(num_teachers), dtype=torch.float64, device=hidden.device)
    tid = None
    if teacher_id_idx is not None and num_teachers > 1:
        tid = teacher_id_idx[1:][use]
    loss_sum, stats = distillation_loss(
        hidden[:-1][use],
        head_weight,
        head_bias,
        ids[use],
        lps[use],
        valid[use],
        beta=config.beta,
        teacher_temperature=config.teacher_temperature,
        add_tail_bucket=config.add_tail_bucket,
        chunk_size=config.chunk_size,
        teacher_index=tid,
        num_teachers=num_teachers,
        logit_scale=logit_scale,
        softcap=softcap,
    )
    return normalize_loss(loss_sum, global_n_tokens, num_processes, grad_accum_steps), stats


# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------


def distillation_metrics(stats: torch.Tensor | Sequence[float], teacher_names: Sequence[str] = ()) -> Metrics:
    """docs/algorithms.md §8.4 metrics from the (all-reduced) statistics tensor.

    `jsd`, `entropy`, `teacher_entropy`: means over the counted positions (NaN when the count is 0, which the
    metric reducer drops). With more than one teacher name (MOPD), per teacher `<id>` in dict order:
    `teacher_token_frac/<id>` as a (tokens, count) rate pair (a real 0 when the teacher scored nothing),
    `teacher_jsd/<id>` and `teacher_entropy/<id>` (NaN when the teacher had no tokens).
    """
    values = stats.detach().to(torch.float64).cpu().tolist() if isinstance(stats, torch.Tensor) else list(stats)
    count = values[STAT_COUNT]
    metrics: Metrics = {
        "jsd": _mean(values[STAT_JSD], count),
        "entropy": _mean(values[STAT_ENTROPY], count),
        "teacher_entropy": _mean(values[STAT_TEACHER_ENTROPY], count),
    }
    names = list(teacher_names)
    if len(names) > 1:
        t = len(names)
        if len(values) != num_stats(t):
            raise ValueError(f"statistics of length {len(values)} do not match {t} teachers ({num_stats(t)} expected)")
        base = NUM_GLOBAL_STATS
        for i, name in enumerate(names):
            tokens = values[base + i]
            metrics[f"teacher_token_frac/{name}"] = (tokens, count)
            metrics[f"teacher_jsd/{name}"] = _mean(values[base + t + i], tokens)
            metrics[f"teacher_entropy/{name}"] = _mean(values[base + 2 * t + i], tokens)
    return metrics


def _mean(total: float, count: float) -> float:
    return total / count if count > 0 else math.nan


__all__ = [
    "CHUNK_SIZE",
    "DistillLossConfig",
    "add_tail_bucket",
    "distillation_loss",
    "distillation_metrics",
    "distillation_row_loss",
    "generalized_jsd",
    "narrow_support",
    "num_stats",
    "renormalize",
    "support_divergence",
]
