"""Where does one tree-packed fwd+bwd spend its time? A profiling aid for bench/tree_packing.py.

Builds one GRPO row of the Qwen3-0.6B shape (prompt 1088, 8 completions of 256 -> 3,143 unique tokens), then
times and profiles fwd+bwd: wall time per step, GPU kernel time per step (busy fraction), kernel count, the
heaviest kernels, and the split between decoder and head.

    python bench/profile_tree_row.py --variant regional      # each decoder layer compiled (the default path)
    python bench/profile_tree_row.py --variant eager
    python bench/profile_tree_row.py --variant regional --no-grad-ckpt

Old against new learner behaviour (docs/algorithms.md §5.5):

    --grad-ckpt all|auto|none|K   which layers are checkpointed (all: the old behaviour; auto: by memory)
    --pad-rows none|bucket|budget  pad the row's unique tokens to a multiple of row_bucket(budget), or to the budget
    --rows K                      cycle K rows of different lengths (shows recompiles; `unique_graphs`)
    --compile-mode MODE           torch.compile mode of the layers (e.g. reduce-overhead: CUDA graphs)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner_shapes import Shape, make_samples, plan_rows, qwen3_06b_config  # noqa: E402

from rlasync.model import packed_row_to_tensors, packed_token_scores, prepare_for_training  # noqa: E402
from rlasync.model.checkpointing import plan_for_model  # noqa: E402
from rlasync.model.row_shapes import pad_row_tensors, padded_length, row_bucket  # noqa: E402
from rlasync.packing import pack  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["eager", "regional", "decoder"], default="regional")
    parser.add_argument("--no-grad-ckpt", action="store_true", help="same as --grad-ckpt none")
    parser.add_argument("--grad-ckpt", default="all", help="all (old behaviour), auto (by memory), none, or K layers")
    parser.add_argument("--pad-rows", choices=["none", "bucket", "budget"], default="none")
    parser.add_argument("--rows", type=int, default=1, help="rows of different lengths, cycled")
    parser.add_argument("--compile-mode", default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--shape", default="1088x256x8@4096")
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 64
    from transformers import AutoModelForCausalLM

    dims, budget = args.shape.split("@")
    p, c, g = (int(x) for x in dims.split("x"))
    config = qwen3_06b_config(28)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda()
    choice = "none" if args.no_grad_ckpt else args.grad_ckpt
    plan = plan_for_model(
        model,
        int(choice) if choice.isdigit() else choice,
        device=torch.device("cuda"),
        tokens=int(budget),
        enabled=choice != "none",
    )
    print(plan.describe(), flush=True)
    model = prepare_for_training(
        model,
        gradient_checkpointing=bool(plan.layers),
        checkpoint_layers=plan.layers,
        compile=args.variant == "regional",
        compile_mode=args.compile_mode,
    )
    if args.variant == "decoder":
        model.get_decoder().compile()
    model.train()
    rows = []
    for j in range(max(1, args.rows)):  # rows of different lengths: completions 7 tokens shorter each
        samples = make_samples(Shape(p, max(1, c - 7 * j), g, int(budget)), 2, config.vocab_size, j)
        rows.append(packed_row_to_tensors(pack(plan_rows(samples, int(budget), share=True)[0]), "cuda"))
    real_tokens = [r.num_tokens for r in rows]
    if args.pad_rows != "none":
        bucket = row_bucket(int(budget)) if args.pad_rows == "bucket" else int(budget)
        rows = [pad_row_tensors(r, padded_length(r.num_tokens, bucket)) for r in rows]
    row = rows[0]
    calls = [0]

    def step() -> None:
        current = rows[calls[0] % len(rows)]
        calls[0] += 1
        scores = packed_token_scores(model, current)
        (-(scores.logprobs * current.advantages).mean()).backward()

    t0 = time.perf_counter()
    for _ in range(max(3, 2 * len(rows))):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / args.steps

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_s = sum(e.device_time for e in events) / 1e6
    by_name: dict[str, float] = {}
    for e in events:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:18]

    # decoder vs head split (eager timing of the head alone on the row's hidden states)
    from rlasync.model import chunked_token_scores

    hidden = torch.randn(row.num_terms, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = model.get_output_embeddings().weight
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        s = chunked_token_scores(hidden, weight, row.target_ids)
        s.logprobs.sum().backward()
    torch.cuda.synchronize()
    head_s = (time.perf_counter() - t) / 3
    out = {
        "variant": args.variant,
        "grad_ckpt": choice,
        "checkpointed_layers": len(plan.layers),
        "activation_estimate_gib": round(plan.estimate_bytes / 2**30, 2),
        "pad_rows": args.pad_rows,
        "compile_mode": args.compile_mode,
        "tokens": row.num_tokens,
        "real_tokens": real_tokens,
        "padded_tokens": [r.num_tokens for r in rows],
        "unique_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        "terms": row.num_terms,
        "warmup_s": round(warm_s, 1),
        "step_ms": round(step_s * 1e3, 1),
        "gpu_busy_ms": round(gpu_s * 1e3, 1),
        "kernels": len(events),
        "head_fwd_bwd_ms": round(head_s * 1e3, 1),
        "trained_tokens_per_s": round(sum(r.num_terms for r in rows) / len(rows) / step_s),
        "top_kernels_ms": [(name[:90], round(ms, 2)) for name, ms in top],
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
