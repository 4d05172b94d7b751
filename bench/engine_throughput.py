"""Built-in engine throughput vs transformers `generate`, same prompts, same GPU, one run.

Qwen3-0.6B shape (hidden 1024, 28 layers, 16 heads, 8 KV heads, head dim 128, intermediate 3072, vocab 151936,
tied) with random bf16 weights; prompts of `--prompt-len` random tokens; `--new-tokens` new tokens per request with
EOS ignored; at each concurrency in `--concurrency` (all requests submitted at once). Measured: new tokens/s of
the TorchEngine (sampling at T=1, and again with `num_logprobs=8` for the top-N cost) and of `generate` (sampling,
batch = concurrency, the same prompts).

    python bench/engine_throughput.py --out bench/results/engine_throughput_h200.json
    python bench/engine_throughput.py --device cpu --tiny --concurrency 8 --new-tokens 16   # smoke test
    python bench/engine_throughput.py --async-scheduling compare --no-hf   # async scheduling on vs off, same engine
    python bench/engine_throughput.py --compiled-sampler compare --no-hf   # eager vs torch.compile'd sampler
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlasync.engine import SamplingParams, TorchEngine  # noqa: E402


def qwen3_06b_config(tiny: bool):
    from transformers import Qwen3Config

    if tiny:
        return Qwen3Config(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=512,
            tie_word_embeddings=True,
        )
    return Qwen3Config(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def engine_run(engine: TorchEngine, prompts: list[list[int]], new_tokens: int, num_logprobs: int) -> dict:
    params = [
        SamplingParams(max_tokens=new_tokens, temperature=1.0, ignore_eos=True, num_logprobs=num_logprobs, seed=i)
        for i in range(len(prompts))
    ]
    start = time.perf_counter()
    outputs = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))
    elapsed = time.perf_counter() - start
    generated = sum(len(o.output_ids) for o in outputs)
    stats = engine.stats()
    return {
        "seconds": elapsed,
        "new_tokens": generated,
        "new_tokens_per_s": generated / elapsed,
        "preemptions_total": stats.num_preemptions,
    }


def hf_generate_run(model, prompts: list[list[int]], new_tokens: int, device: str) -> dict:
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0)
    model.generate(ids[:, :8], max_new_tokens=2, do_sample=True)  # warm-up
    _sync(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    _sync(device)
    elapsed = time.perf_counter() - start
    generated = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"seconds": elapsed, "new_tokens": generated, "new_tokens_per_s": generated / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument(
        "--group-size",
        type=int,
        default=8,
        help="also run the top concurrency as groups of this many requests per prompt (1 = skip)",
    )
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "varlen", "reference"])
    parser.add_argument(
        "--async-scheduling",
        default="default",
        choices=["default", "on", "off", "compare"],
        help="the engine's async_scheduling (default: the engine's, on for CUDA); compare: run the engine suite "
        "with it off then on, keys suffixed _sync / _async, and async_over_sync_c<N> ratios",
    )
    parser.add_argument(
        "--compiled-sampler",
        default="default",
        choices=["default", "on", "off", "compare"],
        help="the engine's compiled_sampler (default: the engine's, on for CUDA); compare: run the engine suite "
        "eager then compiled, keys suffixed _eager / _compiled, and compiled_over_eager_c<N> ratios",
    )
    parser.add_argument(
        "--compiled-layers",
        action="store_true",
        help="the engine's compiled_layers (each decoder layer compiled by inductor before the CUDA graphs)",
    )
    parser.add_argument(
        "--unfused-layers",
        action="store_true",
        help="the engine's fused_layers off: transformers' eager layers (the default on CUDA fuses their elementwise work)",
    )
    parser.add_argument("--profile", default=None, help="write torch.profiler tables of a short run to this folder")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.async_scheduling == "compare" and args.compiled_sampler == "compare":
        parser.error("--async-scheduling compare and --compiled-sampler compare: compare one at a time")

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = qwen3_06b_config(args.tiny)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts_all = torch.randint(0, config.vocab_size, (max(levels), args.prompt_len)).tolist()
    max_len = args.prompt_len + args.new_tokens
    results: dict = {
        "benchmark": "engine_throughput",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "hardware": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model_shape": "tiny Qwen3" if args.tiny else "Qwen3-0.6B (random bf16 weights)",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "runs": {},
    }
    import transformers

    results["transformers"] = transformers.__version__
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(args.device).eval()
    hf_model = None if args.no_hf else AutoModelForCausalLM.from_config(config, dtype=dtype).to(args.device).eval()
    engine = TorchEngine(
        model,
        device=args.device,
        max_model_len=max_len,
        kv_cache_tokens=max(levels) * max_len + 4096,
        max_num_seqs=max(levels),
        cuda_graphs=not args.no_cuda_graphs,
        attention_backend=args.attention_backend,
        async_scheduling={"on": True, "off": False}.get(args.async_scheduling),
        compiled_sampler={"on": True, "off": False}.get(args.compiled_sampler),
        compiled_layers=args.compiled_layers,
        fused_layers=False if args.unfused_layers else None,
    )
    modes = {"compare": [("_sync", False), ("_async", True)]}.get(args.async_scheduling, [("", None)])
    sampler_modes = {"compare": [("_eager", False), ("_compiled", True)]}.get(args.compiled_sampler, [("", None)])
    runner = engine.runner_info()
    results["attention_backend"] = runner["attention_backend"]
    results["cuda_graphs"] = runner["cuda_graphs"]
    results["compiled_layers"] = runner["compiled_layers"]
    results["fused_layers"] = runner["fused_layers"]
    results["async_scheduling"] = (
        args.async_scheduling if args.async_scheduling == "compare" else engine.async_scheduling
    )
    results["compiled_sampler"] = (
        args.compiled_sampler if args.compiled_sampler == "compare" else runner["compiled_sampler"]
    )
    print(f"attention backend {results['attention_backend']}, CUDA graphs {results['cuda_graphs']}", flush=True)

    async def engine_suite(tag: str) -> None:
        await engine_run(engine, prompts_all[: min(8, len(prompts_all))], 8, 0)  # warm-up (graphs, kernels)
        if engine.runner_info()["compiled_sampler"]:  # compile the suite's other sampler variant (8 log-probs) too
            await engine_run(engine, prompts_all[: min(8, len(prompts_all))], 8, 8)
        for level in levels:
            prompts = prompts_all[:level]
            plain = await engine_run(engine, prompts, args.new_tokens, 0)
            topn = await engine_run(engine, prompts, args.new_tokens, 8)
            results["runs"][f"engine{tag}_c{level}"] = plain
            results["runs"][f"engine{tag}_c{level}_logprobs8"] = topn
            results[f"engine{tag}_c{level}_new_tokens_per_s"] = plain["new_tokens_per_s"]
            results[f"engine{tag}_c{level}_logprobs8_cost_frac"] = (
                1 - topn["new_tokens_per_s"] / plain["new_tokens_per_s"]
            )
            print(
                f"engine{tag} c={level}: {plain['new_tokens_per_s']:.0f} new tok/s; with 8 logprobs "
                f"{topn['new_tokens_per_s']:.0f}",
                flush=True,
            )
            _write(args.out, results)
        if 1 < args.group_size <= max(levels):  # GRPO-shaped: groups on one prompt (prefix caching shares its prefill)
            level = max(levels)
            grouped = [p for p in prompts_all[: level // args.group_size] for _ in range(args.group_size)]
            run = await engine_run(engine, grouped, args.new_tokens, 0)
            key = f"engine{tag}_c{len(grouped)}_groups_of_{args.group_size}"
            run["prefix_cache_hit_tokens_total"] = engine.stats().extra.get("prefix_cache_hit_tokens")
            results["runs"][key] = run
            results[f"{key}_new_tokens_per_s"] = run["new_tokens_per_s"]
            print(f"{key}: {run['new_tokens_per_s']:.0f} new tok/s", flush=True)
            _write(args.out, results)

    for tag, mode in modes:
        if mode is not None:
            engine.async_scheduling = mode  # read by the engine loop at each run of steps; the engine is idle here
        for sampler_tag, compiled in sampler_modes:
            if compiled is not None:
                engine.set_compiled_sampler(compiled)  # read at each sampler call; the engine is idle here
            asyncio.run(engine_suite(tag + sampler_tag))
    for option, base, other in (("async_scheduling", "sync", "async"), ("compiled_sampler", "eager", "compiled")):
        if getattr(args, option) == "compare":
            _compare(results, levels, base, other)
            _write(args.out, results)
    if args.profile:
        profile_engine(engine, prompts_all[: max(levels)], args.device, Path(args.profile))
    if hf_model is not None:
        for level in levels:
            run = hf_generate_run(hf_model, prompts_all[:level], args.new_tokens, args.device)
            results["runs"][f"hf_generate_b{level}"] = run
            results[f"hf_generate_b{level}_new_tokens_per_s"] = run["new_tokens_per_s"]
            print(f"transformers generate b={level}: {run['new_tokens_per_s']:.0f} new tok/s", flush=True)
            _write(args.out, results)
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=2))


def profile_engine(engine: TorchEngine, prompts: list[list[int]], device: str, folder: Path) -> None:
    """Where a decode step's time goes, at the top concurrency (16-token prompts, 64 new tokens: decode-dominated):
    torch.profiler tables (CPU ops and GPU kernels) and a cProfile of the Python side, each on its own run."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    folder.mkdir(parents=True, exist_ok=True)
    short = [p[:16] for p in prompts]

    async def inline(fn, *args, **kwargs):  # steps on the profiled thread (the profilers record their own thread)
        return fn(*args, **kwargs)

    to_thread, asyncio.to_thread = asyncio.to_thread, inline
    try:
        asyncio.run(engine_run(engine, short, 8, 0))  # warm-up of these shapes
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with profile(activities=activities) as prof:
            run = asyncio.run(engine_run(engine, short, 64, 0))
        averages = prof.key_averages()
        sorts = ["self_cpu_time_total"] + (["self_cuda_time_total"] if device.startswith("cuda") else [])
        for sort in sorts:
            (folder / f"engine_profile_{sort}.txt").write_text(
                f"{run}\n" + averages.table(sort_by=sort, row_limit=40, max_name_column_width=70)
            )
        profiler = cProfile.Profile()
        profiler.enable()
        run = asyncio.run(engine_run(engine, short, 64, 0))
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(45)
        (folder / "engine_cprofile.txt").write_text(f"{run}\n{text.getvalue()}")
    finally:
        asyncio.to_thread = to_thread
    print(f"profile written to {folder}: {run}", flush=True)


def _compare(results: dict, levels: list[int], base: str, other: str) -> None:
    """`<other>_over_<base>_c<N>[_logprobs8]`: new tokens/s of the runs tagged `_<other>` over those tagged `_<base>`."""
    for level in levels:
        for extra in ("", "_logprobs8"):
            before, after = (
                results["runs"][f"engine_{tag}_c{level}{extra}"]["new_tokens_per_s"] for tag in (base, other)
            )
            results[f"{other}_over_{base}_c{level}{extra}"] = after / before


def _write(path: str | None, results: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
