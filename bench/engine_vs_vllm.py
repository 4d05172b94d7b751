"""The built-in engine against vLLM 0.25 on 256 x 256 -> 256, seeded and unseeded, without and with 8 log-probs.

One process, one GPU, one random Qwen3-0.6B-shaped model folder (bench/vllm_common.py): vLLM first (in-process
AsyncLLM, `--engine-mode default`: vLLM's own mode, torch.compile with CUDA graphs), then, after it has exited, the
built-in TorchEngine. Each engine runs the same four modes on the same prompts, `--repeats` times each, the modes
interleaved (unseeded, unseeded + 8 log-probs, seeded, seeded + 8 log-probs, then again): 256 requests of 256
random prompt tokens, 256 new tokens each, EOS ignored, temperature 1. The seeding policy is the same on both sides:
"seeded" gives every request its own seed (vLLM: `use_request_seeds=True`), "unseeded" none (vLLM:
`use_request_seeds=False`, its engine's own random stream; the TorchEngine draws a random seed per request). The
JSON's `ratio_<mode>` is the TorchEngine's median new tokens/s over vLLM's.

The TorchEngine runs as in GRPO's GenerationActor: once it is built, its sampler compiles for the bench's modes
(`TorchEngine.warm_up`) and the process's heap is frozen (`gc.freeze`,
`rlasync.metrics.gc_pauses.freeze_heap`), so Python's full collections walk only what the runs allocate (vLLM's
engine core freezes its own the same way); `--no-freeze-heap` leaves it (the collections' time is recorded either
way, `gc`). `--skip-vllm` measures the TorchEngine alone (no vLLM kit needed; no ratios).

    python3 bench/engine_vs_vllm.py --out $OUT       # GPU, vLLM kit on PYTHONPATH: $OUT/engine_vs_vllm_h200.json
    python3 bench/engine_vs_vllm.py --out $OUT --skip-vllm --json-name engine_vs_vllm_torch_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
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
from rlasync.metrics.gc_pauses import REFREEZE_OVER_S, GcPauseMonitor, freeze_heap  # noqa: E402

WHAT = "the built-in TorchEngine over vLLM 0.25 (its best mode), 256 x 256 -> 256, seeded and unseeded, one process"
# (name, per-request seeds, log-probs per position)
MODES = (
    ("unseeded", False, 0),
    ("unseeded_logprobs8", False, 8),
    ("seeded", True, 0),
    ("seeded_logprobs8", True, 8),
)
VLLM_MODES = {
    "default": "vLLM 0.25's default: torch.compile (VLLM_COMPILE) with CUDA graphs (FULL_AND_PIECEWISE)",
    "graphs": "no torch.compile, full CUDA graphs for decodes (FULL_DECODE_ONLY)",
    "eager": "enforce_eager: no compile, no CUDA graphs",
}


def sampling(count: int, new_tokens: int, seeded: bool, logprobs: int) -> list[SamplingParams]:
    """The requests of one mode: seeds 0..count-1 when `seeded`, none otherwise."""
    return [
        SamplingParams(
            max_tokens=new_tokens, temperature=1.0, ignore_eos=True, num_logprobs=logprobs, seed=i if seeded else None
        )
        for i in range(count)
    ]


def set_seeding(engine: Any, seeded: bool) -> None:
    """vLLM passes request seeds only with `use_request_seeds`; the TorchEngine has no such switch (a request
    without a seed gets a random one)."""
    if hasattr(engine, "use_request_seeds"):
        engine.use_request_seeds = seeded


def preemptions(engine: Any) -> int | None:
    """The engine's preemption count so far (None for an engine without `stats()`)."""
    return engine.stats().num_preemptions if hasattr(engine, "stats") else None


async def warm_up(engine: Any, prompts: list[list[int]]) -> None:
    """Each mode at two batch sizes with 16 new tokens, before anything is timed (compiled samplers, graphs)."""
    for _, seeded, logprobs in MODES:
        set_seeding(engine, seeded)
        for count in (32, 7):
            await generate_all(engine, prompts[:count], sampling(count, 16, seeded, logprobs))


