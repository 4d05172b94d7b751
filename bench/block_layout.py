"""FlexAttention's block layout of tree rows, counted on the CPU: nonempty / full / partial mask blocks, with and
without segment starts aligned to the block size by invisible padding (`rlasync.packing.align_blocks`).

FlexAttention computes every nonempty block of its `BlockMask` whole (B x B query-key pairs; the mask evaluated per
element in the partial ones) and skips the empty ones, so its cost follows the nonempty blocks, not the visible
pairs. Per row this counts, exactly as the learner builds the mask (`rlasync.model.block_mask.tree_block_sparsity`
on the packed row): blocks nonempty / full / partial, the visible pairs (the tree rule's real query-key pairs), the
computed pairs (nonempty x B^2) and their ratio (density), the padding an alignment adds, and FLOPs of the Qwen3-0.6B
shape: attention over visible pairs (what MFU counts) and over computed blocks (what the kernel runs), dense layers
over every forwarded token (padding included), the head over trained tokens.

Sample sets per shape (PROMPTxCOMPLETIONxGROUP@ROW, as bench/tree_packing.py):
  bench        bench/tree_packing.py's samples: random prompt and completions, so each branch is completion + 1
               tokens (the trie forwards the prompt's last token once per completion: it predicts a different token)
  shared_first the completions of a group open with the same token, so branches are `completion` tokens long (what
               a trie sharing the prompt's last token would lay out, and what completions opening alike give)
  mix          a realistic mix: prompt lengths uniform in [P/2, 3P/2], completion lengths uniform in [C/4, 7C/4]
               per sample, in three branch orders (as sampled, longest first, shortest first)
Layouts: none; `roots` (each group starts on a block boundary); `segments` (every branch and group starts on one);
`segments_pad<=X` (only the starts that need at most X padding tokens). Per set also `rectangular_blocks_none`: the
rows as packed under unequal query x key blocks (128x64, 64x128). `summary`: per shape and set, each layout's blocks,
padding and ratios at the first --blocks size.

A time model, stated as one: attention time proportional to the nonempty blocks, everything else to the forwarded
tokens, with `--attention-share` of a row's time in attention (0.38: the 8K profile of 2026-12-04,
bench/results/profiles/tree_p544_c128_g8_row8192_full_2026_12_04.txt). It ignores what a partial block costs over a
full one (the mask evaluated per element), which only the GPU can tell (bench/tree_packing.py --block-align).

    python bench/block_layout.py --out bench/results/block_layout_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner_shapes import Shape, make_samples, model_config, parse_shapes, plan_rows  # noqa: E402

from rlasync.model.block_mask import tree_block_sparsity  # noqa: E402
from rlasync.packing import align_blocks, pack  # noqa: E402
from rlasync.rollout import RolloutSample  # noqa: E402

SETS = ("bench", "shared_first", "mix")
ORDERS = ("as_sampled", "longest_first", "shortest_first")


def mixed_samples(shape: Shape, num_groups: int, vocab: int, seed: int, order: str) -> list[RolloutSample]:
    """GRPO groups with prompt lengths uniform in [P/2, 3P/2] and completion lengths uniform in [C/4, 7C/4], each
    group's completions in `order` (the trie lays a group's branches out in the order they were added)."""
    rng = np.random.default_rng(seed)
    samples = []
    for group in range(num_groups):
        prompt = rng.integers(0, vocab, int(rng.integers(shape.prompt // 2, 3 * shape.prompt // 2 + 1)))
        lengths = rng.integers(max(1, shape.completion // 4), 7 * shape.completion // 4 + 1, shape.group)
        if order == "longest_first":
            lengths = np.sort(lengths)[::-1]
        elif order == "shortest_first":
            lengths = np.sort(lengths)
        for length in lengths.tolist():
            ids = np.concatenate([prompt, rng.integers(0, vocab, length)])
            mask = np.concatenate([np.zeros(len(prompt), np.int8), np.ones(length, np.int8)])
            lps = np.where(mask == 1, -rng.random(len(ids)), 0.0).astype(np.float32)
            samples.append(RolloutSample(ids, mask, lps, advantage=float(rng.normal()), group_id=group))
    return samples


def layouts(block_size: int) -> dict[str, dict]:
    """Layout name -> `align_blocks` keyword arguments (None: the row as packed)."""
    quarter = block_size // 4
    return {
        "none": None,
        "roots": {"at": "roots"},
        "segments": {"at": "segments"},
        f"segments_pad<={quarter}": {"at": "segments", "max_pad": quarter},
    }


def block_counts(packed, block_size: int, real: np.ndarray | None = None) -> dict[str, int]:
    """One packed row's FlexAttention block counts (full attention), as `tree_block_mask` builds them; the pairs a
    block computes beyond the real tokens' visible ones (`real`: [N] bool, False on padding; None: no padding) are
    its waste."""
    partial, full = tree_block_sparsity(
        torch.as_tensor(packed.subtree_end), torch.as_tensor(packed.position_ids), None, block_size
    )
    nonempty = (partial | full).numpy()
    pairs = block_pairs(packed.subtree_end, block_size, real=real)
    wasted = np.where(nonempty, block_size**2 - pairs, 0)
    diagonal = np.eye(nonempty.shape[0], dtype=bool)
    return {
        "nonempty": int(nonempty.sum()),
        "full": int(full.sum()),
        "partial": int(partial.sum()),
        "diagonal": int((nonempty & diagonal).sum()),
        "wasted_pairs_diagonal": int(wasted[diagonal].sum()),
        "wasted_pairs_off_diagonal": int(wasted[~diagonal].sum()),
    }


def block_pairs(
    subtree_end: np.ndarray, block_size: int, key_block_size: int | None = None, real: np.ndarray | None = None
) -> np.ndarray:
    """[nq, nk] int64 visible pairs per (query block, key block) (key blocks of `key_block_size`, default the same):
    key k is seen by the queries [k, subtree_end[k]). With `real` ([N] bool), only pairs of two real tokens count."""
    key_block_size = key_block_size or block_size
    n = subtree_end.shape[0]
    real = np.ones(n, dtype=bool) if real is None else real
    before = np.concatenate([[0], np.cumsum(real)])  # before[x]: real tokens among the first x
    num_q, num_k = -(-n // block_size), -(-n // key_block_size)
    keys = np.arange(n)
    lo = np.arange(num_q) * block_size  # query block i holds queries [lo_i, lo_i + B)
    upper = np.minimum(subtree_end[:, None], np.minimum(lo + block_size, n)[None, :])
    lower = np.maximum(keys[:, None], lo)
    per_key = np.where(upper > lower, before[upper] - before[np.minimum(lower, n)], 0) * real[:, None]  # [N, nq]
    padded = np.zeros((num_k * key_block_size, num_q), dtype=np.int64)
    padded[:n] = per_key
    return padded.reshape(num_k, key_block_size, num_q).sum(1).T  # [query block, key block]


def rectangular(rows, shapes: list[tuple[int, int]]) -> dict:
    """Per (query block, key block) size, the rows' nonempty blocks and density as packed (no padding): what a
    BlockMask of unequal query and key blocks would compute (FlexAttention takes BLOCK_SIZE=(Q, KV); the kernel's
    tiles must divide them)."""
    out = {}
    for q, k in shapes:
        nonempty = visible = 0
        for row in rows:
            packed = pack(row)
            nonempty += int((block_pairs(packed.subtree_end, q, k) > 0).sum())
            visible += packed.load
        out[f"{q}x{k}"] = {"nonempty": nonempty / len(rows), "density": visible / (nonempty * q * k)}
    return out


def row_counts(rows, block_size: int, align: dict | None) -> dict:
    """Counts summed over `rows` (TreeRows) laid out with `align` (None: as packed)."""
    totals = {"tokens": 0, "padding": 0, "visible_pairs": 0, "trained": 0}
    for row in rows:
        packed = pack(row)
        aligned = packed if align is None else align_blocks(packed, block_size, **align, pad_token_id=-1)
        counts = block_counts(aligned, block_size, real=aligned.input_ids >= 0)
        totals["tokens"] += packed.num_tokens
        totals["padding"] += aligned.num_tokens - packed.num_tokens
        totals["visible_pairs"] += packed.load
        totals["trained"] += packed.num_trained_tokens
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
    return totals


def flops(totals: dict, block_size: int, config) -> dict[str, float]:
    """FLOPs (fwd + bwd) of the rows: dense layers per forwarded token (padding included), head per trained token,
    attention per visible pair (what MFU counts) and per computed pair (what the kernel runs)."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    layer_params = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * inter
    per_pair = 12 * q_dim * layers  # QK^T and PV, forward (x1) and backward (x2)
    dense_real = 6 * layer_params * layers * totals["tokens"]
    dense_all = 6 * layer_params * layers * (totals["tokens"] + totals["padding"])
    head = 6 * h * config.vocab_size * totals["trained"]
    attention_visible = per_pair * totals["visible_pairs"]
    attention_computed = per_pair * totals["nonempty"] * block_size**2
    return {
        "model_flops": float(dense_real + head + attention_visible),
        "computed_flops": float(dense_all + head + attention_computed),
        "attention_visible_flops": float(attention_visible),
        "attention_computed_flops": float(attention_computed),
    }


