"""The compiled sampler's top-N log-probs on CUDA: the Triton kernel (`top_n_kernel=True`, the default on CUDA) against
the topk over the whole vocabulary's int64 keys (`top_n_kernel=False`, what ran before), and against no log-probs.

One call of `sample_compiled` on [rows, vocab] bf16 logits (Qwen3's vocabulary), temperature 1, a seed per row, as the
engine samples at 256 concurrent requests; GPU milliseconds per call (CUDA events around `--calls` calls), the three
modes alternated `--rounds` times (medians), and whether both top-N paths give the same ids and log-probs.

    python3 bench/sampler_top_n.py --out $OUT        # GPU: $OUT/sampler_top_n_<gpu>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlasync.engine.base import SamplingParams  # noqa: E402
from rlasync.engine.sampler import BatchSampling  # noqa: E402
from rlasync.engine.sampler_compiled import sample_compiled  # noqa: E402

MODES = {"logprobs0": (0, None), "logprobs8_keys": (8, False), "logprobs8_kernel": (8, True)}


def gpu_ms(logits: torch.Tensor, batch: BatchSampling, steps: torch.Tensor, kernel: bool | None, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        sample_compiled(logits, batch, steps, return_candidates=False, top_n_kernel=kernel)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sampler_top_n: needs a CUDA GPU", file=sys.stderr)
        return 2
    logits = (torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    logits = logits.cuda()
    steps = torch.arange(args.rows, device="cuda")
    seeds = [random.Random(i).getrandbits(63) for i in range(args.rows)]
    batches = {
        name: BatchSampling.from_params(
            [SamplingParams(temperature=1.0, num_logprobs=n) for _ in range(args.rows)], seeds, "cuda"
        )
        for name, (n, _) in MODES.items()
    }
    results = {name: sample_compiled(logits, batches[name], steps, top_n_kernel=k) for name, (_, k) in MODES.items()}
    keys, kernel = results["logprobs8_keys"], results["logprobs8_kernel"]
    same_ids = torch.equal(keys.topn_ids, kernel.topn_ids) and torch.equal(keys.token_ids, kernel.token_ids)
    lp_gap = (keys.topn_logprobs - kernel.topn_logprobs).abs().max().item()
    runs: dict[str, list[float]] = {name: [] for name in MODES}
    for _ in range(args.rounds):
        for name, (_, k) in MODES.items():
            runs[name].append(gpu_ms(logits, batches[name], steps, k, args.calls))
    ms = {name: statistics.median(values) for name, values in runs.items()}
    gpu = torch.cuda.get_device_name()
    out = {
        "what": __doc__.splitlines()[0],
        "command": "python3 " + " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": gpu,
        "torch": torch.__version__,
        "shape": [args.rows, args.vocab],
        "ms_per_call": ms,
        "runs_ms": runs,
        "top_n_ms_keys": ms["logprobs8_keys"] - ms["logprobs0"],
        "top_n_ms_kernel": ms["logprobs8_kernel"] - ms["logprobs0"],
        "same_ids": same_ids,
        "topn_logprob_max_gap": lp_gap,
    }
    tag = "h200" if "H200" in gpu else "h100" if "H100" in gpu else "gpu"
    path = os.path.join(args.out, f"sampler_top_n_{tag}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: out[k] for k in ("ms_per_call", "top_n_ms_keys", "top_n_ms_kernel", "same_ids")}))
    return 0 if same_ids else 1


if __name__ == "__main__":
    sys.exit(main())
