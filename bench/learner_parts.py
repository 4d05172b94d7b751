"""Probes for the learner's remaining GPU time at 8K rows: three candidate rewrites, each timed against what the
learner does today, on the shapes of `bench/tree_packing.py`'s 8K row (Qwen3-0.6B: hidden 1024, 16/8 heads of 128,
intermediate 3072, vocabulary 151,936; bf16; forward + backward, CUDA events, after warm-up).

  attention  compiled FlexAttention over the row's tree BlockMask as the learner lays it out, against the same row
             with every root-path segment moved to a block boundary *inside the attention only* (q/k/v gathered to
             an aligned layout with invisible gaps, the output gathered back): fewer partial blocks, no extra
             tokens in the matmuls. Also for completions of random length (32..512).
  matmuls    a decoder layer's seven projections (q, k, v, o, gate, up, down) against q|k|v and gate|up as one
             matmul each (weights concatenated), forward + backward.
  head       the chunked head as the learner runs it (one chunk of all terms, logits kept) against a prototype
             that chunks the vocabulary instead (each [M, Vc] logits chunk reduced while it is in L2; the weight
             gradient needs no accumulation since vocabulary chunks are disjoint).

    python3 bench/learner_parts.py --out $OUT/learner_parts_h200.json       (one GPU, ~3 min)
    python3 bench/learner_parts.py --device cpu --tiny                      (the harness on a CPU)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flex_tiles import attended_pairs, computed_pairs, time_ms  # noqa: E402
from learner_shapes import plan_rows  # noqa: E402

from rlasync.model import packed_row_to_tensors  # noqa: E402
from rlasync.model.block_mask import tree_block_mask, tree_block_sparsity  # noqa: E402
from rlasync.model.head import chunked_token_scores  # noqa: E402
from rlasync.packing import pack  # noqa: E402
from rlasync.records import RolloutSample  # noqa: E402


def rows_of(prompt, completions, group, groups, row_tokens, seed=0, random_lengths=None):
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(groups):
        p = rng.integers(0, 1000, prompt)
        for _ in range(group):
            n = completions if random_lengths is None else int(rng.integers(*random_lengths))
            ids = np.concatenate([p, rng.integers(0, 1000, n)])
            mask = np.concatenate([np.zeros(prompt, np.int8), np.ones(n, np.int8)])
            samples.append(RolloutSample(ids, mask, np.zeros(len(ids), np.float32), advantage=1.0, group_id=g))
    return plan_rows(samples, row_tokens, share=True)


def aligned_layout(subtree_end: torch.Tensor, block: int):
    """(index [N'] of the row position at each aligned slot (-1 at gaps), inverse [N], aligned subtree_end [N'])."""
    end = subtree_end.cpu().numpy()
    n = len(end)
    new = np.empty(n, np.int64)
    cur = 0
    for i in range(n):
        if i == 0 or end[i] != end[i - 1]:  # a new root-path segment: to the next block boundary
            cur += (-cur) % block
        new[i] = cur
        cur += 1
    total = cur + (-cur) % block
    index = np.full(total, -1, np.int64)
    index[new] = np.arange(n)
    aligned_end = np.arange(total, dtype=np.int64) + 1  # gaps: visible to themselves only
    aligned_end[new] = new[end - 1] + 1
    return (
        torch.as_tensor(index, device=subtree_end.device),
        torch.as_tensor(new, device=subtree_end.device),
        torch.as_tensor(aligned_end, device=subtree_end.device),
    )


def attention_entry(args, device, flex, rows):
    """One row's layouts compared: block counts, agreement, and fwd+bwd time of each."""
    tensors = packed_row_to_tensors(pack(rows[0]), device)
    end, pos = tensors.subtree_end, tensors.position_ids
    n = end.shape[0]
    hq, hkv, d = (4, 2, 32) if args.tiny else (16, 8, 128)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    grads = device.type == "cuda"  # FlexAttention has no CPU backward: the CPU harness times the forward
    q = torch.randn(1, hq, n, d, generator=g).to(device, dtype).requires_grad_(grads)
    k = torch.randn(1, hkv, n, d, generator=g).to(device, dtype).requires_grad_(grads)
    v = torch.randn(1, hkv, n, d, generator=g).to(device, dtype).requires_grad_(grads)
    grad = torch.randn(1, hq, n, d, generator=g).to(device, dtype)
    mask = tree_block_mask(end, pos)
    index, inverse, aligned_end = aligned_layout(end, 128)
    aligned_pos = torch.zeros_like(aligned_end)
    aligned_pos[inverse] = pos
    aligned_mask = tree_block_mask(aligned_end, aligned_pos)
    safe = index.clamp(min=0)

    def plain():
        out = flex(q, k, v, block_mask=mask, enable_gqa=True)
        if grads:
            out.backward(grad)

    def aligned_only():
        qa, ka, va = q.index_select(2, safe), k.index_select(2, safe), v.index_select(2, safe)
        out = flex(qa, ka, va, block_mask=aligned_mask, enable_gqa=True)
        out = out.index_select(2, inverse)
        if grads:
            out.backward(grad)

    entry = {"tokens": n, "aligned_tokens": int(index.shape[0]), "attended_pairs": attended_pairs(end)}
    for label, e, p in (("plain", end, pos), ("aligned", aligned_end, aligned_pos)):
        partial, full = tree_block_sparsity(e, p, None, 128)
        entry[f"{label}_partial_blocks"], entry[f"{label}_full_blocks"] = int(partial.sum()), int(full.sum())
        entry[f"{label}_computed_over_attended"] = computed_pairs(e, p, 128) / max(1, attended_pairs(end))
    # the two layouts agree: outputs and gradients
    out_plain = flex(q, k, v, block_mask=mask, enable_gqa=True)
    out_al = flex(
        q.index_select(2, safe),
        k.index_select(2, safe),
        v.index_select(2, safe),
        block_mask=aligned_mask,
        enable_gqa=True,
    ).index_select(2, inverse)
    entry["max_abs_diff_out"] = float((out_plain.float() - out_al.float()).abs().max())
    for label, fn in (("plain", plain), ("aligned_with_gathers", aligned_only)):
        entry[f"{label}_fwd_bwd_ms"] = time_ms(fn, args.iters, device)
        q.grad = k.grad = v.grad = None
    entry["aligned_over_plain_time"] = entry["aligned_with_gathers_fwd_bwd_ms"] / entry["plain_fwd_bwd_ms"]
    return entry


