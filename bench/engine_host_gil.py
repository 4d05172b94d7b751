"""The GenerationActor's host side and the GIL: what a thread that takes the GIL costs the built-in engine.

On a GPU the engine's host side (scheduling and recording tokens on the event loop; building the sampler's inputs,
launching and reading back each step in a worker thread) is Python, so anything else that wakes in the process takes
the GIL from it. This bench runs one TorchEngine (asynchronous scheduling on) with short GRPO-like requests (many
requests of few tokens, 8 log-probs, seeded) under variants, in alternating rounds in one process:

    base             the loop-lag monitor waking every 50 ms (as the GenerationActor runs it)
    launch_on_loop   the same, each step's launch on the event loop (`TorchEngine.launch_on_loop`)
    monitor_10ms     the loop-lag monitor waking every 10 ms (as it did before 2026-12-06)
    watchdog_5ms     the 50 ms monitor plus the stall watchdog polling every 5 ms (`cluster.generation_stall_s`'s thread)
    switch_1ms       base with the interpreter's GIL switch interval at 1 ms (`sys.setswitchinterval`; Python's is 5 ms)
    switch_0.5ms     the same at 0.5 ms (`cluster.gil_switch_interval_s`)

and reports each variant's median new tokens/s and its ratio over base. The model is tiny (engine_throughput's
tiny Qwen3), so its forward is small, so the host side dominates as it does for SmolLM2 on a GPU; it is a
part of the system, not the system: the sums run's A/B is `bench/device_runs.sh e2e_ab`.

    python3 bench/engine_host_gil.py --device cpu --out bench/results/engine_host_gil_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_throughput import qwen3_06b_config  # noqa: E402

from rlasync.engine import SamplingParams, TorchEngine  # noqa: E402
from rlasync.metrics.loop_lag import LoopLagMonitor  # noqa: E402

VARIANTS = {
    # name: (launch on the loop, monitor interval s, watchdog poll s or None, GIL switch interval s or None)
    "base": (False, 0.05, None, None),
    "launch_on_loop": (True, 0.05, None, None),
    "monitor_10ms": (False, 0.01, None, None),
    "watchdog_5ms": (False, 0.05, 0.005, None),
    "switch_1ms": (False, 0.05, None, 0.001),
    "switch_0.5ms": (False, 0.05, None, 0.0005),
}


def tiny_qwen3(vocab: int) -> torch.nn.Module:
    """engine_throughput's tiny Qwen3 with `vocab` tokens."""
    from transformers import AutoModelForCausalLM

    config = qwen3_06b_config(tiny=True)
    config.vocab_size, config.max_position_embeddings = vocab, 512
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


async def one_round(engine: TorchEngine, variant: str, args: argparse.Namespace, round_index: int) -> dict:
    launch_on_loop, interval_s, poll_s, switch_s = VARIANTS[variant]
    engine.launch_on_loop = launch_on_loop
    default_switch_s = sys.getswitchinterval()
    sys.setswitchinterval(switch_s or default_switch_s)
    # stall_s tiny: the watchdog polls at poll_s and samples whenever the loop is the least late (the cost asked for)
    monitor = LoopLagMonitor(interval_s=interval_s, stall_s=1e-6 if poll_s else None, poll_s=poll_s or 0.02)
    monitor.start()
    prompts = [
        [(7 * i + 3 * j + round_index) % (args.vocab - 1) + 1 for j in range(args.prompt_len)]
        for i in range(args.requests // args.group)
    ]
    params = [
        SamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, num_logprobs=8, seed=i)
        for i in range(args.group)
    ]
    start = time.perf_counter()
    try:
        outputs = await asyncio.gather(*(engine.generate(p, s) for p in prompts for s in params))
    finally:
        monitor.stop()
        sys.setswitchinterval(default_switch_s)
    seconds = time.perf_counter() - start
    generated = sum(len(o.output_ids) for o in outputs)
    return {
        "variant": variant,
        "seconds": seconds,
        "new_tokens_per_s": generated / seconds,
        "lag_max_s": monitor.take_max(),
    }


async def run(args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        torch.set_num_threads(1)  # as the GenerationActor on a CPU
    model = tiny_qwen3(args.vocab)
    engine = TorchEngine(
        model,
        device=args.device,
        max_model_len=256,
        max_num_seqs=args.requests,
        async_scheduling=True,
        kv_cache_tokens=args.requests * (args.prompt_len + args.new_tokens) * 2,
    )
    names = list(VARIANTS)
    await one_round(engine, "base", args, 0)  # warm-up (lazy init, first allocations)
    rounds = []
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else names[::-1]  # alternate, so no variant always runs first
        for name in order:
            rounds.append(await one_round(engine, name, args, round_index + 1))
    await engine.close()
    medians = {name: statistics.median(r["new_tokens_per_s"] for r in rounds if r["variant"] == name) for name in names}
    return {
        "rounds": rounds,
        "new_tokens_per_s": {name: round(value, 1) for name, value in medians.items()},
        "over_base": {name: round(medians[name] / medians["base"], 3) for name in names if name != "base"},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=128, help="requests at once (groups of --group per prompt)")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=6, help="rounds per variant (alternating order)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.requests % args.group:
        parser.error(f"--requests {args.requests} must be a multiple of --group {args.group}")
    result = {
        "what": __doc__.splitlines()[0],
        "command": "python3 bench/engine_host_gil.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "hardware": {"python": platform.python_version(), "torch": torch.__version__, "device": args.device},
        "settings": vars(args),
        **asyncio.run(run(args)),
    }
    print(json.dumps({k: result[k] for k in ("new_tokens_per_s", "over_base")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
