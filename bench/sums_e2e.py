"""The default SmolLM2 sums run end to end, per engine: seconds from the command to reward 0.9, syncs, rollout waits.

`rlasync train configs/sums_gpu.yaml` as shipped (SmolLM2-135M-Instruct, two-digit sums, learner and engine sharing
one GPU, CUDA IPC weight sync, 200 steps), only the engine switched (`--engines torch,vllm`, one after the other)
and every step logged (`logging_steps=1`: a metrics record per step, so the maximum sync is a step's and not a
window's mean). From each run's `metrics.jsonl` (`summarize`):

    seconds_to_reward_0_9  seconds from the command's start to the first step whose sampled reward, averaged over
                           the 10 steps up to it, is >= 0.9 (None: never)
    weight_sync_max_s      the largest `perf/weight_sync_s` of any step (with `_median_s`, `_p90_s`)
    rollout_wait_frac      mean `perf/rollout_wait_s` over mean `perf/step_s`, over the whole run (the steps that
                           have both: the first has no step time, its wait is the start-up's)

Each engine's numbers merge into `--out` under its name (`torch`, `vllm`), so the engines may run in two calls; a
variant (`--set KEY=VALUE`) under the name with its settings (`torch_token_budget_2048`).

    python3 bench/sums_e2e.py --engines torch --out $OUT/sums_e2e_h200.json            # one H200
    python3 bench/sums_e2e.py --engines vllm --out $OUT/sums_e2e_h200.json             # vLLM kit on PYTHONPATH
    python3 bench/sums_e2e.py --metrics RUN/metrics.jsonl --started EPOCH_S --engines torch --out FILE   # recompute
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "sums_gpu.yaml"
# vLLM in its own default mode (torch.compile with CUDA graphs), two engines on a quarter of the GPU each, as the
# config runs the built-in engine: on this task vLLM's front end (the GenerationActor's process) is bound by its
# per-request Python, and on one H100 two engines made 2.08x one's generated tokens/s, reached 0.9 in 231 s (one: not
# within 240 s) with the largest sync 127 ms against 474 (bench/results/sums_e2e_h100.json, 2026-12-07 03:43/03:47).
# Each engine's KV cache is a fixed 4 GB (`kv_cache_memory_bytes`): two engines cannot both size theirs by
# `gpu_memory_utilization` while the other is starting.
VLLM_ENGINE_KWARGS = {
    "max_model_len": 512,
    "gpu_memory_utilization": 0.2,
    "max_num_seqs": 256,
    "kv_cache_memory_bytes": 4_000_000_000,
}
# two vLLM engines fed by four rollout actors, as measured since 2026-12-07 (the file's default became four built-in
# engines and eight rollout actors; four vLLM processes at these memory settings would not fit beside the learner)
VLLM_CLUSTER = [
    "cluster.num_generation_actors=2",
    "cluster.generation_num_gpus=0.25",
    "cluster.num_rollout_actors=4",
    "cluster.rollout_num_cpus=1",
]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The training records of a metrics.jsonl (lines with a `step`), in step order; evaluation records left out
    (a `.gz` one, as kept under bench/results/e2e/, is read through gzip)."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return sorted((r for r in records if isinstance(r.get("step"), int)), key=lambda r: r["step"])


def _per_step(records: list[dict[str, Any]], key: str) -> list[tuple[int, float | None]]:
    """(step, value) for every step: a record logged every k steps holds its window's mean, given to each of them."""
    out: list[tuple[int, float | None]] = []
    previous = 0
    for record in records:
        value = record.get(key)
        value = float(value) if isinstance(value, int | float) else None
        out += [(step, value) for step in range(previous + 1, record["step"] + 1)]
        previous = max(previous, record["step"])
    return out


def seconds_to_reward(
    records: list[dict[str, Any]], started: float, threshold: float = 0.9, window: int = 10
) -> tuple[float | None, int | None]:
    """(seconds from `started`, step) of the first logged step whose sampled reward averaged over the `window`
    steps up to it reaches `threshold`; (None, None) if none does."""
    rewards = dict(_per_step(records, "reward"))
    for record in records:
        step = record["step"]
        if step < window:
            continue
        values = [rewards.get(s) for s in range(step - window + 1, step + 1)]
        values = [v for v in values if v is not None]
        if values and sum(values) / len(values) >= threshold:
            return record["time"] - started, step
    return None, None


