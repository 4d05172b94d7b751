"""FlexAttention on one real tree-packed row: forward and forward+backward time per kernel configuration.

The learner's attention is FlexAttention under the tree rule (key k visible to query q iff k <= q < subtree_end[k]),
with a BlockMask built from subtree_end (rlasync.model.block_mask). On the 8K-token rows of the Qwen3-0.6B shape it
is ~40% of the learner's GPU time (bench/results/profiles/tree_p544_c128_g8_row8192.txt). This bench takes the first
row `bench/tree_packing.py` plans for a shape, random bf16 q/k/v of one layer (16 query heads, 8 KV heads, head dim
128), and times compiled `flex_attention` fwd and fwd+bwd under each kernel configuration:

  default            torch's heuristic tiles
  <name>             a `kernel_options` dict (tiles, warps, stages, ROWS_GUARANTEED_SAFE, ...) from the sweep below
  autotune           `torch.compile(mode="max-autotune-no-cudagraphs")` of flex alone: inductor picks the tiles
  block64            the default tiles over a BlockMask of 64-token blocks instead of 128 (fewer wasted pairs)
  q128_kv64          a BlockMask of 128-query x 64-key blocks (density 0.72 vs 0.66 on the 8K row,
                     bench/block_layout.py), the backward's dK/dV tiles narrowed to 64 keys so they divide it
  aligned            the default tiles over the same row with its segment starts on 128-token block boundaries
                     (invisible padding, rlasync.packing.align_blocks): fewer partial blocks, a longer row; compared
                     with the default at the real tokens (aligned_roots: only the groups aligned; bench/block_layout.py)
  varlen             not flex: the varlen backend (FlashAttention varlen, each root-path segment against its
                     gathered ancestors; rlasync.model.segment_attention)

Each configuration's output and gradients are compared with the default's; a configuration the kernel refuses is
recorded with its error. Reported per configuration: ms, TFLOP/s over the attended pairs (4 x heads x head_dim per
pair forward, x3 forward+backward: the learner bench's MFU convention), and the block mask's waste (pairs computed
by the kernel's blocks / pairs attended).

    python3 bench/flex_tiles.py --out $OUT/flex_tiles_h200.json            (one GPU; ~3 min)
    python3 bench/flex_tiles.py --tiny --device cpu --configs default      (the harness on a CPU)

Set the winner for the learner with the config field `kernels.flex_kernel_options` ('--set
kernels.flex_kernel_options=<its JSON>', rlasync.config.kernels).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tree_packing import make_samples, parse_shapes, plan_rows  # noqa: E402

from rlasync.model import packed_row_to_tensors  # noqa: E402
from rlasync.model.block_mask import tree_block_mask, tree_block_sparsity  # noqa: E402
from rlasync.model.segment_attention import segment_plan  # noqa: E402
from rlasync.packing import align_blocks, pack  # noqa: E402

SWEEP: dict[str, dict] = {
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},  # NaN on an H200: the last block's padding queries see no key
    "fwd_128x64_w8_s3": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    "fwd_64x64_w4_s3": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    "bwd_32_64_64_32": {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32},
    "bwd_64_128_128_64_w8_s2": {
        "BLOCK_M1": 64,
        "BLOCK_N1": 128,
        "BLOCK_M2": 128,
        "BLOCK_N2": 64,
        "num_warps": 8,
        "num_stages": 2,
    },
    "bwd_32_128_128_32_w4_s3": {
        "BLOCK_M1": 32,
        "BLOCK_N1": 128,
        "BLOCK_M2": 128,
        "BLOCK_N2": 32,
        "num_warps": 4,
        "num_stages": 3,
    },
    "tma": {"USE_TMA": True},  # Hopper's tensor memory accelerator for the tile loads
    "prescale": {"PRESCALE_QK": True},  # q scaled by 1/sqrt(d) and log2(e) once, not every score
    "dq_in_dk_loop": {"WRITE_DQ": False},  # dQ scattered from the dK/dV loop instead of its own
    "tma_prescale": {"USE_TMA": True, "PRESCALE_QK": True},
    # FlashAttention-4's CuTe DSL kernels behind FlexAttention (needs the flash-attn-4 package; Hopper or later)
    "flash": {"BACKEND": "FLASH"},
    "flash_block64": {"BACKEND": "FLASH"},  # the same over 64-token mask blocks
    # 128-query x 64-key mask blocks: every key tile must divide 64 (forward BLOCK_N, backward BLOCK_N1 and BLOCK_N2)
    "q128_kv64": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 128, "BLOCK_N2": 64},
    "q128_kv64_m1_32": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 128, "BLOCK_N2": 64},
}
RECTANGULAR = {"q128_kv64": (128, 64), "q128_kv64_m1_32": (128, 64)}  # config -> its mask's (query, key) blocks
SPECIAL = ("default", "autotune", "block64", "varlen", "aligned", "aligned_roots")
ALIGNED = {"aligned": "segments", "aligned_roots": "roots"}  # config -> align_blocks(at=...), 128-token blocks


def attended_pairs(subtree_end: torch.Tensor) -> int:
    """Pairs (q, k) the tree rule makes visible: key k is seen by queries k .. subtree_end[k] - 1."""
    keys = torch.arange(subtree_end.shape[0], device=subtree_end.device)
    return int((subtree_end - keys).sum())


def computed_pairs(subtree_end: torch.Tensor, position_ids: torch.Tensor, block_size: int) -> int:
    """Pairs the kernel computes: every partial or full block of the mask, block_size^2 each."""
    partial, full = tree_block_sparsity(subtree_end, position_ids, None, block_size)
    return int((partial | full).sum()) * block_size * block_size


def first_row(shape, device, shared_prefix: int = 0, align_at: str | None = None):
    """The first row bench/tree_packing.py plans for `shape` (completions opening with `shared_prefix` common tokens),
    as tensors; `align_at`: its segment starts ("segments") or groups ("roots") aligned to 128-token blocks, padding
    tokens -1."""
    groups = max(1, shape.row_tokens // (shape.prompt + shape.group * shape.completion))
    row = plan_rows(make_samples(shape, groups, 1000, 0, shared_prefix), shape.row_tokens, share=True)[0]
    packed = pack(row)
    if align_at:
        packed = align_blocks(packed, 128, at=align_at, pad_token_id=-1)
    return packed_row_to_tensors(packed, device)


def time_ms(fn, iters: int, device) -> float:
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def run_config(name, options, q, k, v, grad, masks, iters, device):
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()  # each configuration compiles afresh (kernel_options are baked into the graph)
    if name == "varlen":  # FlashAttention over the row's segment plan, eager
        from rlasync.model.segment_attention import segment_attention

        def attention(q, k, v, **_):
            return segment_attention(q, k, v, masks["segments"], None, None).transpose(1, 2)  # as flex returns it

        kwargs = {}
    else:
        mode = "max-autotune-no-cudagraphs" if name == "autotune" else None
        attention = torch.compile(flex_attention, dynamic=False, mode=mode)
        mask = masks[RECTANGULAR.get(name, 64 if name.endswith("block64") else 128)]
        kwargs = {"block_mask": mask, "enable_gqa": q.shape[1] != k.shape[1]}
        if options:
            kwargs["kernel_options"] = options

    def forward():
        with torch.no_grad():
            return attention(q.detach(), k.detach(), v.detach(), **kwargs)

    def forward_backward():
        q.grad = k.grad = v.grad = None
        out = attention(q, k, v, **kwargs)
        out.backward(grad)
        return out

    backward = device.type != "cpu"  # FlexAttention has no CPU backward: the harness runs forward only there
    t0 = time.perf_counter()
    out = forward_backward() if backward else forward()  # compiles
    result = {"options": options, "compile_s": time.perf_counter() - t0}
    result["fwd_ms"] = time_ms(forward, iters, device)
    if not backward:
        return result, out.detach(), []
    result["fwd_bwd_ms"] = time_ms(forward_backward, iters, device)
    out = forward_backward()
    return result, out.detach(), [t.grad.detach().clone() for t in (q, k, v)]


def rectangular_block_mask(subtree_end: torch.Tensor, position_ids: torch.Tensor, q_block: int, kv_block: int):
    """The tree rule's BlockMask (full attention) over `q_block`-query x `kv_block`-key blocks, as
    `rlasync.model.block_mask.tree_block_mask` builds the square one: key block j reaches query block i iff
    j * kv_block <= (i + 1) * q_block - 1 and i * q_block < max subtree_end over the block; full iff every key of j
    precedes every query of i and min subtree_end >= (i + 1) * q_block."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import BlockMask

    from rlasync.model.block_mask import tree_mask_mod

    n = subtree_end.shape[0]
    nq, nk = -(-n // q_block), -(-n // kv_block)
    pad = nk * kv_block - n
    end_max = F.pad(subtree_end, (0, pad), value=0).view(nk, kv_block).amax(1)
    end_min = F.pad(subtree_end, (0, pad), value=n).view(nk, kv_block).amin(1)
    q_lo = torch.arange(nq, device=subtree_end.device)[:, None] * q_block
    k_lo = torch.arange(nk, device=subtree_end.device)[None, :] * kv_block
    nonempty = (k_lo <= q_lo + q_block - 1) & (q_lo < end_max[None, :])
    full = (k_lo + kv_block - 1 <= q_lo) & (q_lo + q_block <= end_min[None, :]) & nonempty
    partial = nonempty & ~full

    def ordered(blocks):
        order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
        return blocks.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=(q_block, kv_block),
        mask_mod=tree_mask_mod(subtree_end, position_ids, None, max(nq * q_block, nk * kv_block)),
        seq_lengths=(n, n),
    )