def summarise(totals: dict, base: dict, block_size: int, config, attention_share: float) -> dict:
    rows = totals.pop("rows")
    out = {
        **{key: value / rows for key, value in totals.items()},  # per row
        "padding_frac": totals["padding"] / totals["tokens"],
        "density": totals["visible_pairs"] / (totals["nonempty"] * block_size**2),
        "full_frac_of_nonempty": totals["full"] / max(1, totals["nonempty"]),
        "wasted_share_diagonal": totals["wasted_pairs_diagonal"] / (totals["nonempty"] * block_size**2),
        "wasted_share_off_diagonal": totals["wasted_pairs_off_diagonal"] / (totals["nonempty"] * block_size**2),
        **{key: value / rows for key, value in flops(totals, block_size, config).items()},
    }
    out["computed_over_model_flops"] = out["computed_flops"] / out["model_flops"]
    if base is not None:
        out["nonempty_vs_none"] = totals["nonempty"] / base["nonempty"]
        out["partial_vs_none"] = totals["partial"] / max(1, base["partial"])
        out["computed_flops_vs_none"] = out["computed_flops"] / (
            flops(base, block_size, config)["computed_flops"] / base["rows"]
        )
        tokens = (totals["tokens"] + totals["padding"]) / (base["tokens"] + base["padding"])
        out["model_row_time_vs_none"] = (
            attention_share * totals["nonempty"] / base["nonempty"] + (1 - attention_share) * tokens
        )
    return out


