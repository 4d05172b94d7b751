"""LoRA adapter sync time (r=32, all-linear) on the Qwen3-0.6B shape with random weights from its config: the
learner's adapter stream (A, s*B per module), the built-in engine's merge (W = W0 + B'@A over its kept base weights)
and, when vllm imports, the in-process vLLM engine's runtime adapter load (write the peft folder + add_lora).

    python bench/lora_sync.py --out bench/results/lora_h200.json            # one H200 (the goal: <= 10 ms)
    python bench/lora_sync.py --device cpu --model smollm2 --out /tmp/lora_cpu.json

Writes one JSON object: the shape, the adapter's bytes, and per phase the median / min seconds over --repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def build_model(name: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

    if name == "qwen3-0.6b-shape":
        config = Qwen3Config(**QWEN3_06B)
    else:
        from rlasync.model.registry import resolve_model

        config = AutoConfig.from_pretrained(resolve_model(name))
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), config


def timed(fn, repeats: int, sync) -> list[float]:
    out = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - start)
    return out


def summary(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "n": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="qwen3-0.6b-shape", help="qwen3-0.6b-shape (random) or a model/alias")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model

    from rlasync.weights.adapter import AdapterMerger, adapter_manifest, adapter_stream, merged_stream

    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    engine_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    learner_model, config = build_model(args.model, device, torch.float32)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(learner_model, lora)
    inner = peft_model.base_model.model
    manifest = adapter_manifest(inner, dtype=engine_dtype)
    result: dict = {
        "model": args.model,
        "device": str(device),
        "rank": args.rank,
        "engine_dtype": str(engine_dtype),
        "num_lora_modules": len(manifest) // 2,
        "adapter_bytes": sum(e.num_bytes for e in manifest),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    payload: list = []

    def stream() -> None:
        payload[:] = list(adapter_stream(inner, dtype=engine_dtype))

    result["learner_adapter_stream"] = summary(timed(stream, args.repeats, sync))
    from rlasync.weights.ipc import SharedWeights

    shared = SharedWeights.allocate(manifest, device)  # what an IPC sync fills: persistent buckets, one batched copy
    result["learner_adapter_fill"] = summary(
        timed(lambda: shared.fill(adapter_stream(inner, dtype=engine_dtype), manifest), args.repeats, sync)
    )
    shared.release()
    engine_model, _ = build_model(args.model, device, engine_dtype)
    merger = AdapterMerger()
    merger.load(engine_model, payload)  # the first sync also copies W0
    result["torch_engine_merge"] = summary(timed(lambda: merger.load(engine_model, payload), args.repeats, sync))
    result["adapter_sync_s"] = result["learner_adapter_fill"]["median_s"] + result["torch_engine_merge"]["median_s"]
    result["torch_engine_kept_base_bytes"] = sum(t.numel() * t.element_size() for t in merger.base.values())
    full: list = []
    result["learner_merged_stream"] = summary(
        timed(
            lambda: full.__setitem__(slice(None), list(merged_stream(inner, dtype=engine_dtype))),
            max(2, args.repeats // 5),
            sync,
        )
    )
    result["merged_bytes"] = sum(t.numel() * t.element_size() for _, t in full)
    if not args.skip_vllm and device.type == "cuda":
        result["vllm"] = bench_vllm(config, payload, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def bench_vllm(config, payload, args) -> dict:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vllm is not installed"}
    from peft import LoraConfig

    from rlasync.engine.vllm_engine import VLLMEngine
    from rlasync.weights.adapter import lora_engine_kwargs

    folder = Path(tempfile.mkdtemp(prefix="rlasync-bench-"))
    model_dir = folder / "model"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model_dir)
    kwargs = lora_engine_kwargs(
        LoraConfig(r=args.rank, target_modules="all-linear"), "vllm", max_loras=2, lora_dir=str(folder / "adapters")
    )
    engine = VLLMEngine(str(model_dir), gpu_memory_utilization=0.3, enforce_eager=True, **kwargs)

    async def run() -> dict:
        times = []
        for _ in range(args.repeats):
            await engine.pause()
            start = time.perf_counter()
            stats = await engine.load_weights(payload)
            times.append(time.perf_counter() - start)
            await engine.resume()
        await engine.close()
        return {"load_adapter": summary(times), "last": {k: v for k, v in stats.items() if k != "retired"}}

    return asyncio.run(run())


if __name__ == "__main__":
    main()