def wait_and_step(records: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """Mean `perf/rollout_wait_s` and mean `perf/step_s` over the steps that have both: the first step has no step
    time (the driver times a step from the end of the one before), and its wait is the start-up's."""
    pairs = [
        (wait, step_s)
        for (_, wait), (_, step_s) in zip(_per_step(records, "perf/rollout_wait_s"), _per_step(records, "perf/step_s"))
        if wait is not None and step_s is not None
    ]
    if not pairs:
        return None, None
    return sum(w for w, _ in pairs) / len(pairs), sum(s for _, s in pairs) / len(pairs)


def _values(records: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), int | float) and r[key] == r[key]]  # not NaN


def _median(records: list[dict[str, Any]], key: str) -> float | None:
    values = _values(records, key)
    return statistics.median(values) if values else None


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = _values(records, key)
    return statistics.fmean(values) if values else None


SYNC_PARTS = ("dispatch", "pause", "transfer", "resume", "barrier", "pack", "calls", "finish")


def sync_parts(records: list[dict[str, Any]]) -> dict[str, dict[str, float | None]] | None:
    """Where the syncs' time went: per part of `perf/weight_sync_*` (docs/algorithms.md §6.1), its median over the
    run and its value at the step of the largest sync."""
    synced = [r for r in records if isinstance(r.get("perf/weight_sync_s"), int | float)]
    if not synced:
        return None
    largest = max(synced, key=lambda r: r["perf/weight_sync_s"])
    parts = {}
    for part in SYNC_PARTS:
        key = f"perf/weight_sync_{part}_s"
        if _values(synced, key):
            parts[part] = {"median_s": _median(synced, key), "at_max_s": largest.get(key)}
    return {**parts, "max_step": largest.get("step")}


STEP_PARTS = "step rollout_wait take train_call learner_step fwd_bwd optimizer pack fetch_samples finish_step weight_sync step_tail"