def measure(shape: Shape, sample_set: str, order: str, args, config) -> dict:
    if sample_set == "mix":
        samples = mixed_samples(shape, args.groups, config.vocab_size, args.seed, order)
    else:
        shared = 1 if sample_set == "shared_first" else 0
        samples = make_samples(shape, args.groups, config.vocab_size, args.seed, shared_prefix=shared)
    rows = plan_rows(samples, shape.row_tokens, share=True)
    result: dict = {"rows": len(rows), "samples": len(samples), "blocks": {}}
    for block_size in args.blocks:
        per_layout = {}
        base = None
        for name, align in layouts(block_size).items():
            totals = row_counts(rows, block_size, align)
            totals["rows"] = len(rows)
            if base is None:
                base = dict(totals)
            per_layout[name] = summarise(
                dict(totals), base if name != "none" else None, block_size, config, args.attention_share
            )
        result["blocks"][str(block_size)] = per_layout
    result["rectangular_blocks_none"] = rectangular(rows, [(128, 128), (128, 64), (64, 128), (64, 64)])
    return result


def summary(results: dict, block_size: int) -> dict:
    """Per shape and sample set, at `block_size`: each layout's blocks per row, padding and ratios to none."""
    out: dict = {}
    keys = ("nonempty", "partial", "padding_frac", "density", "nonempty_vs_none", "partial_vs_none")
    for shape, sets in results["shapes"].items():
        for name, entry in sets.items():
            layouts_at = entry["blocks"].get(str(block_size), {})
            out[f"{shape}/{name}"] = {
                layout: {key: round(r[key], 4) for key in (*keys, "model_row_time_vs_none") if key in r}
                for layout, r in layouts_at.items()
            }
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="544x128x8@8192,1088x256x8@4096", help="PROMPTxCOMPLETIONxGROUP@ROW,...")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated subset of {', '.join(SETS)}")
    parser.add_argument("--blocks", default="128,64", help="mask block sizes to count (128: the learner's)")
    parser.add_argument("--groups", type=int, default=40, help="GRPO groups per shape (40: the full-row runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--attention-share", type=float, default=0.38, help="share of a row's time in attention, for the time model"
    )
    parser.add_argument("--out", default=None, help="write the JSON here (e.g. bench/results/block_layout_cpu.json)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    shapes = parse_shapes(args.shapes)
    sets = args.sets.split(",")
    unknown = sorted(set(sets) - set(SETS))
    if unknown:
        raise SystemExit(f"--sets: unknown {unknown}; choose from {', '.join(SETS)}")
    try:
        args.blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        raise SystemExit(f"--blocks: {args.blocks!r} is not a comma-separated list of integers (e.g. 128,64)") from None
    config = model_config(28)
    started = time.perf_counter()
    results: dict = {
        "benchmark": "block_layout",
        "command": " ".join(["python", *sys.argv])
        if argv is None
        else " ".join(["python bench/block_layout.py", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "hardware": f"CPU ({platform.machine()}): counts, no timing",
        "model_shape": "Qwen3-0.6B (FLOPs only)",
        "attention_share_assumed": args.attention_share,
        "shapes": {},
    }
    for shape in shapes:
        entry: dict = {}
        for sample_set in sets:
            for order in ORDERS if sample_set == "mix" else ("as_sampled",):
                key = sample_set if sample_set != "mix" else f"mix_{order}"
                entry[key] = measure(shape, sample_set, order, args, config)
                base = entry[key]["blocks"][str(args.blocks[0])]
                print(
                    shape.name,
                    key,
                    " ".join(
                        f"{name}: nonempty {r['nonempty']:.1f} partial {r['partial']:.1f} pad {r['padding']:.0f} "
                        f"time {r.get('model_row_time_vs_none', 1.0):.3f}"
                        for name, r in base.items()
                    ),
                    flush=True,
                )
        results["shapes"][shape.name] = entry
    results["summary"] = summary(results, args.blocks[0])
    results["seconds"] = time.perf_counter() - started
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"done in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
