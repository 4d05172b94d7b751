"""Both engines on one GPU, one after the other: vLLM 0.25 (in-process AsyncLLM), then the built-in TorchEngine.

256 prompts x 256 tokens, 256 new tokens, EOS ignored: per-request seeds (as training sends them) without and with
logprobs=8, and (vLLM) without seeds (bench/engine_throughput.py's shape); the TorchEngine on the same shape after vLLM
has exited. The model folder and the run: bench/vllm_common.py.

    python3 bench/vllm_throughput.py --out $OUT --engine-mode default   # GPU, vLLM kit on PYTHONPATH
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_common import (  # noqa: E402
    Run,
    build_model,
    common_parser,
    free_gpu,
    generate_all,
    random_prompts,
    run_check,
    start_vllm,
)

from rlasync.engine import SamplingParams  # noqa: E402

WHAT = "vLLM 0.25 and the TorchEngine on one GPU, 256 x 256 -> 256 new tokens, one after the other"


async def warm_up(engine, prompts) -> None:
    """Short seeded runs with and without 8 log-probs, at two batch sizes, before anything is timed: the engine's
    compiled pieces (the TorchEngine's sampler compiles once per variant, then once more for a dynamic batch size)
    are built here, as vLLM's are at its start-up."""
    for logprobs in (0, 8):
        for count in (32, 7):
            params = [
                SamplingParams(max_tokens=16, ignore_eos=True, seed=i, num_logprobs=logprobs) for i in range(count)
            ]
            await generate_all(engine, prompts[:count], params)


async def phase_throughput(ctx: dict[str, Any]) -> dict[str, Any]:
    args, engine = ctx["args"], ctx["engine"]
    vocab = ctx["model"]["vocab_size"]
    n, plen, new = args.concurrency, args.prompt_len, args.new_tokens
    prompts = random_prompts(n, plen, vocab, seed=11)
    await warm_up(engine, prompts)
    result: dict[str, Any] = {"requests": n, "prompt_len": plen, "new_tokens": new}
    for label, logprobs, seeds in (("seeded", 0, True), ("seeded_logprobs8", 8, True), ("unseeded", 0, False)):
        engine.use_request_seeds = seeds
        params = [
            SamplingParams(
                max_tokens=new, temperature=1.0, ignore_eos=True, num_logprobs=logprobs, seed=i if seeds else None
            )
            for i in range(n)
        ]
        before = engine.stats().num_preemptions
        t0 = time.perf_counter()
        turns = await generate_all(engine, prompts, params)
        elapsed = time.perf_counter() - t0
        generated = sum(len(t.output_ids) for t in turns)
        result[label] = {
            "seconds": elapsed,
            "new_tokens": generated,
            "new_tokens_per_s": generated / elapsed,
            "preemptions": engine.stats().num_preemptions - before,
        }
    engine.use_request_seeds = True
    ctx["run"].result["summary"]["vllm_new_tokens_per_s (256x256, seeded / +logprobs8 / unseeded)"] = [
        round(result[k]["new_tokens_per_s"]) for k in ("seeded", "seeded_logprobs8", "unseeded")
    ]
    return result


async def phase_torch_engine(ctx: dict[str, Any]) -> dict[str, Any]:
    from rlasync.engine import TorchEngine

    args = ctx["args"]
    vocab = ctx["model"]["vocab_size"]
    t0 = time.perf_counter()
    engine = TorchEngine(
        ctx["model"]["path"],
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=256,
    )
    result: dict[str, Any] = {"startup_s": time.perf_counter() - t0}
    n, plen, new = args.concurrency, args.prompt_len, args.new_tokens
    prompts = random_prompts(n, plen, vocab, seed=11)
    try:
        await warm_up(engine, prompts)
        for label, logprobs in (("seeded", 0), ("seeded_logprobs8", 8)):
            params = [
                SamplingParams(max_tokens=new, temperature=1.0, ignore_eos=True, num_logprobs=logprobs, seed=i)
                for i in range(n)
            ]
            t1 = time.perf_counter()
            turns = await generate_all(engine, prompts, params)
            elapsed = time.perf_counter() - t1
            generated = sum(len(t.output_ids) for t in turns)
            result[label] = {"seconds": elapsed, "new_tokens": generated, "new_tokens_per_s": generated / elapsed}
    finally:
        await engine.close()
    ctx["run"].result["summary"]["torch_engine_new_tokens_per_s (256x256, seeded / +logprobs8)"] = [
        round(result[k]["new_tokens_per_s"]) for k in ("seeded", "seeded_logprobs8") if k in result
    ]
    return result


async def main_gpu(run: Run) -> None:
    ctx: dict[str, Any] = {"args": run.args, "run": run}
    ctx["model"] = await build_model(run)
    if ctx["model"] is None:
        return
    if await start_vllm(run, ctx):
        try:
            await run.phase("throughput", phase_throughput, ctx)
        finally:
            await ctx.pop("engine").close()
        free_gpu()
        await asyncio.sleep(2)
    if not run.args.skip_torch_engine:
        await run.phase("torch_engine", phase_torch_engine, ctx)


def build_parser() -> argparse.ArgumentParser:
    parser = common_parser(__doc__.splitlines()[0], "vllm_throughput.json")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--skip-torch-engine", action="store_true", help="vLLM alone")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_check(build_parser().parse_args(argv), "vllm_throughput", WHAT, main_gpu)


if __name__ == "__main__":
    sys.exit(main())
