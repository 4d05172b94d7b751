"""Batched sampler of the built-in generation engine (torch; CPU and CUDA; one code path for a mixed batch).

    batch = BatchSampling.from_params(params, seeds, device)     # once per engine step
    result = sample(logits, batch, steps, seen_tokens=seen)      # [B, V] raw logits -> one token per row

Processing (vLLM's order, `SamplingParams`): repetition penalty on the raw logits (for tokens seen in the prompt or
the output so far: positive logits divided by the penalty, others multiplied), then temperature, then top-k, top-p,
min-p. Every step is computed in float32 on the processed logits `x = penalised / T`; the processed log-probs are
`x - logsumexp(x over S)` on the candidate set `S` and -inf outside it (`processed_logprobs`).

Decisions, fixed here once for all engines built on this module:

* Order of tokens. Wherever a rule needs "the highest" tokens, tokens are ranked by (processed logit descending,
  token id ascending). Ties at the top-k boundary therefore keep exactly k tokens, the lowest ids among the tied
  ones; the same rule orders top-p's cumulative sum and the reported top-N.
* top-k: the k highest tokens (k clamped to the vocabulary; 0 or -1 = off).
* top-p: over the top-k-filtered distribution, keep the smallest prefix of the ranked tokens whose cumulative
  probability reaches top_p: token at rank r is kept iff the mass of ranks < r is < top_p (the first is always
  kept). top_p = 1 keeps everything. The cumulative sum runs on integers: each unnormalised probability
  `exp(x - x_max)` (float64, in (0, 1]) is quantised to `floor(. * 2**40)` and summed in int64, so the decision
  is exact, associativity-free and batch-invariant on every device (it is the exact rule up to 2**-40 of the top
  token's probability; tokens below that get no mass in the sum).
* min-p: keep tokens with `p >= min_p * p_max`, i.e. `exp(x - x_max) >= min_p` (float64); applied after top-p, but
  a ratio to the maximum commutes with the normalisation, so only the rule's place after top-p matters.
* Greedy rows (temperature 0) are processed at temperature 1: their token is the argmax of the penalised logits
  (first maximum = lowest id; the filters always keep it), their reported log-probs (sampled token, top-N) are of
  the penalised distribution at temperature 1 restricted by the row's own top-k/top-p/min-p, and their candidate
  set is reported when that row filters (exactly as for a sampled row at T = 1).
* Randomness is counter-based and per request: the token is `argmax_{v in S} x_v + G(seed, step, v)` with Gumbel
  noise `G = -log(-log u)` (Gumbel-max over the processed distribution: logsumexp is a per-row constant, so this
  is the argmax of `logp - log(-log u)`). The uniform comes from a SplitMix64 hash, computed in wrapped int64
  arithmetic (identical on CPU and CUDA; logical shifts are arithmetic shifts masked):

      mix64(z) = z ^= z >>> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >>> 27; z *= 0x94D049BB133111EB; z ^= z >>> 31
      key      = mix64(mix64(seed) ^ step)                       # per row
      h        = mix64(key + (token_id + 1) * 0x9E3779B97F4A7C15)  # = SplitMix64 stream of state `key`, output token_id
      u        = ((h >>> 12) + 0.5) / 2**52                      # exact in float64, strictly inside (0, 1)

  A row's token depends only on (seed, step, its logits, its params, its seen set): the noise is a function of
  token ids, and every decision uses elementwise float ops, exact max/top-k selection, integer counts and integer
  prefix sums, never a float reduction whose association depends on the batch. (The reported log-probs use a
  float logsumexp; they may differ in the last ulp with the batch, the token never does.)

Efficiency: top-k uses `torch.topk` (no sort); top-p sorts only inside the top-k window when every top-p row sets
top_k, else one full stable sort of the batch. The Gumbel noise is hashed only on the top-k window when every
sampled row sets top_k, else on the whole vocabulary (on CUDA in one fused Triton pass, `triton_sampling`). Host-side switches (which stages run, window widths) come from
the batch's params and never change a row's result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from rlasync.engine.base import SamplingParams

__all__ = ["BatchSampling", "SampleResult", "hash_uniform", "processed_logprobs", "sample"]


def _i64(value: int) -> int:
    """A 64-bit pattern as a signed int64 Python int (two's complement)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_TOPP_SCALE = 2.0**40  # fixed-point scale of top-p's integer cumulative sum
_NEG_INF = float("-inf")


def _lsr(z: Tensor, shift: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic): shift, then clear the sign-extended bits."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """SplitMix64's finaliser on wrapped int64 (the multiplications wrap modulo 2**64 on CPU and CUDA)."""
    z = (z ^ _lsr(z, 30)) * _MIX1
    z = (z ^ _lsr(z, 27)) * _MIX2
    return z ^ _lsr(z, 31)


def hash_keys(seeds: Tensor, steps: Tensor) -> Tensor:
    """[B] int64: each row's hash key mix64(mix64(seed) ^ step)."""
    return _mix64(_mix64(seeds.to(torch.int64)) ^ steps.to(torch.int64))


def hash_uniform(seeds: Tensor, steps: Tensor, token_ids: Tensor) -> Tensor:
    """u(seed, step, token) in (0, 1), float64, [B, W] for seeds/steps [B] and token_ids [B, W] (or [W]).

    Counter-based: the same (seed, step, token) gives the same u on every device and in every batch."""
    key = hash_keys(seeds, steps)
    h = _mix64(key[:, None] + (token_ids.to(torch.int64) + 1) * _GOLDEN)
    return (_lsr(h, 12).to(torch.float64) + 0.5) * (2.0**-52)


def gumbel_argmax_reference(x: Tensor, ids: Tensor, seeds: Tensor, steps: Tensor, vocab: int) -> Tensor:
    """[B] token ids: argmax over the window `ids` [B, W] of x - log(-log u(seed, step, id)), ties to the lowest id.

    The torch formulation (any device); on CUDA the whole-vocabulary case runs fused (`triton_sampling`)."""
    u = hash_uniform(seeds, steps, ids)
    score = x.to(torch.float64) - torch.log(-torch.log(u))
    best = score.max(dim=-1, keepdim=True).values
    # ties (measure zero, but float): lowest id wins, whatever the window's order
    return torch.where(score == best, ids, vocab).min(dim=-1).values


def _fused_gumbel_available() -> bool:
    from rlasync.engine import triton_sampling

    return triton_sampling.available()


class _Plan(NamedTuple):
    """Host-side summary of a batch's params: which stages run and how wide their windows are."""

    max_top_k: int  # max top_k over rows (0: no row uses top-k)
    any_top_p: bool
    full_sort: bool  # some row has top_p < 1 without top_k: top-p needs the whole vocabulary sorted
    any_min_p: bool
    any_penalty: bool
    any_greedy: bool
    any_random: bool
    random_all_top_k: bool  # every sampled (non-greedy) row sets top_k: noise only on the top-k window
    any_filters: bool

    @classmethod
    def of(cls, temperature, top_k, top_p, min_p, repetition_penalty) -> _Plan:
        rows = list(zip(temperature, top_k, top_p, min_p, repetition_penalty))
        return cls(
            max_top_k=max((int(k) for _, k, _, _, _ in rows), default=0),
            any_top_p=any(p < 1 for _, _, p, _, _ in rows),
            full_sort=any(p < 1 and k <= 0 for _, k, p, _, _ in rows),
            any_min_p=any(m > 0 for _, _, _, m, _ in rows),
            any_penalty=any(r != 1 for *_, r in rows),
            any_greedy=any(t <= 0 for t, *_ in rows),
            any_random=any(t > 0 for t, *_ in rows),
            random_all_top_k=all(k > 0 for t, k, *_ in rows if t > 0),
            any_filters=any(k > 0 or p < 1 or m > 0 for _, k, p, m, _ in rows),
        )


@dataclass(frozen=True)
class BatchSampling:
    """Per-row sampling tensors of one engine step, all [B] on one device."""

    temperature: Tensor  # [B] float32 (0 = greedy)
    top_k: Tensor  # [B] int64 (0 = off)
    top_p: Tensor  # [B] float32 (1 = off)
    min_p: Tensor  # [B] float32 (0 = off)
    repetition_penalty: Tensor  # [B] float32 (1 = off)
    seeds: Tensor  # [B] int64
    num_logprobs: int  # max N over the batch
    _plan: _Plan | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tensors = (self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty, self.seeds)
        b = self.temperature.shape
        if len(b) != 1 or any(t.shape != b for t in tensors):
            raise ValueError(
                f"BatchSampling: every field must be one [B] tensor, got {[tuple(t.shape) for t in tensors]}"
            )
        if len({t.device for t in tensors}) != 1:
            raise ValueError("BatchSampling: all tensors must be on one device")
        if self.num_logprobs < 0:
            raise ValueError(f"BatchSampling.num_logprobs={self.num_logprobs}: must be >= 0")

    @property
    def plan(self) -> _Plan:
        """Host-side switches of the batch (from `from_params`; else one small host copy of the params, cached)."""
        if self._plan is None:
            fields = (self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty)
            object.__setattr__(self, "_plan", _Plan.of(*(t.tolist() for t in fields)))
        return self._plan

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @property
    def device(self) -> torch.device:
        return self.temperature.device

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], seeds: Sequence[int], device: torch.device | str | None = None
    ) -> BatchSampling:
        if len(params) != len(seeds):
            raise ValueError(f"BatchSampling.from_params: {len(params)} params but {len(seeds)} seeds")
        temperature = [float(p.temperature) for p in params]
        top_k = [max(int(p.top_k), 0) for p in params]
        top_p = [float(p.top_p) for p in params]
        min_p = [float(p.min_p or 0.0) for p in params]
        penalty = [float(p.repetition_penalty) for p in params]

        # two host-to-device copies for the whole batch (one per dtype), not one per field: this runs every step
        floats = torch.tensor([temperature, top_p, min_p, penalty], dtype=torch.float32).to(device)
        ints = torch.tensor([top_k, [_i64(int(s)) for s in seeds]], dtype=torch.int64).to(device)
        return cls.from_packed(
            floats,
            ints,
            max((int(p.num_logprobs) for p in params), default=0),
            _Plan.of(temperature, top_k, top_p, min_p, penalty),
        )

    @classmethod
    def from_packed(cls, floats: Tensor, ints: Tensor, num_logprobs: int, plan: _Plan | None = None) -> BatchSampling:
        """A batch from its two packed device tensors: `floats` [4, B] float32 (temperature, top_p, min_p,
        repetition_penalty) and `ints` [2, B] int64 (top_k, seed), as `from_params` and the engine's per-slot
        sampling tensors (`rlasync.engine.slot_sampling`) lay them out; `plan` the host switches when known."""
        batch = cls(
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            min_p=floats[2],
            repetition_penalty=floats[3],
            seeds=ints[1],
            num_logprobs=num_logprobs,
        )
        if plan is not None:
            object.__setattr__(batch, "_plan", plan)
        return batch


