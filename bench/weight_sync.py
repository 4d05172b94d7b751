"""Weight sync, phase by phase: learner rank 0 -> one TorchEngine, without Ray (two processes, one GPU each).

    sender (GPU 0): Qwen3-0.6B-shaped model, float32 master weights, sent as bf16 through `WeightGroup.send`
    receiver (GPU 1): a bf16 `TorchEngine` of the same shape, generating 256 requests while the sync comes in,
        synced as the GenerationActor does it (`rlasync.weights.apply.load_while_pausing`): up to `--staging-mb` is
        received while the engine finishes its step and pauses, then loaded, then it resumes

Reported per bucket size and staging size (median over rounds): the receiver's pause, paused->loaded and resume
times, the sender's
wall time in `send` (it includes waiting for the receiver to pause), and a raw NCCL broadcast of the same bytes as one flat tensor (the floor). This is the 50 ms target's
breakdown that the end-to-end run (`bench/e2e_grpo.py`) only shows from the driver.

    python3 bench/weight_sync.py --out $OUT/weight_sync_h200.json            # 2 GPUs, NCCL
    python bench/weight_sync.py --device cpu --tiny --rounds 2                # smoke test (gloo, CPU)
    python bench/weight_sync.py --ipc-copy --out $OUT/weight_sync_ipc_h200.json  # one GPU: IPC pack + copy

`--ipc-copy` times, in one process on one device, the two copies of an IPC sync as the transport runs them: the
learner's fill of its persistent buckets (float32 master weights cast to bf16 in one batched copy,
`SharedWeights.fill`) and the engine's replayed copy plan (`PlannedLoader`, one foreach copy), against the
per-tensor load (`load_named_weights`) they replace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _model(tiny: bool, dtype: torch.dtype, device: str, seed: int = 0):
    from engine_throughput import qwen3_06b_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(qwen3_06b_config(tiny), dtype=dtype).to(device).eval()


def _device(args: argparse.Namespace, rank: int) -> str:
    if args.device == "cpu":
        return "cpu"
    return f"cuda:{rank if torch.cuda.device_count() > 1 else 0}"


def _worker(rank: int, args: argparse.Namespace, port: int, result_path: str) -> None:
    from rlasync.weights import build_manifest, stream_parameters
    from rlasync.weights.broadcast import WeightGroup

    device = _device(args, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    backend = "nccl" if args.device == "cuda" and torch.cuda.device_count() > 1 else "gloo"
    wire = torch.bfloat16 if args.device == "cuda" else None
    results: dict = {"backend": backend, "buckets": {}}
    if rank == 0:
        model = _model(args.tiny, torch.float32, device)
        manifest = build_manifest(model, dtype=wire)
        results["bytes"] = sum(entry.num_bytes for entry in manifest)
        results["tensors"] = len(manifest)
    else:
        from rlasync.engine import TorchEngine

        engine = TorchEngine(
            _model(args.tiny, torch.bfloat16 if args.device == "cuda" else torch.float32, device, seed=1),
            device=device,
            max_model_len=1024,
            max_num_seqs=256,
            kv_cache_tokens=256 * 1024,
        )
        manifest = None
    for bucket_mb, staging_mb in [(b, st) for b in args.bucket_mb for st in args.staging_mb]:
        group = WeightGroup.open(
            "127.0.0.1",
            port,
            rank,
            2,
            120.0,
            backend=backend,
            device=device if backend == "nccl" else "cpu",
            bucket_bytes=int(bucket_mb * (1 << 20)),
        )
        port += 1
        rounds = []
        if rank == 0:
            for _ in range(args.rounds):
                start = time.perf_counter()
                group.send(stream_parameters(model, dtype=wire), manifest)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                rounds.append({"send_s": time.perf_counter() - start})
        else:
            manifest = _receive_manifest(args)

            rounds = asyncio.run(
                _engine_rounds(engine, group, manifest, args.rounds, device, int(staging_mb * (1 << 20)))
            )
        group.close()
        setting = f"bucket{bucket_mb:g}MB_staging{staging_mb:g}MB"
        results["buckets"][setting] = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]} | {
            "rounds": rounds
        }
        medians = {k: round(v * 1e3, 1) for k, v in results["buckets"][setting].items() if k != "rounds"}
        print(f"[rank {rank}] {setting}: {medians} ms", flush=True)  # progress, should a time limit cut the run
    if backend == "nccl":  # the floor: one flat broadcast of the same bytes
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("raw", store), rank, 2)
        numel = sum(e.num_bytes for e in build_manifest(_model(args.tiny, torch.float32, "cpu"), dtype=wire))
        flat = torch.empty(numel, dtype=torch.uint8, device=device)
        times = []
        for _ in range(args.rounds + 1):
            options = dist.BroadcastOptions()
            options.rootRank = 0
            torch.cuda.synchronize()
            start = time.perf_counter()
            pg.broadcast([flat], options).wait()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        results["raw_nccl_broadcast_s"] = statistics.median(times[1:])
    Path(result_path + f".{rank}").write_text(json.dumps(results))


async def _engine_rounds(engine, group, manifest, num_rounds: int, device: str, staging_bytes: int) -> list[dict]:
    """Syncs into a busy engine (256 long requests running) as the GenerationActor makes them
    (`load_while_pausing`: up to `staging_bytes` received before the pause completes)."""
    from rlasync.engine import SamplingParams
    from rlasync.weights.apply import load_while_pausing

    params = SamplingParams(max_tokens=10_000, temperature=1.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 500 for j in range(64)] for i in range(256)]
    busy = [asyncio.create_task(engine.generate(p, params)) for p in prompts]
    await asyncio.sleep(2.0)
    out = []
    for _ in range(num_rounds):
        phases = await load_while_pausing(engine, group.receive(manifest), staging_bytes)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out.append(phases)
        await asyncio.sleep(0.5)
    for task in busy:
        task.cancel()
    await asyncio.gather(*busy, return_exceptions=True)
    return out


def _receive_manifest(args: argparse.Namespace):
    from rlasync.weights import build_manifest

    wire = torch.bfloat16 if args.device == "cuda" else None
    return build_manifest(_model(args.tiny, torch.float32, "cpu"), dtype=wire)  # same shapes/names as the sender


def ipc_copy(args: argparse.Namespace) -> dict:
    from rlasync.engine.weights import PlannedLoader, load_named_weights
    from rlasync.weights import build_manifest, stream_parameters
    from rlasync.weights.ipc import MappedWeights, SharedWeights

    device = "cuda" if args.device == "cuda" else "cpu"
    wire = torch.bfloat16 if device == "cuda" else torch.float32
    learner, engine = _model(args.tiny, torch.float32, device), _model(args.tiny, wire, device, seed=1)
    manifest = build_manifest(learner, dtype=wire)
    shared = SharedWeights.allocate(manifest, device, 1 << 30)
    mapped, loader = MappedWeights(shared.key, shared.handles()), PlannedLoader()
    sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)

    def timed(fn) -> float:
        times = []
        for _ in range(args.rounds + 1):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    out = {"bytes": sum(e.num_bytes for e in manifest), "tensors": len(manifest)}
    out["learner_fill_batched_s"] = timed(
        lambda: (shared.fill(stream_parameters(learner, dtype=wire), manifest), shared.synchronize())
    )
    out["learner_fill_per_tensor_s"] = timed(
        lambda: shared.fill(list(stream_parameters(learner, dtype=wire)), manifest)
    )
    load = lambda stream: load_named_weights(engine, stream)  # noqa: E731
    out["engine_first_load_recorded_s"] = timed(lambda: (loader.plans.clear(), loader.load(engine, mapped, load)))
    loader.load(engine, mapped, load)
    out["engine_replayed_copy_s"] = timed(lambda: loader.load(engine, mapped, load))
    out["engine_per_tensor_load_s"] = timed(lambda: load_named_weights(engine, mapped))
    out["replayable"] = next(iter(loader.plans.values())).replayable
    shared.release()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[64, 256, 1024])
    parser.add_argument(
        "--staging-mb",
        type=float,
        nargs="+",
        default=[0, 2048],
        help="received before the pause completes (0 = pause first)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--port", type=int, default=29611)
    parser.add_argument("--out", default=None)
    parser.add_argument("--ipc-copy", action="store_true", help="one device: time the IPC pack and copy only")
    args = parser.parse_args()
    if args.ipc_copy:
        result = {
            "benchmark": "weight_sync_ipc_copy",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "hardware": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "model_shape": "tiny Qwen3" if args.tiny else "Qwen3-0.6B (random; float32 master, bf16 engine)",
            **ipc_copy(args),
        }
        print(json.dumps(result, indent=2))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))
        return
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"weight_sync_{os.getpid()}"
    mp.spawn(_worker, args=(args, args.port, str(work)), nprocs=2, join=True)
    sender, receiver = (json.loads(Path(f"{work}.{rank}").read_text()) for rank in (0, 1))
    result = {
        "benchmark": "weight_sync",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "hardware": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
        "torch": torch.__version__,
        "model_shape": "tiny Qwen3" if args.tiny else "Qwen3-0.6B (random; float32 master, sent as bf16)",
        "backend": sender["backend"],
        "bytes": sender["bytes"],
        "tensors": sender["tensors"],
        "raw_nccl_broadcast_s": sender.get("raw_nccl_broadcast_s"),
        "per_setting": {
            mb: {"sender": sender["buckets"][mb], "engine": receiver["buckets"][mb]} for mb in sender["buckets"]
        },
    }
    print(json.dumps({k: v for k, v in result.items() if k != "per_setting"}, indent=2))
    for setting, sides in result["per_setting"].items():
        engine = sides["engine"]
        print(
            f"{setting}: pause {engine['pause_s'] * 1e3:.1f} ms, paused->loaded "
            f"{engine['load_s'] * 1e3:.1f} ms, resume {engine['resume_s'] * 1e3:.1f} ms, send "
            f"{sides['sender']['send_s'] * 1e3:.1f} ms"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