def step_parts(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """Where a step's time went, the mean of each `perf/*_s` part over the steps from the second on (the first
    compiles): `step` = `step_tail` + `take` (of which `rollout_wait`) + `train_call` (of which `learner_step`, in
    which `pack`, `fwd_bwd` and `optimizer`) + `finish_step` + `weight_sync`; `unaccounted` is what of `step` those
    parts do not cover (~0: the driver times them back to back)."""
    later = [r for r in records if r.get("step", 0) >= 2 and isinstance(r.get("perf/step_s"), int | float)]
    parts = {part: _mean(later, f"perf/{part}_s") for part in STEP_PARTS.split()}
    if parts["step"] is None or parts["train_call"] is None:
        return None  # a run from before the driver timed its parts
    covered = sum(parts[p] or 0.0 for p in ("step_tail", "take", "train_call", "finish_step", "weight_sync"))
    return {**{k: v for k, v in parts.items() if v is not None}, "unaccounted": parts["step"] - covered}


def summarize(
    records: list[dict[str, Any]], started: float, threshold: float = 0.9, window: int = 10
) -> dict[str, Any]:
    """The keys of `sums_e2e_h200.json` for one run (see the module docstring) and what they come from."""
    if not records:
        raise ValueError("no training records in metrics.jsonl: did the run log any step?")
    seconds, step = seconds_to_reward(records, started, threshold, window)
    syncs = [float(r["perf/weight_sync_s"]) for r in records if isinstance(r.get("perf/weight_sync_s"), int | float)]
    wait, step_s = wait_and_step(records)
    steps = [r["step"] for r in records]
    per_step = all(b - a == 1 for a, b in zip([0, *steps], steps))
    name = f"{threshold:g}".replace(".", "_")
    return {
        f"seconds_to_reward_{name}": seconds,
        f"step_at_reward_{name}": step,
        "weight_sync_max_s": max(syncs) if syncs else None,
        "weight_sync_median_s": statistics.median(syncs) if syncs else None,
        "weight_sync_p90_s": statistics.quantiles(syncs, n=10)[-1] if len(syncs) >= 2 else None,
        "weight_sync_max_is_per_step": per_step,  # False: records are window means, a step's maximum is hidden
        "rollout_wait_frac": wait / step_s if wait is not None and step_s else None,
        "mean_rollout_wait_s": wait,
        "mean_step_s": step_s,
        "first_step_rollout_wait_s": records[0].get("perf/rollout_wait_s") if steps[0] == 1 else None,
        "startup_s": {k.split("/")[-1]: v for k, v in records[0].items() if k.startswith("perf/startup/")} or None,
        # the generation side: new tokens/s and (built-in engine with CUDA graphs) the share of its steps no graph held
        "generated_tokens_per_s_median": _median(records, "rollout/generated_tokens_per_s"),
        "engine_eager_step_frac_mean": _mean(records, "rollout/engine_eager_step_frac"),
        "engine_fused_layers_frac_mean": _mean(records, "rollout/engine_fused_layers_frac"),
        # the longest step launch of any engine (0.1 s or more: a kernel compiled mid-run, which a sync waits for)
        "engine_launch_max_s": max(_values(records, "rollout/engine_launch_max_s"), default=None),
        # what a slow sync waited behind: the generation actor's event loop and its garbage collections
        "weight_sync_dispatch_max_s": max(_values(records, "perf/weight_sync_dispatch_s"), default=None),
        "weight_sync_parts": sync_parts(records),
        "step_parts": step_parts(records),
        "generation_loop_lag_max_s_median": _median(records, "perf/generation_loop_lag_max_s"),
        "generation_gc_max_s_median": _median(records, "perf/generation_gc_max_s"),
        "generation_gc_refreezes": max(_values(records, "perf/generation_gc_refreezes"), default=None),
        "learner_gc_max_s": max(_values(records, "perf/learner_gc_max_s"), default=None),
        "learner_gc_refreezes": max(_values(records, "perf/learner_gc_refreezes"), default=None),
        # which process is saturated (CPU seconds per second; ~1.0: bound by its GIL): the busiest engine, the queue,
        # the busiest rollout actor
        "generation_cpu_frac_median": _median(records, "perf/generation_cpu_frac"),
        "queue_cpu_frac_median": _median(records, "perf/queue_cpu_frac"),
        "queue_loop_lag_max_s_median": _median(records, "perf/queue_loop_lag_max_s"),
        "rollout_actor_cpu_frac_median": _median(records, "rollout/actor_cpu_frac_max"),
        "steps_logged": len(records),
        "last_step": steps[-1],
        "seconds_total": records[-1]["time"] - started,
        "reward_window": window,
        "reward_curve": [[r["step"], round(r["time"] - started, 2), r.get("reward")] for r in records],
    }


def train_command(
    engine: str,
    run_dir: Path,
    steps: int | None,
    sets: list[str],
    config: Path = CONFIG,
    vllm_kwargs: dict[str, Any] | None = None,
) -> list[str]:
    """`rlasync train configs/sums_gpu.yaml` (or `config`) with the engine, the output folder and per-step logging
    set; `vllm_kwargs` are merged into vLLM's engine arguments (e.g. `{"direct_sync": true}`)."""
    overrides = [f"output_dir={run_dir}", f"cluster.engine={engine}", "logging_steps=1"]
    if engine == "vllm":
        kwargs = {**VLLM_ENGINE_KWARGS, **(vllm_kwargs or {})}
        overrides += ["cluster.engine_kwargs=" + json.dumps(kwargs, separators=(",", ":")), *VLLM_CLUSTER]
    if steps:
        overrides.append(f"max_steps={steps}")
    command = [sys.executable, "-m", "rlasync", "train", str(config), "--overwrite_output_dir"]
    return command + [x for s in [*overrides, *sets] for x in ("--set", s)]


def merge(out: Path, engine: str, result: dict[str, Any]) -> None:
    data = json.loads(out.read_text()) if out.exists() else {}
    data.setdefault("what", "the default SmolLM2 sums run (configs/sums_gpu.yaml) end to end, per engine")
    data.setdefault("hardware", hardware())
    data[engine] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def run_engine(args: argparse.Namespace, engine: str) -> dict[str, Any]:
    run_dir = Path(args.run_root) / f"sums_{engine}"
    extra = getattr(args, "vllm_kwargs", None)  # a namespace built by hand (tests) may leave it out
    vllm_kwargs = json.loads(extra) if extra else None
    command = train_command(engine, run_dir, args.steps, args.set or [], Path(args.config), vllm_kwargs)
    print(f"--- {engine}: {' '.join(command)}", flush=True)
    metrics = run_dir / "metrics.jsonl"
    # a run before this one in the same folder (the command overwrites it): its records would say "done" at once
    metrics.unlink(missing_ok=True)
    started = time.time()
    done = None
    if args.stop_after_steps is not None:
        done = lambda: reached_and_ran(metrics, started, args.threshold, args.window, args.stop_after_steps)  # noqa: E731
    returncode, stopped = run_within(command, args.budget_s, done=done)
    wall_s = time.time() - started
    result: dict[str, Any] = {"command": " ".join(command[1:]), "returncode": returncode, "wall_s": wall_s}
    if stopped:  # SIGTERM: the run trained what it had taken and wrote a final checkpoint
        result["stopped_by"] = stopped
        result["stopped_at_s"] = wall_s
    if metrics.is_file():
        result.update(summarize(read_records(metrics), started, args.threshold, args.window))
    checkpoints = sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    result["checkpoint"] = str(checkpoints[-1]) if checkpoints else None  # a teacher for bench/distill_transfer.py
    return result


def reached_and_ran(metrics: Path, started: float, threshold: float, window: int, more_steps: int) -> bool:
    """Whether the run logging to `metrics` reached the threshold and then logged `more_steps` more steps."""
    try:
        records = read_records(metrics)
    except (OSError, ValueError):  # not written yet, or a line half written
        return False
    _, step = seconds_to_reward(records, started, threshold, window)
    return step is not None and records[-1]["step"] >= step + more_steps


def run_within(
    command: list[str],
    budget_s: float | None,
    grace_s: float = 90.0,
    done: Callable[[], bool] | None = None,
    poll_s: float = 2.0,
) -> tuple[int, str | None]:
    """Run `command`; past `budget_s`, or once `done()` says so (polled every `poll_s`), send it SIGTERM (the
    trainer stops admitting, trains what it took and writes a final checkpoint, as on a cluster's preemption) and
    wait `grace_s` more before killing it. Returns the exit code and what stopped it ("budget", "done" or None). A
    device call's own limit would kill this script with the run, leaving no summary and a checkpoint still being
    written."""
    process = subprocess.Popen(command, cwd=ROOT)
    deadline = None if budget_s is None else time.monotonic() + budget_s
    reason = "budget"
    while True:
        wait_s = poll_s if done is not None else None
        if deadline is not None:
            left = deadline - time.monotonic()
            wait_s = max(0.0, left if wait_s is None else min(wait_s, left))
        try:
            return process.wait(timeout=wait_s), None
        except subprocess.TimeoutExpired:
            pass
        if done is not None and done():
            reason = "done"
            break
        if deadline is not None and time.monotonic() >= deadline:
            break
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=grace_s), reason
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(), reason


