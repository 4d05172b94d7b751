"""The chunked LM head alone: forward + backward time per call, at the Qwen3-0.6B head shape on CUDA.

Shape: hidden 1024, vocab 151936, a tied bf16 head weight that trains (its gradient is computed), M loss terms
(2k, 4k, 8k), with and without the sampler's top-K extra ids (K=8) and candidate sets (C=32, every term
renormalising). Each variant is a setting of `chunked_token_scores`:

  recompute   the logits recomputed in backward, the former default chunk (min(4096, 2^27 // V) terms)
  keep        the same chunks, the raw logits kept from forward to backward
  one_chunk   kept logits and one chunk for all M terms (one dW matmul, no float32 accumulator pass)
  default     the library's defaults on this device (chunks and kept logits sized by free memory)
  baseline    with --baseline FILE: that file's chunked_token_scores (e.g. the head before this change:
              git show 8f3cc5a:rlasync/model/head.py > /tmp/head_before.py), at its own defaults

The loss touches the log-probs, the entropy and the extra log-probs. Reported per case: ms per fwd+bwd (median of
--iters), terms/s, peak CUDA memory, the max |Δ| of the log-probs and the max |Δ| of the weight gradient over its
max |value|, against the first variant (recompute). `--tiny` shrinks the shape (hidden 64, vocab 4096, M 256..1024) for a CPU check.

    python bench/head_bench.py --out bench/results/head_bench_h200.json
    python bench/head_bench.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlasync.model.head import CHUNK_ELEMENTS, chunked_token_scores  # noqa: E402

VARIANTS = ("recompute", "keep", "one_chunk", "default")


def make_case(device, dtype, hidden_size, vocab, num_terms, top_k, num_candidates, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = (torch.randn(num_terms, hidden_size, generator=g) * 2).to(device, dtype).requires_grad_(True)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.05).to(device, dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (num_terms,), generator=g).to(device)
    extra = candidates = None
    if top_k:
        extra = torch.randint(0, vocab, (num_terms, top_k), generator=g).to(device)
        extra[:, 0] = targets
    if num_candidates:
        candidates = torch.randint(0, vocab, (num_terms, num_candidates), generator=g).to(device)
        candidates[:, 0] = targets
        if extra is not None:
            candidates[:, 1 : 1 + top_k] = extra
    return hidden, weight, targets, extra, candidates


def run_variant(score, case, kwargs):
    hidden, weight, targets, extra, candidates = case
    hidden.grad = weight.grad = None
    scores = score(hidden, weight, targets, extra_ids=extra, candidate_ids=candidates, **kwargs)
    loss = torch.where(torch.isfinite(scores.logprobs), scores.logprobs, 0.0).sum() + 0.01 * scores.entropy.sum()
    if scores.extra_logprobs is not None:
        loss = loss + torch.where(torch.isfinite(scores.extra_logprobs), scores.extra_logprobs, 0.0).sum() * 0.1
    loss.backward()
    return scores.logprobs.detach(), weight.grad


def time_variant(score, case, kwargs, device, warmup, iters):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        run_variant(score, case, kwargs)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        logprobs, grad_weight = run_variant(score, case, kwargs)
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return statistics.median(times), peak, logprobs, grad_weight.float()


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("head_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.chunked_token_scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="hidden 64, vocab 4096, M 256..1024 (a CPU check)")
    parser.add_argument("--terms", type=int, nargs="*", help="M values (default 2048 4096 8192; tiny 256 512 1024)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--no-compile", action="store_true", help="eager dense passes (compile_kernels=False)")
    parser.add_argument("--baseline", help="a head module file to time as the 'baseline' variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", help="write the results JSON here")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    hidden_size, vocab = (64, 4096) if args.tiny else (1024, 151936)
    terms = args.terms or ([256, 512, 1024] if args.tiny else [2048, 4096, 8192])
    legacy_chunk = max(1, min(4096, CHUNK_ELEMENTS // vocab))
    if args.tiny:
        legacy_chunk = 128  # several chunks per call, as at the real shape
    compile_kernels = False if args.no_compile else None
    big = 1 << 62
    settings = {
        "recompute": dict(chunk_size=legacy_chunk, keep_logits_bytes=0, compile_kernels=compile_kernels),
        "keep": dict(chunk_size=legacy_chunk, keep_logits_bytes=big, compile_kernels=compile_kernels),
        "one_chunk": dict(chunk_bytes=big, keep_logits_bytes=big, compile_kernels=compile_kernels),
        "default": dict(compile_kernels=compile_kernels),
    }
    scorers = dict.fromkeys(VARIANTS, chunked_token_scores)
    if args.baseline:
        scorers["baseline"] = load_baseline(args.baseline)
        settings["baseline"] = dict(chunk_size=legacy_chunk) if args.tiny else {}
    results = []
    for num_terms in terms:
        for top_k, num_candidates in ((0, 0), (8, 0), (8, 32)):
            case = make_case(device, dtype, hidden_size, vocab, num_terms, top_k, num_candidates)
            row = {"terms": num_terms, "top_k": top_k, "candidates": num_candidates, "variants": {}}
            reference = None
            for name, kwargs in settings.items():
                seconds, peak, logprobs, grad_weight = time_variant(
                    scorers[name], case, kwargs, device, args.warmup, args.iters
                )
                entry = {"ms": round(seconds * 1e3, 2), "terms_per_s": round(num_terms / seconds)}
                if peak is not None:
                    entry["peak_gib"] = round(peak, 2)
                if reference is None:
                    reference = (logprobs, grad_weight)
                else:
                    finite = torch.isfinite(reference[0])
                    entry["max_abs_dlogprob"] = float((logprobs - reference[0])[finite].abs().max())
                    scale = float(reference[1].abs().max()) or 1.0
                    entry["max_rel_dgrad_weight"] = float((grad_weight - reference[1]).abs().max()) / scale
                    entry["speedup_vs_recompute"] = round(row["variants"]["recompute"]["ms"] / entry["ms"], 2)
                row["variants"][name] = entry
            print(json.dumps(row), flush=True)
            results.append(row)
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "shape": {"hidden": hidden_size, "vocab": vocab, "dtype": args.dtype, "tied": True},
        "legacy_chunk": legacy_chunk,
        "compile_kernels": not args.no_compile and device.type == "cuda",
        "results": results,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