async def measure(engine: Any, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict[str, Any]:
    """Every mode `repeats` times, interleaved; per mode the runs and their median new tokens/s."""
    initial = getattr(engine, "use_request_seeds", None)
    await warm_up(engine, prompts)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in MODES}
    for _ in range(repeats):
        for name, seeded, logprobs in MODES:
            set_seeding(engine, seeded)
            before = preemptions(engine)
            t0 = time.perf_counter()
            turns = await generate_all(engine, prompts, sampling(len(prompts), new_tokens, seeded, logprobs))
            elapsed = time.perf_counter() - t0
            generated = sum(len(t.output_ids) for t in turns)
            run = {"seconds": elapsed, "new_tokens": generated, "new_tokens_per_s": generated / elapsed}
            if before is not None:
                run["preemptions"] = preemptions(engine) - before  # > 0: the KV cache was short, the run is slowed
            runs[name].append(run)
    if initial is not None:
        set_seeding(engine, initial)  # left as training runs it
    return {
        name: {"runs": values, "new_tokens_per_s": statistics.median(r["new_tokens_per_s"] for r in values)}
        for name, values in runs.items()
    }


def ratios(torch_engine: dict[str, Any], vllm: dict[str, Any]) -> dict[str, float]:
    """`ratio_<mode>`: the TorchEngine's new tokens/s over vLLM's, for each mode both engines measured."""
    return {
        f"ratio_{name}": torch_engine[name]["new_tokens_per_s"] / vllm[name]["new_tokens_per_s"]
        for name, _, _ in MODES
        if name in torch_engine and name in vllm and vllm[name]["new_tokens_per_s"] > 0
    }


async def phase_vllm(ctx: dict[str, Any]) -> dict[str, Any]:
    args = ctx["args"]
    prompts = random_prompts(args.concurrency, args.prompt_len, ctx["model"]["vocab_size"], seed=11)
    result = await measure(ctx["engine"], prompts, args.new_tokens, args.repeats)
    if hasattr(ctx["engine"], "stat_loggers"):  # which stat loggers vLLM runs (ours alone: no Prometheus metrics)
        result["stat_loggers"] = ctx["engine"].stat_loggers()
    return result


VARIANTS = {  # the TorchEngine's variants measured after its default (`--variant`), as engine kwargs
    "compiled_layers": dict(compiled_layers=True),  # decoder layers compiled by inductor (the fused layers off)
    "unfused_layers": dict(fused_layers=False),  # transformers' eager layers (the default's fused ones off)
}


async def phase_torch_engine(ctx: dict[str, Any], **engine_kwargs: Any) -> dict[str, Any]:
    from rlasync.engine import TorchEngine

    args = ctx["args"]
    t0 = time.perf_counter()
    engine = TorchEngine(
        ctx["model"]["path"],
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.concurrency,
        **engine_kwargs,
    )
    startup_s = time.perf_counter() - t0
    # as the GenerationActor: the sampler compiles for the run's sampling (each mode), then the heap is frozen
    sampler_warm_up_s = engine.warm_up([sampling(1, 16, seeded, logprobs)[0] for _, seeded, logprobs in MODES])
    frozen = None if args.no_freeze_heap else freeze_heap()
    prompts = random_prompts(args.concurrency, args.prompt_len, ctx["model"]["vocab_size"], seed=11)
    # as the GenerationActor: a slow full collection refreezes the heap
    collections = GcPauseMonitor(refreeze_over_s=None if args.no_freeze_heap else REFREEZE_OVER_S)
    try:
        result = await measure(engine, prompts, args.new_tokens, args.repeats)
        result["runner_info"] = engine.runner_info()
    finally:
        result_gc = collections.take()
        collections.close()
        await engine.close()
    result["startup_s"] = startup_s
    result["sampler_warm_up_s"] = sampler_warm_up_s
    result["gc_frozen_objects"] = frozen
    result["gc"] = result_gc  # Python's collections during the warm-up and the timed runs
    return result


