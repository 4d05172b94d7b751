"""Does a decoder-layer-like function compiled with dynamic=True recompile when a FlexAttention BlockMask's block
count changes (a new padded row length), and does marking the BlockMask's block dims dynamic before the first call
avoid it? (the learner's second compile on CUDA: guard `masks[None].q_indices size mismatch at index 2`).

    python bench/flex_recompile.py --out bench/results/flex_recompile_h100.json
"""

import argparse
import json
import time

import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from rlasync.model.block_mask import BLOCK_FIELDS, mark_block_dims_dynamic


class Holder:  # as TreeAttention: the row's masks in a dict on an object passed as a keyword
    def __init__(self, block_mask):
        self.masks = {None: block_mask}


def layer(x, *, tree):
    q = x.transpose(1, 2)
    return flex_attention(q, q, q, block_mask=tree.masks[None]).transpose(1, 2).sum(-1)


def causal(b, h, q, k):
    return k <= q


def run(variant: str, lengths: list[int], device: str) -> dict:
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(layer, dynamic=True)
    calls = []
    for n in lengths:
        bm = create_block_mask(causal, 1, 1, n, n, device=device, BLOCK_SIZE=128)
        if variant == "maybe_mark":  # what tree_block_mask does to the learner's masks
            mark_block_dims_dynamic(bm)
        elif variant == "mark":  # strict: Dynamo raises if anything forces the dims static
            for name in BLOCK_FIELDS:
                t = getattr(bm, name)
                if t is not None:
                    for d in range(2, t.dim()):
                        torch._dynamo.mark_dynamic(t, d)
        x = torch.randn(1, n, 8, 64, device=device, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        try:
            fn(x, tree=Holder(bm))
            if device == "cuda":
                torch.cuda.synchronize()
            calls.append({"length": n, "s": time.perf_counter() - t0})
        except Exception as exc:  # noqa: BLE001 - recorded
            calls.append({"length": n, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            break
    return {"calls": calls, "frames": dict(counters["stats"]), "recompiles": dict(counters.get("recompiles", {}))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", default="8192,7680,7168,8192")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = [int(n) for n in args.lengths.split(",")]
    result = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "command": "python bench/flex_recompile.py --out " + args.out,
        "lengths": lengths,
    }
    for variant in ("none", "maybe_mark", "mark"):
        result[variant] = run(variant, lengths, device)
        print(variant, json.dumps(result[variant]), flush=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
