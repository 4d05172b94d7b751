"""One step's metrics of every learner rank reduced to one record (docs/algorithms.md §8.1 rules, across ranks instead of steps).

Each rank reports partial statistics of its own rows; `reduce_across_ranks` combines them with two all-reduces
(one SUM vector, one MAX vector), through a callable so this module needs no process group:

    rate pairs (num, den)                 -> (Σ num, Σ den)     e.g. `ratio`, `entropy`, `clip_ratio/*_mean`
    `*_total` / `*_count` and `sum_keys`  -> Σ                  e.g. `batch/trained_tokens_per_step` (all ranks' terms)
    `*_max` / `*_min`                     -> max / min          NaN (a rank without terms) is ignored
    anything else (gauges)                -> mean over ranks    e.g. `loss`, `perf/fwd_bwd_s`; NaN ignored

Every rank must report the same keys (checked: a signature of the key names rides in the MAX vector).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping

import torch

from rlasync.metrics import MetricValue, reduction_for

SUM_ACROSS_RANKS = frozenset({"batch/forwarded_tokens_per_step", "batch/trained_tokens_per_step"})
"""Per-step quantities whose meaning is "over all ranks" (docs/algorithms.md §8.2), though their window rule is a mean."""

AllReduce = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""`(sums, maxes) -> (sums summed over ranks, maxes maxed over ranks)`; float64 CPU tensors in and out."""


def reduce_across_ranks(
    metrics: Mapping[str, MetricValue], all_reduce: AllReduce, sum_keys: frozenset[str] = SUM_ACROSS_RANKS
) -> dict[str, MetricValue]:
    """This rank's `metrics` combined with every other rank's (the same call runs on every rank)."""
    keys = sorted(metrics)
    sums: list[float] = []
    maxes: list[float] = []
    plan: list[tuple[str, str, int]] = []  # (key, rule, slot)
    for key in keys:
        value = metrics[key]
        rule = "sum" if key in sum_keys and not isinstance(value, tuple) else reduction_for(key, value)
        if rule == "rate":
            plan.append((key, rule, len(sums)))
            sums += [float(value[0]), float(value[1])]  # type: ignore[index]
            continue
        number = float(value)  # type: ignore[arg-type]
        if rule in ("max", "min"):
            plan.append((key, rule, len(maxes)))
            maxes.append(-math.inf if math.isnan(number) else (number if rule == "max" else -number))
        else:  # sum, mean: (Σ value, number of ranks with a value)
            plan.append((key, rule, len(sums)))
            sums += [0.0, 0.0] if math.isnan(number) else [number, 1.0]
    signature = float(zlib.crc32("\n".join(keys).encode()))
    maxes += [signature, -signature]
    summed, maxed = all_reduce(torch.tensor(sums, dtype=torch.float64), torch.tensor(maxes, dtype=torch.float64))
    summed, maxed = summed.tolist(), maxed.tolist()
    if maxed[-2] != -maxed[-1]:
        raise RuntimeError(f"learner ranks reported different metric keys (this rank: {keys})")
    out: dict[str, MetricValue] = {}
    for key, rule, slot in plan:
        if rule == "rate":
            out[key] = (summed[slot], summed[slot + 1])
        elif rule in ("max", "min"):
            extreme = maxed[slot]
            out[key] = math.nan if math.isinf(extreme) else (extreme if rule == "max" else -extreme)
        else:
            total, count = summed[slot], summed[slot + 1]
            if count == 0:
                out[key] = math.nan
            else:
                out[key] = total if rule == "sum" else total / count
    return out


def local_all_reduce(sums: torch.Tensor, maxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-reduce of a world of one rank (nothing to combine)."""
    return sums, maxes