def attention_part(args, device, rows_spec):
    from torch.nn.attention.flex_attention import flex_attention

    results = {}
    flex = torch.compile(flex_attention) if device.type == "cuda" else flex_attention
    for name, rows in rows_spec.items():
        results[name] = entry = attention_entry(args, device, flex, rows)
        print("attention", name, json.dumps(entry), flush=True)
    return results


def matmul_part(args, device, m):
    h, inter, qd, kvd = (64, 192, 128, 64) if args.tiny else (1024, 3072, 2048, 1024)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(o, i):
        return (torch.randn(o, i, generator=g) * 0.02).to(device, dtype).requires_grad_()

    wq, wk, wv, wo, wg, wu, wd = w(qd, h), w(kvd, h), w(kvd, h), w(h, qd), w(inter, h), w(inter, h), w(h, inter)
    wqkv, wgu = w(qd + 2 * kvd, h), w(2 * inter, h)
    x = torch.randn(m, h, generator=g).to(device, dtype).requires_grad_()
    a = torch.randn(m, qd, generator=g).to(device, dtype).requires_grad_()
    gq = torch.randn(m, qd + 2 * kvd, generator=g).to(device, dtype)
    gh = torch.randn(m, h, generator=g).to(device, dtype)
    gi = torch.randn(m, inter, generator=g).to(device, dtype)

    def separate():
        q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
        o = F.linear(a, wo)
        gate, up = F.linear(x, wg), F.linear(x, wu)
        down = F.linear(gate * up, wd)
        torch.autograd.backward(
            [q, k, v, o, gate, up, down], [gq[:, :qd], gq[:, qd : qd + kvd], gq[:, qd + kvd :], gh, gi, gi, gh]
        )

    def fused():
        qkv = F.linear(x, wqkv)
        o = F.linear(a, wo)
        gu = F.linear(x, wgu)
        gate, up = gu.split(inter, dim=-1)
        down = F.linear(gate * up, wd)
        torch.autograd.backward([qkv, o, gate, up, down], [gq, gh, gi, gi, gh])

    out = {"tokens": m}
    for label, fn in (("separate", separate), ("fused_qkv_gate_up", fused)):
        out[f"{label}_fwd_bwd_ms"] = time_ms(fn, args.iters, device)
        for p in (x, a, wq, wk, wv, wo, wg, wu, wd, wqkv, wgu):
            p.grad = None
    out["fused_over_separate_time"] = out["fused_qkv_gate_up_fwd_bwd_ms"] / out["separate_fwd_bwd_ms"]
    print("matmuls", json.dumps(out), flush=True)
    return out