def result_key(engine: str, sets: list[str] | None) -> str:
    """Where a run merges into `--out`: the engine's name for the config as shipped, a variant (`--set`) beside it
    (`torch_token_budget_2048`), so a variant never overwrites the default's figures."""
    if not sets:
        return engine
    return "_".join([engine, *(re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_") for s in sets)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="torch,vllm", help="comma-separated, run in this order: torch, vllm")
    parser.add_argument("--out", default="bench/results/sums_e2e_h200.json")
    parser.add_argument("--config", default=str(CONFIG), help="the run file (another one: a CPU smoke test)")
    parser.add_argument("--steps", type=int, default=None, help="max_steps (default: the run file's, 200)")
    parser.add_argument("--run-root", default="/tmp/sums_e2e", help="each engine's output_dir is RUN_ROOT/sums_ENGINE")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--window", type=int, default=10, help="steps the sampled reward is averaged over")
    parser.add_argument("--set", action="append", help="more `--set KEY=VALUE` for the training run")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop each run with SIGTERM after this many seconds (a final "
        "checkpoint is written; keep it ~100 s under the device call's limit)",
    )
    parser.add_argument(
        "--stop-after-steps",
        type=int,
        default=None,
        help="stop each run with SIGTERM this many steps after its reward reached the threshold (saves device time; "
        "the run's final checkpoint is then a teacher past the threshold)",
    )
    parser.add_argument(
        "--vllm-kwargs",
        default=None,
        help="JSON merged into vLLM's engine arguments (e.g. '{\"direct_sync\": true}'); the result key names it",
    )
    parser.add_argument("--metrics", default=None, help="recompute from this metrics.jsonl instead of training")
    parser.add_argument("--started", type=float, default=None, help="with --metrics: the command's start (epoch s)")
    args = parser.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ("torch", "vllm") for e in engines):
        parser.error(f"--engines {args.engines!r}: a comma-separated list of torch, vllm")
    if args.metrics:
        if args.started is None or len(engines) != 1:
            parser.error("--metrics needs --started (the command's start, epoch seconds) and one --engines name")
        result = summarize(read_records(Path(args.metrics)), args.started, args.threshold, args.window)
        result["metrics"] = args.metrics
        merge(Path(args.out), engines[0], result)
        print(json.dumps({k: v for k, v in result.items() if k != "reward_curve"}, indent=1))
        return
    for engine in engines:
        result = run_engine(args, engine)
        result["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        variant = list(args.set or [])
        if args.vllm_kwargs and engine == "vllm":
            variant.append(f"vllm_kwargs={args.vllm_kwargs}")
        result["sets"] = variant
        merge(Path(args.out), result_key(engine, variant), result)
        print(json.dumps({k: v for k, v in result.items() if k != "reward_curve"}, indent=1), flush=True)


if __name__ == "__main__":
    main()
