"""The sampler in a few fused kernels: `sampler.sample`'s rules as one traceable function, `torch.compile`d.

    result = sample_compiled(logits, batch, steps, seen_tokens=seen)   # same SampleResult as sampler.sample

`sampler.sample` runs ~80-140 small torch ops per call (the seeded SplitMix64 hash alone is ~30 elementwise ops,
then top-k / top-p masks, the top-N window and its canonical re-sorts); on a GPU each is a kernel launch, several
microseconds of host time, while the decode step before it is one CUDA graph replay. Here the same computation is
written without host decisions inside (`_core`: no `.item()`, no data-dependent shapes) so inductor fuses the
elementwise chains (penalty, temperature, masks, hash, Gumbel noise, argmax, log-softmax) into a few kernels around
the top-k / sort calls it keeps.

Same results as `sampler.sample` (the tests compare both on mixed batches with ties): the same token under the same
(seed, step), the same top-N ids and candidate sets, the log-probs within float tolerance. The one change of method
is the ranking: "the k highest tokens by (processed logit descending, token id ascending)" is computed as one
`topk` over int64 keys `ordered_bits(x) * 2**32 + (2**32 - 1 - id)` (unique per row, ordered exactly as that rule:
the float32's bits made monotone, -0.0 folded into +0.0 as float comparison ties them), instead of `topk` plus a
tie count by cumulative sum and a canonical re-sort; a key's low 32 bits give the id back. On CUDA the top-N
log-probs' ids are picked after the graph by a Triton kernel with the same ranking (`top_n_ids`: one read
of the logits, where a `topk` over the whole vocabulary's int64 keys reads twice the logits' bytes once per 8 bits of
key; 8 log-probs cost the engine 1.3 ms a decode step at 256 x 152k on an H100 with the keys, vLLM 0.3 ms).

The batch's host plan (`BatchSampling.plan`) picks the static variant (`_Variant`: which stages run, window widths
rounded up to a power of two); the batch dimension is dynamic, so one compiled graph serves every batch size of a
variant (dynamo specialises sizes and storage offsets 0 and 1, so a single row runs as two and views are copied to
offset 0: else a second graph would compile mid-run, seconds in which the engine cannot pause). A run sees a few
variants (e.g. with and without top-N log-probs, a greedy evaluation); dynamo's recompile limit (8 per function)
bounds them, past which it warns and runs `_core` eagerly (same results, more launches).
The candidate sets (`return_candidates`) read their width on the host, so they run after the compiled part.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import Tensor

from rlasync.engine.sampler import (
    _TOPP_SCALE,
    BatchSampling,
    SampleResult,
    _Plan,
    candidate_sets,
    checked_seen,
    checked_steps,
    gumbel_argmax_reference,
)

__all__ = ["resolve_compiled_sampler", "sample_compiled"]

logger = logging.getLogger(__name__)
_NEG_INF = float("-inf")
_LOW32 = (1 << 32) - 1


def resolve_compiled_sampler(value: bool | None, device: torch.device | str = "cpu") -> bool:
    """TorchEngine's `compiled_sampler` option: True/False, or None for the default: on for a CUDA device (on one
    H200 it gives 1.17x new tokens/s at 256 concurrent, 1.45x with 8 log-probs), off on the CPU (where compiling
    costs more than the launches it saves). It gives the same tokens either way."""
    if value is None:
        return torch.device(device).type == "cuda"
    if not isinstance(value, bool):
        raise ValueError(
            f"TorchEngine: compiled_sampler={value!r} must be True, False or None (None: the default, on for CUDA)"
        )
    return value


class _Variant(NamedTuple):
    """The static shape of one sampler call (`_core` is traced once per distinct variant)."""

    penalty: bool  # a repetition penalty applies (seen tokens given)
    k_width: int  # top-k window (max top_k rounded up to a power of two, clamped to V); 0 = no row uses top-k
    top_p: str  # "off", "window" (every top-p row sets top_k: sort inside the top-k window) or "full"
    min_p: bool
    random: str  # "off" (all greedy), "window" (every sampled row sets top_k < V: noise on the window), "full"
    greedy: bool  # some row is greedy
    num_logprobs: int  # N of the top-N
    top_n_kernel: bool = False  # the top-N picked after `_core` by `top_n_ids` (CUDA, Triton), not in the graph

    @classmethod
    def of(cls, plan: _Plan, vocab: int, penalty: bool, num_logprobs: int, top_n_kernel: bool = False) -> _Variant:
        k_width = min(1 << (plan.max_top_k - 1).bit_length(), vocab) if plan.max_top_k > 0 else 0
        top_p = "off" if not plan.any_top_p else ("full" if plan.full_sort else "window")
        if not plan.any_random:
            random = "off"
        else:
            random = "window" if plan.random_all_top_k and 0 < k_width < vocab else "full"
        top_n_kernel = top_n_kernel and num_logprobs > 0
        return cls(penalty, k_width, top_p, plan.any_min_p, random, plan.any_greedy, num_logprobs, top_n_kernel)


def rank_keys(x: Tensor, ids: Tensor) -> Tensor:
    """int64 keys [B, V] of float32 `x` [B, V] and token ids `ids` [V]: a larger x, then a lower id, gives the larger
    key, and keys are unique per row, so `topk` of the keys ranks exactly by (x descending, id ascending)."""
    x = torch.where(x == 0, 0.0, x)  # -0.0 == +0.0: one key
    x = torch.where(torch.isnan(x), float("nan"), x)  # one NaN bit pattern (positive: above +inf, as topk ranks it)
    bits = x.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # monotone in x
    return ordered * (1 << 32) + (_LOW32 - ids)


def key_ids(keys: Tensor) -> Tensor:
    """The token ids of `rank_keys` keys."""
    return _LOW32 - (keys & _LOW32)


def _core(logits, temperature, top_k, top_p, min_p, penalty, seeds, steps, seen, ids, variant: _Variant):  # noqa: C901
    """`sampler._process` + `sampler.sample` without host decisions: (token ids, log-probs, top-N ids, top-N
    log-probs, candidate mask); top-N are None when N = 0, and with `variant.top_n_kernel` they are the masked
    logits and their log-normaliser instead (`_finish_top_n` picks the top N from them). `ids` = arange(V) is an
    input, not built inside: CPU inductor (torch 2.13) miscompiles the int64 hash of an in-graph arange (wrong
    tokens, or a crash)."""
    x = logits.to(torch.float32)
    b, v = x.shape
    if variant.penalty:
        pen = penalty[:, None]
        x = torch.where(seen & (pen != 1), torch.where(x > 0, x / pen, x * pen), x)
    x = x / torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]

    mask = torch.isfinite(x)
    if variant.top_p != "off" or variant.min_p:
        x_max = x.amax(dim=-1, keepdim=True).to(torch.float64)
    k_mask = None
    if variant.k_width:
        k = top_k.clamp(0, v)
        keys = rank_keys(x, ids)
        top = keys.topk(variant.k_width, dim=-1).values  # sorted: rank r at column r
        kth = top.gather(-1, (k.clamp(1, variant.k_width) - 1)[:, None])
        k_mask = (keys >= kth) | (k == 0)[:, None]
        mask = mask & k_mask

    if variant.top_p != "off":
        xk = x if k_mask is None else x.masked_fill(~k_mask, _NEG_INF)
        if variant.top_p == "full":
            sorted_ids = key_ids(rank_keys(xk, ids).sort(dim=-1, descending=True).values)
        else:  # every top-p row's top-k set, ranked, leads the top-k window; the rest of it is -inf in xk (q = 0)
            sorted_ids = key_ids(top)
        q = torch.floor(torch.exp(xk.gather(-1, sorted_ids).to(torch.float64) - x_max) * _TOPP_SCALE)
        q = q.to(torch.int64)
        cum = q.cumsum(dim=-1)
        limit = torch.ceil(top_p.to(torch.float64)[:, None] * cum[:, -1:].to(torch.float64)).to(torch.int64)
        p_mask = torch.zeros_like(mask).scatter(-1, sorted_ids, (cum - q) < limit) | (top_p >= 1)[:, None]
        mask = mask & p_mask

    if variant.min_p:
        ratio = torch.exp(x.to(torch.float64) - x_max)
        mask = mask & ((ratio >= min_p.to(torch.float64)[:, None]) | (min_p <= 0)[:, None])
    masked = x.masked_fill(~mask, _NEG_INF)

    greedy = temperature <= 0
    token_ids = torch.zeros(b, dtype=torch.int64, device=x.device)
    if variant.random == "window":  # every sampled row's candidates lie in its top-k set, inside the window
        win_ids = key_ids(top)
        sampled = gumbel_argmax_reference(masked.gather(-1, win_ids), win_ids, seeds, steps, v)
        token_ids = torch.where(greedy, token_ids, sampled)
    elif variant.random == "full":
        sampled = gumbel_argmax_reference(masked, ids.expand(b, v), seeds, steps, v)
        token_ids = torch.where(greedy, token_ids, sampled)
    if variant.greedy:  # the first maximum (lowest id), written out: an argmax's tie rule is not part of its contract
        best = masked.amax(dim=-1, keepdim=True)
        token_ids = torch.where(greedy, torch.where(masked == best, ids, v).amin(dim=-1), token_ids)

    log_norm = torch.logsumexp(masked, dim=-1, keepdim=True)
    logprobs = (masked.gather(-1, token_ids[:, None]) - log_norm).squeeze(-1)

    topn_ids = topn_logprobs = None
    if variant.top_n_kernel:
        return token_ids, logprobs, masked, log_norm, mask
    if variant.num_logprobs > 0:
        topn_ids = key_ids(rank_keys(masked, ids).topk(min(variant.num_logprobs, v), dim=-1).values)
        topn_ids, topn_logprobs = _top_n_outputs(masked, log_norm, topn_ids, variant.num_logprobs)
    return token_ids, logprobs, topn_ids, topn_logprobs, mask


def _top_n_outputs(masked: Tensor, log_norm: Tensor, topn_ids: Tensor, num_logprobs: int) -> tuple[Tensor, Tensor]:
    """(ids, log-probs) [B, num_logprobs] of the ranked top-N `topn_ids` [B, min(N, V)]: -1 / -inf past the finite
    ones and past the vocabulary."""
    top_x = masked.gather(-1, topn_ids)
    finite = torch.isfinite(top_x)
    topn_logprobs = torch.where(finite, top_x - log_norm, _NEG_INF)
    topn_ids = torch.where(finite, topn_ids, -1)
    n_eff = topn_ids.shape[-1]
    if n_eff < num_logprobs:  # vocabulary smaller than N
        topn_ids = torch.nn.functional.pad(topn_ids, (0, num_logprobs - n_eff), value=-1)
        topn_logprobs = torch.nn.functional.pad(topn_logprobs, (0, num_logprobs - n_eff), value=_NEG_INF)
    return topn_ids, topn_logprobs


def top_n_ids(masked: Tensor, n: int) -> Tensor:
    """[B, n] ids of the n best tokens of `masked` [B, V] (float32, no NaN), ranked by (value descending, id
    ascending) as `rank_keys` ranks them, through the Triton kernel (`triton_sampling.chunk_top_n`: each chunk's n
    best) and a `topk` over the chunks' candidates' keys. Needs 1 <= n <= V and Triton."""
    from rlasync.engine.triton_sampling import chunk_top_n

    values, ids = chunk_top_n(masked, n)
    return key_ids(rank_keys(values, ids).topk(n, dim=-1).values)


_TOP_N_KERNEL_FAILED: list[str] = []  # why the Triton top-N failed (once per process): the int64 keys from then on


def _finish_top_n(masked: Tensor, log_norm: Tensor, ids: Tensor, num_logprobs: int) -> tuple[Tensor, Tensor]:
    """The top-N of a `top_n_kernel` variant: the kernel's ranked ids (those `_core`'s int64 keys give), then
    `_top_n_outputs`. A kernel that Triton cannot build here (an error raised by Triton) gives way to the int64
    keys, with one warning, for this call and every later one (same ids)."""
    n = min(num_logprobs, masked.shape[-1])
    try:
        ranked = top_n_ids(masked, n)
    except Exception as exc:
        if not type(exc).__module__.startswith("triton"):
            raise
        if not _TOP_N_KERNEL_FAILED:
            _TOP_N_KERNEL_FAILED.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            logger.warning(
                "top-N log-prob kernel failed (%s); ranking by int64 keys from now on", _TOP_N_KERNEL_FAILED[0]
            )
        ranked = key_ids(rank_keys(masked, ids).topk(n, dim=-1).values)
    return _top_n_outputs(masked, log_norm, ranked, num_logprobs)


_compiled = None


def _triton_available() -> bool:
    from rlasync.engine import triton_sampling

    return triton_sampling.available()


_token_ids: dict[tuple[torch.device, int], Tensor] = {}


def _compiled_core():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_core, fullgraph=True)
    return _compiled


def sample_compiled(
    logits: Tensor,
    batch: BatchSampling,
    steps: Tensor,
    *,
    seen_tokens: Tensor | None = None,
    return_candidates: bool = True,
    compile: bool = True,
    top_n_kernel: bool | None = None,
) -> SampleResult:
    """`sampler.sample` (same arguments, same result) through the compiled `_core`; `compile=False` runs `_core`
    eagerly (the tests check the formulation and the compilation separately). `top_n_kernel`: the top-N log-probs'
    ids picked by the Triton kernel (`top_n_ids`) instead of inside `_core`; None: on CUDA when Triton imports and
    the kernel has not failed (same ids either way)."""
    seen = checked_seen(logits, batch, seen_tokens)
    b, v = logits.shape
    steps = checked_steps(steps, b, logits.device)
    plan = batch.plan
    if top_n_kernel is None:
        top_n_kernel = logits.is_cuda and not _TOP_N_KERNEL_FAILED and _triton_available()
    variant = _Variant.of(plan, v, seen is not None, batch.num_logprobs, top_n_kernel)
    fields = (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.repetition_penalty, batch.seeds)
    ids = _token_ids.get((logits.device, v))
    if ids is None:
        ids = _token_ids[(logits.device, v)] = torch.arange(v, device=logits.device)
    rows = (logits, *fields, steps, seen)  # the [B, ...] inputs
    core = _core
    if compile:
        core = _compiled_core()
        # dynamo specialises sizes and storage offsets of 0 and 1 (another compile, seconds, mid-run): a single row
        # runs as two, and views into a packed tensor (the batch's fields) are copied to offset 0
        if b == 1:
            rows = tuple(None if t is None else torch.cat([t, t]) for t in rows)
        rows = tuple(t.clone() if t is not None and t.storage_offset() else t for t in rows)
        for tensor in rows:
            if tensor is not None:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)  # one graph for every batch size
    outputs = core(*rows, ids, variant)
    if variant.top_n_kernel:  # `_core` handed back the masked logits and their log-normaliser
        token_ids, logprobs, masked, log_norm, mask = outputs
        outputs = (token_ids, logprobs, *_finish_top_n(masked, log_norm, ids, variant.num_logprobs), mask)
    token_ids, logprobs, topn_ids, topn_logprobs, mask = (None if t is None else t[:b] for t in outputs)
    candidate_ids = num_candidates = None
    if return_candidates and plan.any_filters:
        candidate_ids, num_candidates = candidate_sets(mask, batch)
    return SampleResult(token_ids, logprobs, topn_ids, topn_logprobs, candidate_ids, num_candidates)