@dataclass
class SampleResult:
    token_ids: Tensor  # [B] int64
    logprobs: Tensor  # [B] float32: processed log-prob of the sampled token (normalised over the candidate set)
    topn_ids: Tensor | None  # [B, N] int64 (-1 pad): top-N of the processed distribution, ranked
    topn_logprobs: Tensor | None  # [B, N] float32 (-inf pad)
    candidate_ids: Tensor | None  # [B, C] int64 (-1 pad): candidate sets of filtering rows, ascending; None: none
    num_candidates: Tensor | None  # [B] int64 (0 for rows that do not filter = whole vocabulary)


# ----------------------------------------------------------------------------------------------------------------------
# helpers


def _canonical(values: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Reorder a window [B, W] by (value descending, id ascending): sort by id, then stable-sort by value."""
    ids, order = ids.sort(dim=-1)
    values = values.gather(-1, order)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, order)


def _exact_topk_mask(x: Tensor, k: Tensor, width: int) -> Tensor:
    """[B, V] mask of exactly min(k_b, V) tokens per row, ranked by (value desc, id asc); k_b <= width.

    `topk` gives the k-th value (values are exact whatever the order of ties); tokens above it are in, and the tied
    ones are admitted by ascending id up to k, counted with an integer cumulative sum."""
    v = x.shape[-1]
    kth = x.topk(min(width, v), dim=-1, sorted=True).values.gather(-1, (k.clamp(1, min(width, v)) - 1)[:, None])
    above = x > kth
    tied = x == kth
    room = k[:, None] - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= room))


def _topk_window(x: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """The `width` highest entries of each row in canonical order (values [B, W], ids [B, W]).

    Only meaningful where the row has at most `width` finite entries or no ties at the window's edge (callers mask
    x to an exact set first); -inf fill comes last."""
    values, ids = x.topk(min(width, x.shape[-1]), dim=-1, sorted=False)
    return _canonical(values, ids)


class _Processed(NamedTuple):
    x: Tensor  # [B, V] float32 processed logits (penalised / T), before filtering
    mask: Tensor  # [B, V] bool candidate set (finite and kept by every filter)
    masked: Tensor  # [B, V] float32: x on the candidate set, -inf elsewhere


def checked_seen(logits: Tensor, batch: BatchSampling, seen_tokens: Tensor | None) -> Tensor | None:
    """Checks `logits` [B, V] against the batch; returns `seen_tokens` as bool [B, V], or None when no repetition
    penalty applies (the check shared by `sample` and `sampler_compiled.sample_compiled`)."""
    if logits.dim() != 2 or logits.shape[0] != batch.batch_size:
        raise ValueError(f"sampler: logits must be [B={batch.batch_size}, V], got {tuple(logits.shape)}")
    if seen_tokens is None or not batch.plan.any_penalty:
        return None
    if seen_tokens.shape != logits.shape:
        raise ValueError(f"sampler: seen_tokens {tuple(seen_tokens.shape)} must match logits {tuple(logits.shape)}")
    return seen_tokens.to(torch.bool)


def checked_steps(steps: Tensor, batch_size: int, device: torch.device) -> Tensor:
    """`steps` as int64 [B] on `device`, or a ValueError naming its shape."""
    steps = steps.to(device=device, dtype=torch.int64)
    if steps.shape != (batch_size,):
        raise ValueError(f"sampler: steps must be [{batch_size}], got {tuple(steps.shape)}")
    return steps


def _process(logits: Tensor, batch: BatchSampling, seen_tokens: Tensor | None) -> _Processed:
    seen = checked_seen(logits, batch, seen_tokens)
    plan = batch.plan
    x = logits.to(torch.float32)
    v = x.shape[-1]

    if seen is not None:
        pen = batch.repetition_penalty[:, None]
        x = torch.where(seen & (pen != 1), torch.where(x > 0, x / pen, x * pen), x)

    temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    x = x / temperature[:, None]

    mask = torch.isfinite(x)
    if plan.any_top_p or plan.any_min_p:
        x_max = x.max(dim=-1, keepdim=True).values.to(torch.float64)
    top_k = batch.top_k.clamp(0, v)
    k_mask = None
    if plan.max_top_k > 0:
        k_mask = _exact_topk_mask(x, torch.where(top_k > 0, top_k, v), plan.max_top_k) | (top_k == 0)[:, None]
        mask = mask & k_mask

    if plan.any_top_p:
        xk = x if k_mask is None else x.masked_fill(~k_mask, _NEG_INF)
        if plan.full_sort:
            sorted_x, sorted_ids = xk.sort(dim=-1, descending=True, stable=True)
        else:  # every top-p row has top_k: its whole top-k set lies in the window
            sorted_x, sorted_ids = _topk_window(xk, plan.max_top_k)
        q = torch.floor(torch.exp(sorted_x.to(torch.float64) - x_max) * _TOPP_SCALE).to(torch.int64)
        cum = q.cumsum(dim=-1)
        total = cum[:, -1:]
        limit = torch.ceil(batch.top_p.to(torch.float64)[:, None] * total.to(torch.float64)).to(torch.int64)
        keep_sorted = (cum - q) < limit
        off = (batch.top_p >= 1)[:, None]
        p_mask = torch.zeros_like(mask).scatter_(-1, sorted_ids, keep_sorted) | off
        mask = mask & p_mask

    if plan.any_min_p:
        ratio = torch.exp(x.to(torch.float64) - x_max)
        mask = mask & ((ratio >= batch.min_p.to(torch.float64)[:, None]) | (batch.min_p <= 0)[:, None])

    return _Processed(x=x, mask=mask, masked=x.masked_fill(~mask, _NEG_INF))


def candidate_sets(mask: Tensor, batch: BatchSampling) -> tuple[Tensor, Tensor]:
    """(candidate ids [B, C] ascending, -1 pad; counts [B], 0 for rows that do not filter) from the candidate mask
    [B, V]. Reads the widest row's count on the host (C): the one synchronising step of a call that asks for it."""
    b, v = mask.shape
    filters = (batch.top_k > 0) | (batch.top_p < 1) | (batch.min_p > 0)
    cand = mask & filters[:, None]
    num_candidates = cand.sum(dim=-1)
    width = int(num_candidates.max().item())
    if width == 0:
        return torch.full((b, 0), -1, dtype=torch.int64, device=mask.device), num_candidates
    ids = torch.where(cand, torch.arange(v, device=mask.device), v)
    smallest = ids.topk(width, dim=-1, largest=False, sorted=True).values
    return torch.where(smallest < v, smallest, -1), num_candidates


