"""Weight sync into vLLM 0.25 (in-process AsyncLLM) on one GPU: perturbed weights loaded while paused, every path.

CUDA IPC via collective_rpc (same GPU, timed with pause/resume); persistent flat buckets as an IPC sync in GRPO sends
them (the call's round trip split from the worker's own copy time, idle and generating, and vLLM's own
`pause_generation` as an A/B); CPU tensors inline; rlasync's gloo weight group received inside the vLLM worker; then
greedy tokens vs HF greedy on the perturbed model. vLLM's own NCCL path needs a second GPU (learner and engine on
distinct GPUs): run only when two are visible. The model folder and the run: bench/vllm_common.py.

    python3 bench/vllm_weight_sync.py --out $OUT --engine-mode default   # GPU, vLLM kit on PYTHONPATH
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_common import (  # noqa: E402
    Run,
    build_model,
    common_parser,
    compare_greedy,
    diff_stats,
    free_gpu,
    generate_all,
    gloo_group_sync,
    hf_greedy,
    learner_logprobs,
    load_hf,
    perturb,
    random_prompts,
    run_check,
    start_vllm,
)

from rlasync.engine import SamplingParams  # noqa: E402

WHAT = "vLLM 0.25 behind rlasync's engine interface: weight sync (CUDA IPC, flat buckets, CPU, gloo, NCCL), one GPU"


async def phase_weight_sync(ctx: dict[str, Any]) -> dict[str, Any]:
    args, engine, run = ctx["args"], ctx["engine"], ctx["run"]
    model = ctx["hf_bf16"]
    vocab = ctx["model"]["vocab_size"]
    result: dict[str, Any] = {
        "note": "one GPU: learner tensors reach the vLLM worker by CUDA IPC through collective_rpc "
        "(no copy over a wire); NCCL broadcast needs the learner on a second GPU"
    }
    prompts = random_prompts(16, 32, vocab, seed=3)
    greedy = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True) for _ in prompts]
    before = [t.output_ids for t in await generate_all(engine, prompts, greedy)]
    old_tokens, old_gaps = hf_greedy(model, prompts, 32)
    result["greedy_before_update_vs_hf_original"] = compare_greedy(before, old_tokens, old_gaps)
    perturb(model, args.perturb, seed=7)
    ctx["perturbed"] = True
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    result["tensors"] = len(named)
    result["bytes"] = sum(t.numel() * t.element_size() for _, t in named)
    # 1. CUDA IPC, timed with pause and resume
    rounds = []
    for _ in range(args.sync_rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        await engine.pause()
        t1 = time.perf_counter()
        loaded = await engine.load_weights(named)
        t2 = time.perf_counter()
        await engine.resume()
        t3 = time.perf_counter()
        rounds.append(
            {
                "pause_ms": (t1 - t0) * 1e3,
                "load_ms": (t2 - t1) * 1e3,
                "resume_ms": (t3 - t2) * 1e3,
                "total_ms": (t3 - t0) * 1e3,
                "num_tensors": loaded["num_tensors"],
            }
        )
    result["cuda_ipc_rounds"] = rounds
    total = statistics.median(r["total_ms"] for r in rounds)
    result["cuda_ipc_median_total_ms"] = total
    run.result["summary"]["weight_sync_ms (0.6B, pause+load+resume, CUDA IPC, one GPU, median)"] = total
    # 1b. persistent buckets, as an IPC sync in GRPO sends them (same weights): the call's round trip split from
    # the worker's own time, with the engine idle and with it generating
    result["flat_ipc"] = await flat_ipc_sync(engine, named, vocab, args.sync_rounds)
    run.result["summary"]["flat IPC sync ms (pause+load+resume, median; worker's own part)"] = {
        label: [part["median_total_ms"], part["median_worker_ms"]]
        for label, part in result["flat_ipc"].items()
        if isinstance(part, dict) and "median_total_ms" in part
    }
    # the engine's weights now are the perturbed model's
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    fingerprint = await engine.weight_fingerprint(names)
    params = dict(model.named_parameters())
    result["fingerprint_abs_diff"] = {
        n: abs(fingerprint.get(n, float("nan")) - params[n].double().sum().item()) for n in names
    }
    after = [t.output_ids for t in await generate_all(engine, prompts, greedy)]
    new_tokens, new_gaps = hf_greedy(model, prompts, 32)
    result["greedy_after_update_vs_hf_perturbed"] = compare_greedy(after, new_tokens, new_gaps)
    result["greedy_after_update_vs_hf_original (should differ)"] = compare_greedy(after, old_tokens, old_gaps)
    run.result["summary"]["greedy_after_sync_exact_match_frac"] = result["greedy_after_update_vs_hf_perturbed"][
        "exact_match_frac"
    ]
    sample = [SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True, seed=5000 + i) for i in range(16)]
    turns = await generate_all(engine, prompts, sample)
    ref = learner_logprobs(model, prompts, [t.output_ids for t in turns], 1.0, "none")
    result["logp_difference_after_update_vs_perturbed_bf16"] = diff_stats([t.output_log_probs for t in turns], ref)
    # 2. CPU tensors inline (msgpack bytes through collective_rpc)
    cpu = [(name, t.cpu()) for name, t in named]
    await engine.pause()
    t0 = time.perf_counter()
    loaded = await engine.load_weights(cpu)
    result["cpu_inline_load_ms"] = (time.perf_counter() - t0) * 1e3
    await engine.resume()
    del cpu
    # 3. rlasync's gloo weight group, received inside the vLLM worker (the GenerationActor's receive path)
    result["gloo_group"] = await gloo_group_sync(engine, model, args.collective_timeout_s)
    # 4. vLLM's own NCCL weight transfer (learner on another GPU)
    if torch.cuda.device_count() >= 2 and ctx.get("nccl_backend"):
        result["vllm_nccl"] = await vllm_nccl_sync(engine, model)
    else:
        result["vllm_nccl"] = {"skipped": "needs two GPUs (NCCL cannot put two ranks on one GPU)"}
    return result


async def flat_ipc_sync(
    engine: Any,
    named: list[tuple[str, torch.Tensor]],
    vocab: int,
    rounds: int,
    *,
    device: str = "cuda",
    requests: int = 256,
    new_tokens: int = 192,
) -> dict[str, Any]:
    """Weight syncs from persistent CUDA buckets (`SharedWeights`, what the learner's IPC transport fills): per
    round the pause, the load (one `load_flat_ipc` collective_rpc: the first records the copies, later ones replay
    them) and the resume, with the worker's own part of the load (mapping, queueing the copies, waiting for them);
    also a no-op `collective_rpc`, the round trip alone. Rounds with the engine idle, then with `requests` requests
    generating, then (a VLLMEngine) generating again with vLLM's own `pause_generation` instead of `engine.pause`."""
    from rlasync.weights.ipc import MappedWeights, SharedWeights
    from rlasync.weights.plan import ManifestEntry

    manifest = [ManifestEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]
    shared = SharedWeights.allocate(manifest, device, 1 << 30)
    shared.fill(named, manifest)
    shared.synchronize()
    mapped = MappedWeights(shared.key, shared.handles())
    out: dict[str, Any] = {"buckets": len(shared.buffers)}
    trips = []
    for _ in range(7):
        t0 = time.perf_counter()
        await engine.weight_fingerprint([])
        trips.append((time.perf_counter() - t0) * 1e3)
    out["noop_rpc_ms"] = trips
    prompts = random_prompts(requests, 64, vocab, seed=11)
    try:
        labels = ["idle", "generating"]
        if "via_pause_generation" in inspect.signature(engine.pause).parameters:
            labels.append("generating_pause_generation")  # vLLM's own pause (it sleeps 20 ms after), for the A/B

        async def pause(label: str) -> None:
            if label == "generating_pause_generation":
                await engine.pause(via_pause_generation=True)
            else:
                await engine.pause()

        for label in labels:
            busy = []
            if label.startswith("generating"):
                params = [
                    SamplingParams(max_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=i)
                    for i in range(requests)
                ]
                busy = [asyncio.ensure_future(engine.generate(p, sp)) for p, sp in zip(prompts, params)]
                await asyncio.sleep(1.0)
            rows = []
            for _ in range(rounds + 1):
                t0 = time.perf_counter()
                await pause(label)
                t1 = time.perf_counter()
                loaded = await engine.load_weights(mapped)
                t2 = time.perf_counter()
                await engine.resume()
                t3 = time.perf_counter()
                rows.append(
                    {
                        "how": loaded.get("how"),
                        "not_replayed": loaded.get("not_replayed"),
                        "pause_ms": (t1 - t0) * 1e3,
                        "load_ms": (t2 - t1) * 1e3,
                        "resume_ms": (t3 - t2) * 1e3,
                        "total_ms": (t3 - t0) * 1e3,
                        "worker_ms": float(loaded.get("engine_s", float("nan"))) * 1e3,
                        **{
                            k.replace("_s", "_ms"): float(loaded[k]) * 1e3
                            for k in ("map_s", "queue_s", "gpu_wait_s")
                            if k in loaded
                        },
                    }
                )
                if busy:
                    await asyncio.sleep(0.3)  # let the engine run a few steps between syncs
            done = await asyncio.wait_for(asyncio.gather(*busy, return_exceptions=True), 180.0)
            later = [r for r in rows if r["how"] != "recorded"] or rows
            out[label] = {
                "rounds": rows,
                "median_total_ms": statistics.median(r["total_ms"] for r in later),
                "median_load_ms": statistics.median(r["load_ms"] for r in later),
                "median_worker_ms": statistics.median(r["worker_ms"] for r in later),
                "median_pause_ms": statistics.median(r["pause_ms"] for r in later),
                "request_errors": sum(isinstance(d, BaseException) for d in done),
            }
        if hasattr(engine, "open_loads_between_steps"):  # the sync door (`direct_sync`), idle and generating
            out.update(await door_rounds(engine, mapped, prompts, rounds, new_tokens))
    finally:
        shared.release()
    return out


async def door_rounds(engine: Any, mapped: Any, prompts: list[list[int]], rounds: int, new_tokens: int) -> dict:
    """The same syncs through vLLM's sync door (`VLLMEngine(direct_sync=True)`, switched on here): sent from a
    thread as the generation actor's sync thread sends them, no pause; `wait_ms` is the wait for the worker's next
    step (or the nudge when idle), `worker_ms` its load."""
    engine.direct_sync = engine.sync_without_pause = True
    await engine.open_loads_between_steps()
    if not engine.loads_between_steps:
        return {"door": {"skipped": "the sync door did not open (see the log)"}}
    out: dict[str, Any] = {}
    for label in ("door_idle", "door_generating"):
        busy = []
        if label == "door_generating":
            params = [SamplingParams(max_tokens=new_tokens, temperature=1.0, ignore_eos=True) for _ in prompts]
            busy = [asyncio.ensure_future(engine.generate(p, sp)) for p, sp in zip(prompts, params)]
            await asyncio.sleep(1.0)
        rows = []
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            loaded = await asyncio.to_thread(engine.load_between_steps, mapped)
            rows.append(
                {
                    "total_ms": (time.perf_counter() - t0) * 1e3,
                    "wait_ms": loaded["wait_s"] * 1e3,
                    "worker_ms": loaded["load_s"] * 1e3,
                    "door_wait_ms": loaded.get("door_wait_s", float("nan")) * 1e3,
                }
            )
            if busy:
                await asyncio.sleep(0.3)
        done = await asyncio.wait_for(asyncio.gather(*busy, return_exceptions=True), 180.0)
        out[label] = {
            "rounds": rows,
            "median_total_ms": statistics.median(r["total_ms"] for r in rows[1:]),
            "max_total_ms": max(r["total_ms"] for r in rows[1:]),
            "median_wait_ms": statistics.median(r["wait_ms"] for r in rows[1:]),
            "request_errors": sum(isinstance(d, BaseException) for d in done),
            "applied": dict(engine.door_counts),
        }
    return out


async def vllm_nccl_sync(engine: Any, model: Any) -> dict[str, Any]:
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from rlasync.weights.broadcast import free_port
    from rlasync.weights.plan import build_manifest

    manifest = build_manifest(model)
    port = free_port()
    on_gpu1 = [(n, p.detach().to("cuda:1")) for n, p in model.named_parameters()]
    box: dict[str, Any] = {}

    def trainer_init() -> None:
        torch.cuda.set_device(1)
        box["group"] = NCCLWeightTransferEngine.trainer_init(
            {"master_address": "127.0.0.1", "master_port": port, "world_size": 2}
        )

    await asyncio.gather(asyncio.to_thread(trainer_init), engine.init_weight_transfer("127.0.0.1", port, 1, 2))

    def send() -> None:
        torch.cuda.set_device(1)
        NCCLWeightTransferEngine.trainer_send_weights(iter(on_gpu1), {"group": box["group"], "packed": True})
        torch.cuda.synchronize(1)

    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        seconds, _ = await asyncio.gather(engine.update_weights_nccl(manifest, packed=True), asyncio.to_thread(send))
        rounds.append((time.perf_counter() - t0) * 1e3)
    return {"rounds_ms (pause+transfer+load+resume)": rounds, "median_ms": statistics.median(rounds)}


async def main_gpu(run: Run) -> None:
    ctx: dict[str, Any] = {"args": run.args, "run": run}
    ctx["model"] = await build_model(run)
    if ctx["model"] is None:
        return
    ctx["hf_bf16"] = load_hf(Path(ctx["model"]["path"]), torch.bfloat16, "cuda")  # the learner's model: perturbed
    if await start_vllm(run, ctx):
        try:
            await run.phase("weight_sync", phase_weight_sync, ctx)
        finally:
            await ctx["engine"].close()
    free_gpu()


def build_parser() -> argparse.ArgumentParser:
    parser = common_parser(__doc__.splitlines()[0], "vllm_weight_sync.json")
    parser.add_argument("--sync-rounds", type=int, default=5)
    parser.add_argument("--perturb", type=float, default=0.5, help="noise, in units of each parameter's std")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_check(build_parser().parse_args(argv), "vllm_weight_sync", WHAT, main_gpu)


if __name__ == "__main__":
    sys.exit(main())
