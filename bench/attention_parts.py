"""Which attention kernel is fast on the parts of one real tree row: a probe for the learner's attention backend.

A cascade would split a tree row's attention into a *self* part (every root-path segment of
rlasync.model.segment_attention causally on itself) and a *cross* part (the segments that branch from one token,
stacked, against its root path, with no mask), merged by their log-sum-exp, so that no key is copied per completion.
It was built and measured on the learner (docs/algorithms.md §4.3) and lost to both flex and the gathered varlen path.
This probe shows why, kernel by kernel: it takes the first row `bench/tree_packing.py` plans for a shape, random bf16 q/k/v of one layer (16 query
heads, 8 KV heads, head dim 128), and times each part (forward, forward+backward, CUDA events, after warm-up)
with each kernel torch offers here:

  flex_full        compiled FlexAttention over the whole row's tree BlockMask (the learner's default)
  fa2_self/cross   FlashAttention-2 varlen (`aten._flash_attention_forward` / `_backward`)
  cudnn_self/cross cuDNN varlen (`aten._cudnn_attention_forward`, K/V heads repeated: no GQA there), if present
  sdpa_cross_*     the cross blocks as one dense batch through SDPA with one backend forced (when all branch points
                   have the same shape, as in this bench)
  flex_cross       compiled FlexAttention, no mask, on that dense batch

plus, per part, TFLOP/s over the pairs it attends (4 x heads x head_dim a pair forward, x3 forward+backward).

    python3 bench/attention_parts.py --out $OUT/attention_parts_h200.json      (one GPU, ~1 min)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flex_tiles import attended_pairs, first_row, time_ms  # noqa: E402
from learner_shapes import parse_shapes  # noqa: E402

from rlasync.model.block_mask import tree_block_mask  # noqa: E402
from rlasync.model.segment_attention import LENGTH_QUANTUM, segment_plan  # noqa: E402


def cascade_parts(plan) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """(segment bounds, per branch point the query rows of its segments, per branch point its root path) from a
    `SegmentPlan`: a segment's ancestors are the first keys - queries entries of its gathered keys."""
    bounds, key_start, key_index = plan.query_start.tolist(), plan.key_start.tolist(), plan.key_index.tolist()
    branches: dict[int, tuple[list[int], list[int]]] = {}
    for s in range(len(bounds) - 1):
        a, b = bounds[s], bounds[s + 1]
        ancestors = key_index[key_start[s] : key_start[s + 1] - (b - a)]
        if ancestors:
            branches.setdefault(ancestors[-1], (ancestors, []))[1].extend(range(a, b))
    return bounds, [rows for _, rows in branches.values()], [path for path, _ in branches.values()]


def starts(lengths: list[int]) -> list[int]:
    return [0, *itertools.accumulate(lengths)]