def block_counts(row) -> dict[str, int]:
    """The row's 128-token FlexAttention blocks (full attention)."""
    partial, full = tree_block_sparsity(row.subtree_end, row.position_ids, None, 128)
    return {"nonempty": int((partial | full).sum()), "full": int(full.sum()), "partial": int(partial.sum())}


def run_aligned(name, shape, args, tensors, pairs, iters, device):
    """Config `name` of ALIGNED: the same q/k/v/grad placed at the aligned row's real positions (zeros on padding),
    the default tiles over its mask; output and gradients read back at the real positions."""
    aligned = first_row(shape, device, args.shared_completion_prefix, ALIGNED[name])
    real = torch.nonzero(aligned.input_ids >= 0).squeeze(1)

    def place(t):
        out = torch.zeros(*t.shape[:2], aligned.num_tokens, t.shape[-1], device=t.device, dtype=t.dtype)
        out[:, :, real] = t.detach()
        return out.requires_grad_(t.requires_grad)

    q, k, v, grad = (place(t) for t in tensors)
    mask = tree_block_mask(aligned.subtree_end, aligned.position_ids, None, 128)
    entry, out, grads = run_config(name, None, q, k, v, grad, {128: mask}, iters, device)
    entry["tokens"] = aligned.num_tokens
    entry["padding"] = int(aligned.num_tokens - real.shape[0])
    entry["computed_over_attended_128"] = computed_pairs(aligned.subtree_end, aligned.position_ids, 128) / pairs
    entry["blocks_128"] = block_counts(aligned)
    return entry, out[:, :, real], [g[:, :, real] for g in grads]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="544x128x8@8192", help="PROMPTxCOMPLETIONxGROUP@ROW_TOKENS")
    parser.add_argument("--configs", default="all", help=f"comma-separated names of {[*SPECIAL, *SWEEP]} or 'all'")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="2 query heads, 1 KV head, head dim 16, a 64x16x4@512 row")
    parser.add_argument(
        "--shared-completion-prefix",
        type=int,
        default=0,
        metavar="K",
        help="a group's completions open with the same K tokens (1: branches of exactly the completion length)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = parse_shapes("64x16x4@512" if args.tiny else args.shape)[0]
    heads, kv_heads, head_dim = (2, 1, 16) if args.tiny else (16, 8, 128)
    # "all": autotune, the slowest to compile, last (a sweep stopped at its time limit keeps the others)
    names = (
        ["default", "block64", *SWEEP, "autotune"]
        if args.configs == "all"
        else [c.strip() for c in args.configs.split(",") if c]
    )
    unknown = [n for n in names if n not in SPECIAL and n not in SWEEP]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {[*SPECIAL, *SWEEP]}")
    if "default" in names:
        names.remove("default")
    names.insert(0, "default")  # the reference the others are checked against

    row = first_row(shape, device, args.shared_completion_prefix)
    n = row.num_tokens
    masks = {b: tree_block_mask(row.subtree_end, row.position_ids, None, b) for b in (64, 128)}
    for blocks in set(RECTANGULAR.values()):
        masks[blocks] = rectangular_block_mask(row.subtree_end, row.position_ids, *blocks)
    masks["segments"] = segment_plan(row.subtree_end.cpu(), row.position_ids.cpu()).to(device)
    pairs = attended_pairs(row.subtree_end)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(h):
        return torch.randn(1, h, n, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    grad = torch.randn(1, heads, n, head_dim, device=device, dtype=dtype, generator=gen)
    fwd_flops = 4 * heads * head_dim * pairs
    results = {
        "benchmark": "flex_tiles",
        "command": " ".join(["python3", "bench/flex_tiles.py", *(argv if argv is not None else sys.argv[1:])]),
        "hardware": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "row": {
            "shape": shape.name,
            "shared_completion_prefix": args.shared_completion_prefix,
            "tokens": n,
            "attended_pairs": pairs,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "dtype": str(dtype).replace("torch.", ""),
            "blocks_128": block_counts(row),
            "computed_over_attended": {
                **{str(b): computed_pairs(row.subtree_end, row.position_ids, b) / pairs for b in (64, 128)},
                **{
                    f"{q}x{k}": int(masks[(q, k)].kv_num_blocks.sum() + masks[(q, k)].full_kv_num_blocks.sum())
                    * q
                    * k
                    / pairs
                    for q, k in set(RECTANGULAR.values())
                },
            },
        },
        "configs": {},
    }
    reference = None
    for name in names:
        options = SWEEP.get(name)
        try:
            if name in ALIGNED:
                entry, out, grads = run_aligned(name, shape, args, (q, k, v, grad), pairs, args.iters, device)
            else:
                entry, out, grads = run_config(name, options, q, k, v, grad, masks, args.iters, device)
        except Exception as exc:  # a tile the kernel refuses (shared memory, divisibility): recorded, next one
            results["configs"][name] = {"options": options, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"{name}: {results['configs'][name]['error']}", flush=True)
            continue
        entry["fwd_tflops"] = fwd_flops / entry["fwd_ms"] / 1e9
        if "fwd_bwd_ms" in entry:
            entry["fwd_bwd_tflops"] = 3 * fwd_flops / entry["fwd_bwd_ms"] / 1e9
        if reference is None:
            reference = (out, grads)
        else:
            entry["max_abs_diff_vs_default"] = max(
                float((a.float() - b.float()).abs().max()) for a, b in zip([reference[0], *reference[1]], [out, *grads])
            )
        results["configs"][name] = entry
        write(results, args.out)  # after each configuration: a sweep stopped at its time limit keeps what it timed
        both = f", fwd+bwd {entry['fwd_bwd_ms']:.2f} ms ({entry['fwd_bwd_tflops']:.0f} TFLOP/s)" if grads else ""
        print(f"{name}: fwd {entry['fwd_ms']:.2f} ms ({entry['fwd_tflops']:.0f} TFLOP/s){both}", flush=True)
    print(json.dumps(write(results, args.out), indent=1))


def write(results: dict, out: str | None) -> dict:
    """`results` with its `best` configuration (by fwd+bwd time on a GPU, forward on a CPU), written to `out`."""
    key = "fwd_bwd_ms" if any("fwd_bwd_ms" in e for e in results["configs"].values()) else "fwd_ms"
    timed = {name: e[key] for name, e in results["configs"].items() if key in e}
    if timed:
        best = min(timed, key=timed.get)
        results["best"] = {
            "name": best,
            key: timed[best],
            "over_default": timed.get("default", 0) / timed[best],
            "options": results["configs"][best]["options"],
        }
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