def variant_phase(variant: str) -> Any:
    """`phase_torch_engine` with the variant's engine kwargs (`Run.phase` passes positional args only)."""
    return functools.partial(phase_torch_engine, **VARIANTS[variant])


async def main_gpu(run: Run) -> None:
    ctx: dict[str, Any] = {"args": run.args, "run": run}
    ctx["model"] = await build_model(run)
    if ctx["model"] is None:
        return
    summary = run.result["summary"]
    run.result["vllm_mode"] = summary["vllm_mode"] = f"{run.args.engine_mode}: {VLLM_MODES[run.args.engine_mode]}"
    summary["shape"] = f"{run.args.concurrency} x {run.args.prompt_len} -> {run.args.new_tokens}"
    if not run.args.skip_vllm and await start_vllm(run, ctx):
        try:
            await run.phase("vllm", phase_vllm, ctx)
        finally:
            await ctx.pop("engine").close()
        free_gpu()
        await asyncio.sleep(2)
    await run.phase("torch_engine", phase_torch_engine, ctx)
    summarise(run.result)  # the ratios are in the JSON even should a variant's phase not end
    run.save()
    for variant in run.args.variant:  # the same engine with other layers, after it
        free_gpu()
        await run.phase(f"torch_engine_{variant}", variant_phase(variant), ctx)
        summarise(run.result)
        run.save()


def summarise(result: dict[str, Any]) -> None:
    """The summary and ratios of `result` from the phases it holds (each side's median new tokens/s per mode)."""
    phases, summary = result["phases"], result["summary"]
    sides = {side: phases.get(side) for side in ("vllm", "torch_engine", *(f"torch_engine_{v}" for v in VARIANTS))}
    sides = {side: value for side, value in sides.items() if value and "skipped" not in value}
    for side, value in sides.items():
        summary[f"{side}_new_tokens_per_s"] = {
            name: round(value[name]["new_tokens_per_s"]) for name, _, _ in MODES if name in value
        }
    pairs = (
        ("torch_engine", "vllm", "ratio_"),
        ("torch_engine_compiled_layers", "vllm", "compiled_layers_ratio_"),
        ("torch_engine_unfused_layers", "vllm", "unfused_layers_ratio_"),
        ("torch_engine", "torch_engine_unfused_layers", "fused_over_unfused_layers_"),  # the default's A/B alone
        ("torch_engine_compiled_layers", "torch_engine_unfused_layers", "compiled_over_eager_layers_"),
    )
    for side, over, prefix in pairs:
        if side in sides and over in sides:
            for key, value in ratios(sides[side], sides[over]).items():
                name = prefix + key.removeprefix("ratio_")
                result[name] = summary[name] = round(value, 3)


def build_parser() -> argparse.ArgumentParser:
    parser = common_parser(__doc__.splitlines()[0], "engine_vs_vllm_h200.json")
    parser.set_defaults(engine_mode="default", budget_s=420.0)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode per engine (the median is kept)")
    parser.add_argument("--skip-vllm", action="store_true", help="the TorchEngine alone (no ratios)")
    parser.add_argument(
        "--no-freeze-heap",
        action="store_true",
        help="leave the heap unfrozen once the TorchEngine is built (the GenerationActor freezes it)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        choices=sorted(VARIANTS),
        help="then the TorchEngine again as this variant (repeatable): compiled_layers (ratios compiled_layers_ratio_*) "
        "or unfused_layers (transformers' layers: unfused_layers_ratio_*, fused_over_unfused_layers_*)",
    )
    parser.add_argument(
        "--vllm-engine-args",
        default=None,
        help="JSON of more vllm.AsyncEngineArgs fields for vLLM's side, e.g. '{\"async_scheduling\": true}'",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_check(build_parser().parse_args(argv), "engine_vs_vllm", WHAT, main_gpu)


if __name__ == "__main__":
    sys.exit(main())