# ----------------------------------------------------------------------------------------------------------------------
# public entry points


def processed_logprobs(logits: Tensor, batch: BatchSampling, seen_tokens: Tensor | None = None) -> Tensor:
    """[B, V] float32 log-probs of the distribution `sample` draws from (-inf outside the candidate set); greedy rows
    at temperature 1 (module docstring)."""
    masked = _process(logits, batch, seen_tokens).masked
    return masked - torch.logsumexp(masked, dim=-1, keepdim=True)


def sample(
    logits: Tensor,
    batch: BatchSampling,
    steps: Tensor,
    *,
    seen_tokens: Tensor | None = None,
    return_candidates: bool = True,
) -> SampleResult:
    """One token per row of `logits` [B, V] (module docstring for the rules).

    `steps` [B] int64 is the index of the token being generated within its request (0 for the first new token);
    with the row's seed it determines the random draw. `seen_tokens` [B, V] bool marks tokens in the prompt or the
    output so far (repetition penalty); None = no penalty anywhere."""
    plan = batch.plan
    proc = _process(logits, batch, seen_tokens)
    masked = proc.masked
    b, v = masked.shape
    device = masked.device
    steps = checked_steps(steps, b, device)

    greedy = batch.temperature <= 0
    token_ids = torch.zeros(b, dtype=torch.int64, device=device)
    if plan.any_random:
        if plan.random_all_top_k and plan.max_top_k < v:
            # every sampled row's candidates lie in its top-k set: hash only that window
            win_x, win_ids = masked.topk(plan.max_top_k, dim=-1, sorted=False)
            sampled = gumbel_argmax_reference(win_x, win_ids, batch.seeds, steps, v)
        elif masked.is_cuda and _fused_gumbel_available():
            from rlasync.engine.triton_sampling import gumbel_argmax

            sampled = gumbel_argmax(masked, hash_keys(batch.seeds, steps))
        else:
            win_ids = torch.arange(v, device=device).expand(b, v)
            sampled = gumbel_argmax_reference(masked, win_ids, batch.seeds, steps, v)
        token_ids = torch.where(greedy, token_ids, sampled)
    if plan.any_greedy:
        token_ids = torch.where(greedy, masked.argmax(dim=-1), token_ids)  # first maximum = lowest id

    log_norm = torch.logsumexp(masked, dim=-1, keepdim=True)
    logprobs = (masked.gather(-1, token_ids[:, None]) - log_norm).squeeze(-1)

    topn_ids = topn_logprobs = None
    n = batch.num_logprobs
    if n > 0:
        n_eff = min(n, v)
        top_mask = _exact_topk_mask(masked, torch.full((b,), n_eff, device=device, dtype=torch.int64), n_eff)
        top_x, topn_ids = _topk_window(masked.masked_fill(~top_mask, _NEG_INF), n_eff)
        finite = torch.isfinite(top_x)
        topn_logprobs = torch.where(finite, top_x - log_norm, _NEG_INF)
        topn_ids = torch.where(finite, topn_ids, -1)
        if n_eff < n:  # vocabulary smaller than N
            topn_ids = torch.nn.functional.pad(topn_ids, (0, n - n_eff), value=-1)
            topn_logprobs = torch.nn.functional.pad(topn_logprobs, (0, n - n_eff), value=_NEG_INF)

    candidate_ids = num_candidates = None
    if return_candidates and plan.any_filters:
        candidate_ids, num_candidates = candidate_sets(proc.mask, batch)

    return SampleResult(
        token_ids=token_ids,
        logprobs=logprobs,
        topn_ids=topn_ids,
        topn_logprobs=topn_logprobs,
        candidate_ids=candidate_ids,
        num_candidates=num_candidates,
    )
