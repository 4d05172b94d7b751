"""Packing metrics of one micro-batch (docs/algorithms.md §4.6, catalogue §8.2).

`packing_metrics(rows, token_budget)` returns metric key -> value, where a value is a float (a gauge, reduced by
its key's rule) or a `(numerator, denominator)` pair for a rate (reduced as Σnum / Σden over the window).

Rows are the planned `TreeRow`s (one per rank); "unique" tokens are a row's trie nodes, "raw" tokens the Σ of
its sample lengths, "load" its Σ (depth + 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rlasync.metrics import MetricValue
from rlasync.packing.trie import TreeRow
from rlasync.records import PackableSample


def packing_metrics(
    rows: Sequence[TreeRow], token_budget: int | None = None, *, dropped_oversize_count: int | None = None
) -> dict[str, MetricValue]:
    """Collator metrics of one micro-batch.

    `batch/row_fill_frac` is present only with a positive `token_budget`; `batch/dropped_oversize_count` only
    when `dropped_oversize_count` is given (the planner's drops since the previous micro-batch). Every key of the
    samples' `metrics` is averaged over the samples carrying it, NaN ignored (NaN if all are NaN).
    """
    samples = [sample for row in rows for sample in row.samples]
    if not samples:
        raise ValueError("packing_metrics: the micro-batch holds no sample")
    metrics: dict[str, MetricValue] = {}
    metrics.update(_sample_metrics(samples))
    metrics.update(_row_metrics(rows, len(samples), token_budget))
    metrics.update(_carried_metrics(samples))
    if dropped_oversize_count is not None:
        metrics["batch/dropped_oversize_count"] = float(dropped_oversize_count)
    return metrics


def _sample_metrics(samples: Sequence[PackableSample]) -> dict[str, MetricValue]:
    lengths = [len(sample) for sample in samples]
    trained = [sample.num_trained_tokens for sample in samples]
    raw = sum(lengths)
    return {
        "sample/forwarded_tokens_mean": raw / len(samples),
        "sample/forwarded_tokens_max": float(max(lengths)),
        "sample/trained_tokens_mean": sum(trained) / len(samples),
        "batch/masked_token_frac": (float(raw - sum(trained)), float(raw)),
    }


def _row_metrics(rows: Sequence[TreeRow], num_samples: int, token_budget: int | None) -> dict[str, MetricValue]:
    unique = [row.num_tokens for row in rows]
    loads = [row.load for row in rows]
    num_rows = len(rows)
    slots = num_rows * max(unique)  # the rectangular [P, max N] broadcast batch
    metrics: dict[str, MetricValue] = {
        "batch/samples_per_row": num_samples / num_rows,
        "batch/row_tokens_mean": sum(unique) / num_rows,
        "batch/row_tokens_max": float(max(unique)),
        "batch/row_imbalance": max(loads) / (sum(loads) / num_rows),
        "batch/packing_ratio": (float(sum(row.num_raw_tokens for row in rows)), float(sum(unique))),
        "batch/pad_frac": (float(slots - sum(unique)), float(slots)),
    }
    if token_budget is not None and token_budget > 0:
        metrics["batch/row_fill_frac"] = (float(sum(unique)), float(token_budget * num_rows))
    return metrics


def _carried_metrics(samples: Sequence[PackableSample]) -> dict[str, float]:
    """Mean of every per-sample metric over the samples carrying it, ignoring NaN (NaN if none is finite)."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        for key, value in sample.metrics.items():
            values.setdefault(key, []).append(float(value))
    return {key: _nan_mean(vals) for key, vals in values.items()}


def _nan_mean(values: list[float]) -> float:
    kept = [value for value in values if not math.isnan(value)]
    return sum(kept) / len(kept) if kept else math.nan
