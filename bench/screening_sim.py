"""Would screening a prompt with a few rollouts before generating its whole group cut the learner's wait? (issue 35)

Late in the default SmolLM2 sums run ~85% of groups are dropped for zero reward spread and the learner waits ~75% of
the step for the engines to generate the kept groups. Screening (as SPEED-style online curricula do) generates `k`
of a prompt's `G` rollouts first and the other `G - k` only if those `k` rewards differ, so a prompt the policy
always solves costs `k` rollouts instead of `G`. It also drops every group whose first `k` agree but whose full
group would have had spread: those are the informative groups of a nearly solved task (7 of 8 right).

For binary rewards each step of a real run gives two numbers: the mean reward `m` and the share of zero-spread groups
`z`. Per step, this fits a Beta(a, b) distribution of per-prompt pass rates with mean `m` and
`P(all G equal) = E[p^G + (1 - p)^G] = z` (one-dimensional root on a + b; Beta moments are exact) and reads, for
each `k`:

    kept_frac           share of prompts whose group is trained:  E[1 - p^k - (1 - p)^k]     (k = G: no screening)
    rollouts_per_kept   generated rollouts per trained group:     (k + kept_frac_k × (G - k)) / kept_frac_k
    informative_lost    share of the groups with spread that screening drops
    rollout_saving      rollouts_per_kept without screening over with it (> 1: fewer rollouts per trained group)

The run's rollout wait bounds what a saving can buy: with generation the bottleneck, a step's time scales with
rollouts per trained group, so the wait falls from `w` to `1 - (1 - w) × saving` at best.

    python3 bench/screening_sim.py --metrics bench/results/e2e/sums_torch_h100_2026_12_06_1535_metrics.jsonl.gz \
        --out bench/results/screening_sim_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def all_equal(a: float, b: float, n: int) -> float:
    """P(n binary rewards all equal) for a prompt whose pass rate p ~ Beta(a, b): E[p^n] + E[(1 - p)^n], exact."""
    base = _log_beta(a, b)
    return math.exp(_log_beta(a + n, b) - base) + math.exp(_log_beta(a, b + n) - base)


def fit_beta(mean: float, zero_spread: float, group_size: int) -> tuple[float, float] | None:
    """Beta(a, b) with the given mean and P(all `group_size` binary rewards equal) = `zero_spread`; None when no
    Beta fits (zero spread at or below what independent draws at the mean give, or a mean at the ends)."""
    if not (0.0 < mean < 1.0) or not (0.0 < zero_spread < 1.0):
        return None

    def gap(log_c: float) -> float:  # falls as a + b grows (p concentrates at the mean)
        c = math.exp(log_c)
        return all_equal(mean * c, (1 - mean) * c, group_size) - zero_spread

    low, high = math.log(1e-4), math.log(1e6)
    if gap(low) < 0 or gap(high) > 0:
        return None
    for _ in range(80):
        mid = (low + high) / 2
        low, high = (mid, high) if gap(mid) > 0 else (low, mid)
    c = math.exp((low + high) / 2)
    return mean * c, (1 - mean) * c


def screening(a: float, b: float, group_size: int, k: int) -> dict[str, float]:
    """The module docstring's figures for screening with `k` rollouts (k = group_size: none), p ~ Beta(a, b)."""
    spread_full = 1 - all_equal(a, b, group_size)
    kept = 1 - all_equal(a, b, k)
    rollouts = k + kept * (group_size - k)
    return {
        "kept_frac": kept,
        "rollouts_per_kept": rollouts / kept if kept > 0 else math.inf,
        "informative_lost": max(spread_full - kept, 0.0) / spread_full if spread_full > 0 else 0.0,
    }


def per_step(rows: list[dict[str, Any]], group_size: int, ks: list[int]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        mean, zero_spread = row.get("reward"), row.get("frac_zero_std_groups")
        if not isinstance(mean, (int, float)) or not isinstance(zero_spread, (int, float)):
            continue
        fit = fit_beta(float(mean), float(zero_spread), group_size)
        if fit is None:
            continue
        base = screening(*fit, group_size, group_size)
        entry: dict[str, Any] = {"step": row.get("step"), "reward": mean, "frac_zero_std_groups": zero_spread}
        entry["beta"] = [round(fit[0], 4), round(fit[1], 4)]
        entry["rollouts_per_kept_unscreened"] = base["rollouts_per_kept"]
        for k in ks:
            figures = screening(*fit, group_size, k)
            figures["rollout_saving"] = base["rollouts_per_kept"] / figures["rollouts_per_kept"]
            entry[f"k{k}"] = figures
        wait, step = row.get("perf/rollout_wait_s"), row.get("perf/step_s")
        if isinstance(wait, (int, float)) and isinstance(step, (int, float)) and step > 0:
            entry["rollout_wait_frac"] = wait / step
        out.append(entry)
    return out


def summarise(steps: list[dict[str, Any]], ks: list[int], late_from: float) -> dict[str, Any]:
    late = [s for s in steps if s["frac_zero_std_groups"] >= late_from]
    summary: dict[str, Any] = {"steps_fitted": len(steps), "late_steps": len(late), "late_from_zero_std": late_from}
    for k in ks:
        for name, group in (("all", steps), ("late", late)):
            if not group:
                continue
            saving = float(np.mean([s[f"k{k}"]["rollout_saving"] for s in group]))
            lost = float(np.mean([s[f"k{k}"]["informative_lost"] for s in group]))
            item = {"rollout_saving_mean": saving, "informative_lost_mean": lost}
            waits = [s["rollout_wait_frac"] for s in group if "rollout_wait_frac" in s]
            if waits:
                wait = float(np.mean(waits))
                item["rollout_wait_frac_run"] = wait
                item["rollout_wait_frac_best_case"] = max(0.0, 1 - (1 - wait) * saving)
            summary[f"k{k}_{name}"] = item
    return summary


def read_rows(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--metrics", type=Path, required=True, help="a run's metrics.jsonl (or .jsonl.gz)")
    parser.add_argument("--group-size", type=int, default=8, help="num_generations of the run (default 8)")
    parser.add_argument("--screen", default="2,3,4", help="screening sizes k to read (default 2,3,4)")
    parser.add_argument("--late-from", type=float, default=0.7, help="zero-spread share from which a step is late")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.screen.split(",")]
    if any(not 1 < k < args.group_size for k in ks):
        parser.error(f"--screen: every k must be between 2 and group size - 1 = {args.group_size - 1}")
    steps = per_step(read_rows(args.metrics), args.group_size, ks)
    result = {
        "benchmark": "screening_sim: rollouts per trained group with k-rollout screening, fitted to a real run",
        "command": "python3 " + shlex.join(["bench/screening_sim.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "metrics": str(args.metrics),
        "group_size": args.group_size,
        "summary": summarise(steps, ks, args.late_from),
        "steps": steps,
    }
    print(json.dumps(result["summary"], indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
