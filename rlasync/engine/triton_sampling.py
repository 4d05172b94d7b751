"""The sampler's whole-vocabulary passes as Triton kernels (CUDA): the Gumbel-max (`gumbel_argmax`;
`rlasync.engine.sampler` decides) and the exact top-N (`chunk_top_n`; the compiled sampler's top-N log-probs).

Gumbel-max.

For each row b and token v of the candidate-masked processed logits x [B, V] (float32, -inf outside the set):

    h = mix64(key[b] + (v + 1) * GOLDEN)            # the sampler's SplitMix64 hash (key = mix64(mix64(seed) ^ step))
    u = ((h >>> 12) + 0.5) * 2**-52                 # float64
    token[b] = argmax_v  x[b, v] - log(-log u)      # ties: the lowest id

exactly as `sampler.sample` computes it with ~40 elementwise torch ops over [B, V] int64/float64 tensors (each a
full pass over memory: several milliseconds a step at B = 256, V = 152k). Here the hash, the noise and a per-chunk
argmax run in registers; a second tiny pass picks the winning chunk (first maximum, so the lowest id wins ties).

Top-N. The N highest tokens of x [B, V] ranked by (x descending, token id ascending), -0.0 tied with +0.0, as
`sampler_compiled.rank_keys` ranks them. Ranking by that rule as one `topk` over int64 keys of the whole vocabulary
reads the keys (twice the logits' bytes) once per 8 bits of key in a radix select; with it, 8 log-probs cost the
engine 1.3 ms a decode step at B = 256, V = 152k on an H100 (vLLM: 0.3 ms). Here each (row, chunk) program reads
its chunk once and takes its N best in registers (N rounds of max, then lowest id among the maxima); the global top
N lies among the chunks' N best, which a `topk` over their keys (N per chunk: ~600 a row) ranks.

Triton is optional: on CPU the kernels run only under Triton's interpreter (the tests compare them with the torch
code).
"""

from __future__ import annotations

import torch

from rlasync.engine.triton_jit import available, jit

CHUNK = 2048
TOP_N_CHUNK = 2048

try:
    import triton.language as tl  # a module global of the kernel below
except ImportError:  # CPU builds of torch come without Triton
    tl = None

__all__ = ["available", "chunk_top_n", "gumbel_argmax"]


def _gumbel_argmax_kernel(
    x_ptr,
    key_ptr,
    best_score_ptr,
    best_id_ptr,
    vocab,
    stride_x,
    num_chunks,
    CHUNK_SIZE: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    valid = ids < vocab
    x = tl.load(x_ptr + row * stride_x + ids, mask=valid, other=float("-inf")).to(tl.float64)
    key = tl.load(key_ptr + row).to(tl.uint64, bitcast=True)
    z = key + (ids.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    u = ((z >> 12).to(tl.float64) + 0.5) * (2.0**-52)
    score = x - tl.log(-tl.log(u))
    score = tl.where(valid & (x > float("-inf")), score, float("-inf"))
    best = tl.max(score, 0)
    # lowest id among the chunk's maxima (an all -inf chunk reports its first id with score -inf)
    best_id = tl.min(tl.where(score == best, ids, vocab + CHUNK_SIZE), 0)
    tl.store(best_score_ptr + row * num_chunks + chunk, best)
    tl.store(best_id_ptr + row * num_chunks + chunk, best_id)


def gumbel_argmax(masked: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[B] int64 token ids: argmax over v of masked[b, v] - log(-log u(key[b], v)) (module docstring).

    `masked` [B, V] float32 (-inf outside the candidate set), `keys` [B] int64 = mix64(mix64(seed) ^ step)."""
    rows, vocab = masked.shape
    masked = masked.contiguous()
    num_chunks = -(-vocab // CHUNK)
    best_score = torch.empty(rows, num_chunks, dtype=torch.float64, device=masked.device)
    best_id = torch.empty(rows, num_chunks, dtype=torch.int64, device=masked.device)
    jit(_gumbel_argmax_kernel)[(rows, num_chunks)](
        masked,
        keys.to(torch.int64).contiguous(),
        best_score,
        best_id,
        vocab,
        masked.stride(0),
        num_chunks,
        CHUNK_SIZE=CHUNK,
    )
    winner = best_score.argmax(dim=-1, keepdim=True)  # first maximum: chunks are in id order
    return best_id.gather(1, winner)[:, 0]


def _top_n_kernel(
    x_ptr,
    value_ptr,
    id_ptr,
    vocab,
    stride_x,
    num_chunks,
    N: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    valid = ids < vocab
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + ids, mask=valid, other=float("-inf"))
    x = tl.where(valid, x, float("-inf"))  # past the vocabulary: -inf, with ids above every real one
    taken = ids < 0  # all False
    out = (row.to(tl.int64) * num_chunks + chunk) * N
    for i in tl.static_range(N):
        score = tl.where(taken, float("-inf"), x)
        best = tl.max(score, 0)
        # lowest id among the untaken maxima (-inf ones too, so a chunk always reports N distinct ids)
        best_id = tl.min(tl.where((score == best) & (taken == 0), ids, vocab + CHUNK_SIZE), 0)
        tl.store(value_ptr + out + i, best)
        tl.store(id_ptr + out + i, best_id.to(tl.int64))
        taken = taken | (ids == best_id)


def chunk_top_n(masked: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each vocabulary chunk's n best tokens of `masked` [B, V] (float32, no NaN; -inf outside the candidate set)
    by (value descending, id ascending), -0.0 tied with +0.0: (values [B, C*n] float32, ids [B, C*n] int64) for the C
    chunks; the row's top n lie among them (`sampler_compiled.top_n_ids` ranks them). Needs 1 <= n <= V."""
    rows, vocab = masked.shape
    if not 1 <= n <= vocab:
        raise ValueError(f"chunk_top_n: n={n} must be in [1, {vocab}] (the vocabulary)")
    masked = masked.contiguous()
    num_chunks = -(-vocab // TOP_N_CHUNK)
    values = torch.empty(rows, num_chunks * n, dtype=torch.float32, device=masked.device)
    ids = torch.empty(rows, num_chunks * n, dtype=torch.int64, device=masked.device)
    jit(_top_n_kernel)[(rows, num_chunks)](
        masked, values, ids, vocab, masked.stride(0), num_chunks, N=n, CHUNK_SIZE=TOP_N_CHUNK
    )
    return values, ids
