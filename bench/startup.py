"""Where a run's start-up goes: the seconds from the command to the first training step, by phase.

Runs `rlasync train CONFIG --set max_steps=1` (`--repeats` times, each in a fresh process and a fresh local Ray
cluster) and reads the first metrics record's `perf/startup/*_s`, which the Cluster measures while it builds the run
(docs/algorithms.md §8.3):

    ray         connecting to (or starting) Ray
    learners    until every learner rank is set up (model, optimizer; the engines and the other actors start meanwhile)
    engines     what the engines still needed after that (the wait in connect_weights)
    cold_sync   the first weight sync
    rollouts    starting the rollout loops
    total       from entering the Cluster to the rollouts started

Beside them: `command_to_first_step_s` (the command's start to the first metrics record: start-up, the first step's
rollouts and its learner step) and `first_step_s` (that record's `perf/step_s` where logged). Per phase, the median
over the repeats.

    python3 bench/startup.py --config configs/quickstart.yaml --repeats 3 --out bench/results/startup_cpu.json
    python3 bench/startup.py --config configs/sums_gpu.yaml --out $OUT/startup_h200.json     # one H200
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def first_record(metrics: Path) -> dict[str, Any]:
    """The first training record (a line with a `step`) of a metrics.jsonl."""
    for line in metrics.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if isinstance(record.get("step"), int):
                return record
    raise ValueError(f"{metrics}: no training record")


def phases(record: dict[str, Any]) -> dict[str, float]:
    """`perf/startup/<phase>_s` of a record as {phase: seconds}."""
    prefix = "perf/startup/"
    return {key[len(prefix) : -2]: float(value) for key, value in record.items() if key.startswith(prefix)}


def run_once(config: str, overrides: list[str], timeout_s: float) -> dict[str, Any]:
    """One `rlasync train CONFIG --set max_steps=1` in a temporary output folder: its start-up phases."""
    out = Path(tempfile.mkdtemp(prefix="rlasync_startup_"))
    command = [sys.executable, "-m", "rlasync", "train", config, "--set", "max_steps=1", "--set", f"output_dir={out}"]
    for override in overrides:
        command += ["--set", override]
    started = time.time()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        record = first_record(out / "metrics.jsonl")
        return {
            "phases_s": phases(record),
            "command_to_first_step_s": float(record["time"]) - started,
            "first_step_s": record.get("perf/step_s"),
            "command_s": time.time() - started,
        }
    finally:
        shutil.rmtree(out, ignore_errors=True)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase (and the two wall figures), the median over the runs."""
    names = sorted({name for run in runs for name in run["phases_s"]})
    return {
        "phases_s_median": {n: statistics.median(r["phases_s"][n] for r in runs if n in r["phases_s"]) for n in names},
        "command_to_first_step_s_median": statistics.median(r["command_to_first_step_s"] for r in runs),
        "command_s_median": statistics.median(r["command_s"] for r in runs),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--set", action="append", default=[], dest="overrides", help="KEY=VALUE, as rlasync train")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    parser.add_argument("--label", default="", help="a name for this measurement inside --out (merged)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    runs = [run_once(args.config, args.overrides, args.timeout_s) for _ in range(args.repeats)]
    result = {
        "command": " ".join(["python3", "bench/startup.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}",
        "config": args.config,
        "overrides": args.overrides,
        "runs": runs,
        **summarize(runs),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        path = Path(args.out)
        merged = json.loads(path.read_text()) if path.exists() else {}
        merged[args.label or args.config] = result
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(merged, indent=1))


if __name__ == "__main__":
    main()
