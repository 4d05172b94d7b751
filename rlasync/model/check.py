"""`rlasync check-model MODEL_PATH`: does tree packing reproduce the unpacked log-probs and gradients?

Builds random GRPO groups (shared prompts), multi-turn chains (each turn extends the previous sample) and
unrelated sequences with token ids inside the vocabulary, then compares, on the same weights:
  reference  one sequence at a time through the model's ordinary forward (sdpa, or eager where sdpa cannot run)
  tree       all sequences in one tree-packed row (attn_implementation="rlasync_tree", chunked head)
for the per-completion-token log-probs and for the gradients of a random linear functional of them (divided by
the number of tokens) w.r.t. every parameter. The last line is `max_abs_diff=<max over both>`; the exit code is
0 at or under `--tolerance`, 1 above it, 2 when the architecture is unsupported (or the model cannot be loaded).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

EXIT_OK, EXIT_MISMATCH, EXIT_UNSUPPORTED = 0, 1, 2
# float32: real models land around 1e-5 (SmolLM2-135M: 1.7e-5 on log-probs near -20), rounding in the float32
# RoPE tables and 30 layers of accumulation, not the layout (a one-sample row matches to 1e-7); tiny test models
# stay under 1e-6. A layout bug shows up as differences of order 0.1 and above.
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-1}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlasync check-model",
        description="Compare tree-packed with unpacked log-probs and gradients on random shared-prefix samples.",
    )
    parser.add_argument("model_path", help="a transformers causal LM: local folder or hub id")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=sorted(DEFAULT_TOLERANCE), default="float32")
    parser.add_argument(
        "--tolerance", type=float, default=None, help="max allowed |difference| (default 1e-4 float32, 1e-1 bfloat16)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-length", type=int, default=48, help="upper bound on prompt and completion lengths")
    parser.add_argument(
        "--attention",
        choices=["auto", "dense", "flex", "varlen"],
        default="auto",
        help="the tree attention backend checked (auto: flex on CUDA, dense on the CPU)",
    )
    return parser


def random_sequences(vocab_size: int, seed: int, max_length: int = 48) -> tuple[list[list[int]], list[int]]:
    """(sequences, prompt lengths): two GRPO groups, a three-turn chain, two unrelated sequences, a duplicate."""
    rng = np.random.default_rng(seed)
    top = max(2, max_length)

    def tokens(n: int) -> list[int]:
        return rng.integers(0, vocab_size, n).tolist()

    seqs: list[list[int]] = []
    prompts: list[int] = []
    for _ in range(2):  # GRPO groups
        prompt = tokens(int(rng.integers(2, top)))
        for _ in range(4):
            seqs.append(prompt + tokens(int(rng.integers(1, top))))
            prompts.append(len(prompt))
    turn = tokens(int(rng.integers(2, top)))  # multi-turn chain
    seqs.append(turn + tokens(int(rng.integers(1, top))))
    prompts.append(len(turn))
    for _ in range(2):
        context = seqs[-1] + tokens(int(rng.integers(1, 8)))
        seqs.append(context + tokens(int(rng.integers(1, top))))
        prompts.append(len(context))
    for _ in range(2):  # nothing shared
        length = int(rng.integers(2, 2 * top))
        seqs.append(tokens(length))
        prompts.append(int(rng.integers(1, length)))
    seqs.append(list(seqs[0]))  # an identical duplicate
    prompts.append(prompts[0])
    return seqs, prompts


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from rlasync.model.attention import check_tree_attention_support, enable_tree_attention
    from rlasync.model.loading import resolve_dtype

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[args.dtype]
    try:
        model = _load_reference(args.model_path, resolve_dtype(args.dtype), device)
        check_tree_attention_support(model)
    except (ValueError, OSError) as error:
        print(f"check-model: unsupported model {args.model_path}: {error}", file=sys.stderr)
        print("max_abs_diff=nan")
        return EXIT_UNSUPPORTED
    vocab_size = model.get_output_embeddings().weight.shape[0]
    seqs, prompts = random_sequences(vocab_size, args.seed, args.max_length)
    num_completion = sum(len(s) - p for s, p in zip(seqs, prompts))
    weights = torch.randn(num_completion, generator=torch.Generator().manual_seed(args.seed))

    reference, reference_grads = _logprobs_and_grads(model, seqs, prompts, weights, "none")
    enable_tree_attention(model)  # same weights, now tree attention
    tree, tree_grads = _logprobs_and_grads(model, seqs, prompts, weights, "tree", args.attention)

    logprob_diff = (reference - tree).abs().max().item()
    grad_diff = max((reference_grads[name] - tree_grads[name]).abs().max().item() for name in reference_grads)
    max_diff = max(logprob_diff, grad_diff)
    raw = sum(len(s) for s in seqs)
    unique = _unique_tokens(seqs)
    print(
        f"model: {args.model_path} ({type(model).__name__}, {args.dtype}, {device}), vocab {vocab_size}, "
        f"tree attention {args.attention}"
    )
    print(
        f"samples: {len(seqs)} ({raw} tokens, {len(weights)} completion tokens) in one tree-packed row of {unique} "
        f"tokens (packing ratio {raw / unique:.2f})"
    )
    print(f"log-prob max |diff|: {logprob_diff:.3e}")
    print(f"gradient max |diff| over {len(reference_grads)} parameters: {grad_diff:.3e}")
    print(f"tolerance: {tolerance:.1e} -> {'PASS' if max_diff <= tolerance else 'FAIL'}")
    print(f"max_abs_diff={max_diff:.3e}")
    return EXIT_OK if max_diff <= tolerance else EXIT_MISMATCH


def _unique_tokens(seqs: list[list[int]]) -> int:
    from rlasync.packing import TreeRow
    from rlasync.records import RolloutSample

    row = TreeRow()
    for seq in seqs:
        row.add(RolloutSample(seq, [0] * len(seq), [0.0] * len(seq), advantage=0.0, group_id=0))
    return row.num_tokens


def _load_reference(path: str, dtype: Any, device: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlasync.model.attention import check_layer_types
    from rlasync.model.registry import resolve_model

    path = resolve_model(path)
    config = AutoConfig.from_pretrained(path)
    check_layer_types(config)
    text = config.get_text_config()
    attention = "eager" if getattr(text, "attn_logit_softcapping", None) else None  # None: sdpa where supported
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention)
    return model.to(device).eval()


def _logprobs_and_grads(
    model: Any, seqs: list[list[int]], prompts: list[int], weights: Any, packing: str, backend: str = "auto"
) -> Any:
    import torch

    from rlasync.model.forward import sequence_logprobs

    model.zero_grad(set_to_none=True)
    logprobs = torch.cat(sequence_logprobs(model, seqs, prompts, packing=packing, backend=backend))
    (weights.to(logprobs.device) * logprobs).sum().div(max(1, logprobs.numel())).backward()
    grads = {name: p.grad.float().cpu() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logprobs.detach().float().cpu(), grads


if __name__ == "__main__":
    sys.exit(main())