def rounded(length: int) -> int:
    """A varlen call's max length, rounded as the segment plan rounds its own."""
    return LENGTH_QUANTUM * -(-length // LENGTH_QUANTUM)


def timed(name, fn, inputs, grad, pairs, iters, results, heads, head_dim):
    def forward():
        with torch.no_grad():
            return fn(*[t.detach() for t in inputs])

    def forward_backward():
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        out.backward(grad)

    try:
        forward_backward()
        entry = {
            "fwd_ms": time_ms(forward, iters, grad.device),
            "fwd_bwd_ms": time_ms(forward_backward, iters, grad.device),
        }
    except Exception as exc:  # a kernel this torch or GPU refuses: recorded
        results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(name, results[name], flush=True)
        return
    flops = 4 * heads * head_dim * pairs
    entry.update(
        pairs=pairs, fwd_tflops=flops / entry["fwd_ms"] / 1e9, fwd_bwd_tflops=3 * flops / entry["fwd_bwd_ms"] / 1e9
    )
    results[name] = entry
    print(name, json.dumps({k: round(v, 3) for k, v in entry.items()}), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="544x128x8@8192")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    device, dtype, heads, kv_heads, head_dim = torch.device("cuda"), torch.bfloat16, 16, 8, 128
    row = first_row(parse_shapes(args.shape)[0], device)
    n = row.num_tokens
    plan = segment_plan(row.subtree_end.cpu(), row.position_ids.cpu()).to(device)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen).requires_grad_()

    scale = head_dim**-0.5
    results: dict = {
        "benchmark": "attention_parts",
        "command": " ".join(["python3", "bench/attention_parts.py", *(argv or sys.argv[1:])]),
        "hardware": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "tokens": n,
    }
    flex = torch.compile(flex_attention, dynamic=False)
    mask = tree_block_mask(row.subtree_end, row.position_ids, None, 128)
    q4, k4, v4 = rand(1, heads, n, head_dim), rand(1, kv_heads, n, head_dim), rand(1, kv_heads, n, head_dim)
    timed(
        "flex_full",
        lambda q, k, v: flex(q, k, v, block_mask=mask, enable_gqa=True),
        (q4, k4, v4),
        torch.randn_like(q4),
        attended_pairs(row.subtree_end),
        args.iters,
        results,
        heads,
        head_dim,
    )

    # the self part: the row's segments, causal; the cross part: one dense entry per branch point
    bounds, cross_rows, cross_keys = cascade_parts(plan)
    self_pairs = sum((b - a) * (b - a + 1) // 2 for a, b in zip(bounds[:-1], bounds[1:]))
    cq, ck = starts([len(r) for r in cross_rows]), starts([len(k) for k in cross_keys])
    cross_q, cross_k = (torch.tensor(x, dtype=torch.int32, device=device) for x in (cq, ck))
    max_cq, max_ck = rounded(max(map(len, cross_rows))), rounded(max(map(len, cross_keys)))
    cross_pairs = sum((cq[e + 1] - cq[e]) * (ck[e + 1] - ck[e]) for e in range(len(cq) - 1))
    nc, kc = cq[-1], ck[-1]
    results["parts"] = {
        "segments": len(bounds) - 1,
        "self_pairs": self_pairs,
        "cross_entries": len(cq) - 1,
        "cross_queries": nc,
        "cross_keys": kc,
        "cross_pairs": cross_pairs,
    }
    print(results["parts"], flush=True)

    def fa2(cu_q, cu_k, max_q, max_k, causal):
        class Fa2(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):
                out, lse, *_ = torch.ops.aten._flash_attention_forward(
                    q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
                )
                ctx.save_for_backward(q, k, v, out, lse)
                return out

            @staticmethod
            def backward(ctx, grad):
                q, k, v, out, lse = ctx.saved_tensors
                rng, unused = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
                return torch.ops.aten._flash_attention_backward(
                    grad.contiguous(),
                    q,
                    k,
                    v,
                    out,
                    lse,
                    cu_q,
                    cu_k,
                    max_q,
                    max_k,
                    0.0,
                    causal,
                    rng,
                    unused,
                    scale=scale,
                )

        return Fa2.apply

    def cudnn(cu_q, cu_k, max_q, max_k, causal):
        groups = heads // kv_heads

        class Cudnn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):
                k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
                res = torch.ops.aten._cudnn_attention_forward(
                    q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, causal, False, scale=scale
                )
                ctx.save_for_backward(q, k, v, res[0], res[1], res[6], res[7])
                return res[0]

            @staticmethod
            def backward(ctx, grad):
                q, k, v, out, lse, seed, offset = ctx.saved_tensors
                dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
                    grad.contiguous(),
                    q,
                    k,
                    v,
                    out,
                    lse,
                    seed,
                    offset,
                    None,
                    cu_q,
                    cu_k,
                    max_q,
                    max_k,
                    0.0,
                    causal,
                    scale=scale,
                )
                shape = (dk.shape[0], kv_heads, groups, head_dim)
                return dq, dk.view(shape).sum(2), dv.view(shape).sum(2)

        return Cudnn.apply

    q3, k3, v3 = rand(n, heads, head_dim), rand(n, kv_heads, head_dim), rand(n, kv_heads, head_dim)
    qc, kc3, vc3 = rand(nc, heads, head_dim), rand(kc, kv_heads, head_dim), rand(kc, kv_heads, head_dim)
    cu = plan.query_start
    for name, make in (("fa2", fa2), ("cudnn", cudnn)):
        timed(
            f"{name}_self",
            make(cu, cu, plan.max_query, plan.max_query, True),
            (q3, k3, v3),
            torch.randn_like(q3),
            self_pairs,
            args.iters,
            results,
            heads,
            head_dim,
        )
        timed(
            f"{name}_cross",
            make(cross_q, cross_k, max_cq, max_ck, False),
            (qc, kc3, vc3),
            torch.randn_like(qc),
            cross_pairs,
            args.iters,
            results,
            heads,
            head_dim,
        )
    lengths = {(cq[e + 1] - cq[e], ck[e + 1] - ck[e]) for e in range(len(cq) - 1)}
    if len(lengths) == 1:  # one dense batch [E, H, Lq, D] x [E, Hkv, Lk, D]
        (lq, lk), entries = lengths.pop(), len(cq) - 1
        qb, kb, vb = (
            rand(entries, heads, lq, head_dim),
            rand(entries, kv_heads, lk, head_dim),
            rand(entries, kv_heads, lk, head_dim),
        )
        grad = torch.randn_like(qb)
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):

            def sdpa(q, k, v, backend=backend):
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

            timed(
                f"sdpa_cross_{backend.lower()}",
                sdpa,
                (qb, kb, vb),
                grad,
                cross_pairs,
                args.iters,
                results,
                heads,
                head_dim,
            )
        timed(
            "flex_cross",
            lambda q, k, v: flex(q, k, v, enable_gqa=True),
            (qb, kb, vb),
            grad,
            cross_pairs,
            args.iters,
            results,
            heads,
            head_dim,
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
