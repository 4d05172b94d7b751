"""Generation throughput of the whole async GRPO system against its engine alone, on one GPU, real model.

The workload is `configs/sums_gpu.yaml`: SmolLM2-135M-Instruct learning two-digit sums, G = 8 rollouts per prompt,
at most 48 new tokens, temperature 1, 8 sampler log-probs, up to 256 requests in flight, learner and engine
sharing the GPU. Three measurements, each a stage of this script (run them in one device call or several; each
stage merges its numbers into `--out`):

    engine   the engine alone, in this process, driven closed-loop with the rollouts' request mix (the same
             prompts rendered with the chat template, G requests per prompt, the same sampling, `--concurrency`
             requests always in flight): new tokens/s over `--seconds` after a warm-up
    system   `rlasync train configs/sums_gpu.yaml` for `--steps` steps; generated tokens/s of the whole system
             (Σ `rollout/generated_tokens_total` over the logged windows after `--warmup` steps / their wall time),
             step time split, weight-sync time, the reward curve
    report   the ratios: `generation_ratio_system_over_engine` per engine, `torch_engine_over_vllm*` from a
             `bench/vllm_throughput.py` JSON when given (`--vllm-check`)

    python bench/system_throughput.py engine --engine torch --out $OUT/system_throughput_h200.json
    python bench/system_throughput.py system --engine torch --steps 60 --out $OUT/system_throughput_h200.json
    python bench/system_throughput.py report --out $OUT/system_throughput_h200.json [--vllm-check vllm_throughput.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "configs" / "sums_gpu.yaml"
VLLM_ENGINE_KWARGS = {"max_model_len": 512, "gpu_memory_utilization": 0.3, "max_num_seqs": 256}


def _merge(out: Path, key: str, value: Any) -> None:
    data = json.loads(out.read_text()) if out.exists() else {}
    data.setdefault("hardware", _hardware())
    data.setdefault("commands", []).append("python bench/system_throughput.py " + " ".join(sys.argv[1:]))
    data[key] = value
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, sort_keys=True))
    print(json.dumps({key: value}, indent=1))


def _hardware() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


# ---- engine alone ---------------------------------------------------------------------------------------------


def _request_mix(tokenizer: Any, count: int, group_size: int, seed: int) -> list[list[int]]:
    """`count` prompt-id lists: the workload's prompts, each repeated `group_size` times (as a group's rollouts)."""
    from rlasync.data.from_spec import build_dataset
    from rlasync.data.prompts import render_prompt

    rows = build_dataset({"name": "arithmetic", "size": count // group_size + 1, "seed": seed, "max_operand": 99})
    prompts = []
    for row in rows:
        ids = render_prompt(tokenizer, row["prompt"], None, None)
        prompts += [ids] * group_size
    return prompts[:count]


async def _closed_loop(
    engine: Any, prompts: list[list[int]], sampling: Any, concurrency: int, seconds: float, warmup_s: float
) -> dict[str, float]:
    rng = random.Random(0)
    counted = {"tokens": 0, "requests": 0}
    started = time.perf_counter()
    window_start = started + warmup_s
    deadline = window_start + seconds
    next_prompt = iter(range(10**9))

    async def worker() -> None:
        while time.perf_counter() < deadline:
            ids = prompts[next(next_prompt) % len(prompts)]
            record = await engine.generate(ids, sampling.with_seed(rng.getrandbits(63)))
            if time.perf_counter() >= window_start:
                counted["tokens"] += len(record.output_ids)
                counted["requests"] += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - window_start
    return {
        "new_tokens_per_s": counted["tokens"] / elapsed,
        "completions_per_s": counted["requests"] / elapsed,
        "mean_new_tokens": counted["tokens"] / max(1, counted["requests"]),
        "seconds": elapsed,
    }


def stage_engine(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from rlasync.config import AsyncGRPOConfig
    from rlasync.config.load import read_yaml
    from rlasync.engine.base import SamplingParams
    from rlasync.engine.factory import make_engine
    from rlasync.model.registry import resolve_model

    run = read_yaml(CONFIG)
    fields = {k: run[k] for k in ("max_completion_length", "temperature", "num_sampler_logprobs", "num_generations")}
    config = AsyncGRPOConfig(**fields)
    model = args.model or resolve_model(run["model"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    kwargs = dict(run["cluster"]["engine_kwargs"]) if args.engine == "torch" else dict(VLLM_ENGINE_KWARGS)
    kwargs.update(json.loads(args.engine_kwargs or "{}"))
    if args.engine == "torch" and args.no_mixed_graphs:
        kwargs["mixed_cuda_graphs"] = False
    engine = make_engine(args.engine, model, dtype=None, **kwargs)
    sampling = SamplingParams.from_config(config)  # EOS: the engine's own (the model's generation config)
    prompts = _request_mix(tokenizer, 4096, config.num_generations, seed=1)
    result = asyncio.run(_closed_loop(engine, prompts, sampling, args.concurrency, args.seconds, args.warmup_s))
    result.update(concurrency=args.concurrency, engine_kwargs=kwargs)
    if hasattr(engine, "runner_info"):  # the built-in engine: which layers and graphs it runs
        result["runner_info"] = engine.runner_info()
    asyncio.run(engine.close()) if hasattr(engine, "close") else None
    key = f"engine_alone_{args.engine}" + ("_no_mixed_graphs" if args.no_mixed_graphs else "")
    _merge(Path(args.out), key, result)


# ---- the whole system -----------------------------------------------------------------------------------------


def _summary(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    warm = [r for r in records if r.get("step", 0) > warmup]
    if len(warm) < 2:
        raise SystemExit(f"only {len(warm)} logged records after step {warmup}: run more steps")
    tokens = sum(r.get("rollout/generated_tokens_total", 0.0) for r in warm[1:])
    seconds = warm[-1]["time"] - warm[0]["time"]

    def mean(key: str) -> float | None:
        values = [r[key] for r in warm if isinstance(r.get(key), (int, float))]
        return sum(values) / len(values) if values else None

    keys = (
        "perf/step_s",
        "perf/rollout_wait_s",
        "perf/fwd_bwd_s",
        "perf/weight_sync_s",
        "perf/weight_sync_pause_s",
        "perf/weight_sync_transfer_s",
        "perf/weight_sync_resume_s",
        "rollout/generated_tokens_per_s",
        "rollout/concurrency",
        "rollout/vllm_running_requests",
        "batch/trained_tokens_per_step",
        "completions/mean_length",
        "sample/staleness_mean",
    )
    return {
        "system_generated_tokens_per_s": tokens / seconds if seconds > 0 else None,
        "steps_per_s": (warm[-1]["step"] - warm[0]["step"]) / seconds if seconds > 0 else None,
        "means_after_warmup": {key: mean(key) for key in keys},
        "reward_curve": [[r["step"], r.get("reward")] for r in records],
    }


def stage_system(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir or f"/tmp/system_throughput_{args.engine}")
    sets = [
        f"max_steps={args.steps}",
        f"output_dir={run_dir}",
        f"cluster.engine={args.engine}",
        f"logging_steps={args.logging_steps}",
        f"cluster.num_rollout_actors={args.rollout_actors}",
    ]
    if args.engine == "vllm":
        sets.append("cluster.engine_kwargs=" + json.dumps(VLLM_ENGINE_KWARGS))
    sets += args.set or []
    command = [sys.executable, "-m", "rlasync", "train", str(CONFIG), "--overwrite_output_dir"]  # a rerun replaces it
    command += [x for s in sets for x in ("--set", s)]
    started = time.time()
    subprocess.run(command, check=True, cwd=ROOT)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result = _summary(records, args.warmup)
    result.update(wall_s=time.time() - started, command=" ".join(command[1:]))
    _merge(Path(args.out), f"system_{args.engine}", result)


# ---- report ---------------------------------------------------------------------------------------------------


def stage_report(args: argparse.Namespace) -> None:
    data = json.loads(Path(args.out).read_text())
    report: dict[str, Any] = {}
    for engine in ("torch", "vllm"):
        alone, system = data.get(f"engine_alone_{engine}"), data.get(f"system_{engine}")
        if alone and system and system.get("system_generated_tokens_per_s"):
            report[f"generation_ratio_system_over_engine_{engine}"] = (
                system["system_generated_tokens_per_s"] / alone["new_tokens_per_s"]
            )
            report[f"weight_sync_s_{engine}_sums"] = system["means_after_warmup"]["perf/weight_sync_s"]
    if args.vllm_check:
        check = json.loads(Path(args.vllm_check).read_text())
        report["vllm_check"] = check
    _merge(Path(args.out), "report", report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["engine", "system", "report"])
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    parser.add_argument("--out", default="bench/results/system_throughput_h200.json")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument(
        "--model",
        default=None,
        help="engine: a checkpoint (e.g. the system run's last) instead of the run file's model",
    )
    parser.add_argument("--engine-kwargs", default=None, help="engine: JSON overriding the engine's keyword arguments")
    parser.add_argument("--no-mixed-graphs", action="store_true", help="built-in engine: decode-only CUDA graphs")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="system: logged steps not counted")
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--rollout-actors", type=int, default=4)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--set", action="append", help="more `--set KEY=VALUE` for the training run")
    parser.add_argument("--vllm-check", default=None, help="a bench/vllm_throughput.py JSON to embed in the report")
    args = parser.parse_args()
    {"engine": stage_engine, "system": stage_system, "report": stage_report}[args.stage](args)


if __name__ == "__main__":
    main()