_STATS = {}


def _stats_fn():
    def stats(raw):
        z = raw.float()
        peak = z.amax(dim=-1)
        e = torch.exp(z - peak[:, None])
        return peak, e.sum(-1), (e * z).sum(-1)

    def grad(raw, lse, mean, coef, g_entropy):
        z = raw.float()
        probs = torch.exp(z - lse[:, None])
        return (probs * (coef[:, None] - g_entropy[:, None] * (z - mean[:, None]))).to(raw.dtype)

    if "fns" not in _STATS:
        compile_ = torch.cuda.is_available()
        _STATS["fns"] = tuple(torch.compile(f, dynamic=False) if compile_ else f for f in (stats, grad))
    return _STATS["fns"]


class VocabChunkedHead(torch.autograd.Function):
    """Prototype (log-prob and entropy of each term, no extra ids or candidates, temperature 1): logits chunked over
    the vocabulary, kept from forward to backward; statistics merged over chunks in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_chunk):
        stats, _ = _stats_fn()
        raws, peaks, sums, dots = [], [], [], []
        for start in range(0, weight.shape[0], vocab_chunk):
            raw = hidden @ weight[start : start + vocab_chunk].t()
            p, s, t = stats(raw)
            raws.append(raw)
            peaks.append(p)
            sums.append(s)
            dots.append(t)
        peak = torch.stack(peaks)
        top = peak.amax(0)
        scale = torch.exp(peak - top)
        total = (torch.stack(sums) * scale).sum(0)
        lse = top + torch.log(total)
        mean = (torch.stack(dots) * scale).sum(0) / total
        chunk_of, col = targets // vocab_chunk, targets % vocab_chunk
        target_logit = (
            torch.stack([raws[c][i, col[i]] for i, c in enumerate(chunk_of.tolist())]).float()
            if hidden.shape[0] <= 64
            else _gather_chunks(raws, chunk_of, col)
        )
        ctx.save_for_backward(hidden, weight, targets, lse, mean, *raws)
        ctx.vocab_chunk = vocab_chunk
        return target_logit - lse, lse - mean

    @staticmethod
    def backward(ctx, g_logprobs, g_entropy):
        hidden, weight, targets, lse, mean, *raws = ctx.saved_tensors
        _, grad_fn = _stats_fn()
        vc = ctx.vocab_chunk
        coef = -g_logprobs.float()
        g_entropy = g_entropy.float()
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.empty_like(weight)
        for index, start in enumerate(range(0, weight.shape[0], vc)):
            g = grad_fn(raws[index], lse, mean, coef, g_entropy)
            in_chunk = (targets >= start) & (targets < start + vc)
            rows = torch.nonzero(in_chunk).squeeze(1)  # the one-hot part of the targets in this chunk
            g.index_put_((rows, targets[rows] - start), g[rows, targets[rows] - start] + g_logprobs[rows].to(g.dtype))
            w = weight[start : start + vc]
            if hidden.device.type == "cuda":
                torch.addmm(grad_hidden, g, w, out_dtype=torch.float32, out=grad_hidden)
            else:
                grad_hidden += g @ w
            torch.mm(g.t(), hidden, out=grad_weight[start : start + vc])
        return grad_hidden.to(hidden.dtype), grad_weight, None, None


def _gather_chunks(raws, chunk_of, col):
    out = torch.empty(chunk_of.shape[0], dtype=torch.float32, device=chunk_of.device)
    rows = torch.arange(chunk_of.shape[0], device=chunk_of.device)
    for c, raw in enumerate(raws):
        sel = chunk_of == c
        out = torch.where(sel, raw[rows, col.clamp(max=raw.shape[1] - 1)].float(), out)
    return out


def head_part(args, device, m):
    h, vocab = (64, 5000) if args.tiny else (1024, 151936)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(m, h, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=g) * 0.05).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (m,), generator=g).to(device)
    adv = torch.randn(m, generator=g).to(device)

    def current():
        s = chunked_token_scores(hidden, weight, targets)
        (-(s.logprobs * adv).sum() / m + 0.01 * s.entropy.sum() / m).backward()

    def chunked(vc):
        def run():
            lp, ent = VocabChunkedHead.apply(hidden, weight, targets, vc)
            (-(lp * adv).sum() / m + 0.01 * ent.sum() / m).backward()

        return run

    out = {"terms": m, "vocab": vocab}
    s = chunked_token_scores(hidden, weight, targets)
    (-(s.logprobs * adv).sum() / m + 0.01 * s.entropy.sum() / m).backward()
    ref = (s.logprobs.detach(), hidden.grad.float().clone(), weight.grad.float().clone())
    hidden.grad = weight.grad = None
    out["current_fwd_bwd_ms"] = time_ms(current, args.iters, device)
    hidden.grad = weight.grad = None
    for vc in args.vocab_chunks:
        vc = min(vc, vocab)
        lp, ent = VocabChunkedHead.apply(hidden, weight, targets, vc)
        (-(lp * adv).sum() / m + 0.01 * ent.sum() / m).backward()
        out[f"vocab_{vc}_max_abs_diff"] = {
            "logprobs": float((lp.detach() - ref[0]).abs().max()),
            "grad_hidden": float((hidden.grad.float() - ref[1]).abs().max()),
            "grad_weight": float((weight.grad.float() - ref[2]).abs().max()),
        }
        hidden.grad = weight.grad = None
        out[f"vocab_{vc}_fwd_bwd_ms"] = time_ms(chunked(vc), args.iters, device)
        hidden.grad = weight.grad = None
    print("head", json.dumps(out), flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--parts", default="attention,matmuls,head")
    parser.add_argument("--vocab-chunks", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 16384, 32768])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    tokens, terms = (6272, 4064) if not args.tiny else (512, 96)
    result = {
        "benchmark": "learner_parts",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    parts = args.parts.split(",")
    if "attention" in parts:
        spec = {
            "544x128x8_in_8k": rows_of(544, 128, 8, 8, 8192),
            "544x(32..512)x8_in_8k": rows_of(544, 0, 8, 8, 8192, random_lengths=(32, 512)),
        }
        if args.tiny:
            spec = {
                "tiny": rows_of(40, 16, 4, 4, 256),
                "tiny_random": rows_of(40, 0, 4, 4, 256, random_lengths=(4, 40)),
            }
        result["attention"] = attention_part(args, device, spec)
    if "matmuls" in parts:
        result["matmuls"] = matmul_part(args, device, tokens)
    if "head" in parts:
        result["head"] = head_part(args, device, terms)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
