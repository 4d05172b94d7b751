"""Metric records and the reduction rules of docs/algorithms.md §8.1.

A value is a float or a `(numerator, denominator)` pair. Within a logging window, per key:
  1. pairs -> rate = sum(num) / sum(den) (NaN if the denominators sum to 0) -- never a mean of ratios;
  2. otherwise the words of the key's last path component (split on "_") decide: "total" or "count" ->
     sum (a counter); else "max" -> max; else "min" -> min (whole words only: `perf/maximal_s` is a gauge);
  3. a running total (`LAST_KEYS`, e.g. `num_tokens`) -> its last value;
  4. otherwise -> mean (a gauge).
NaN floats are discarded first; a key whose values were all NaN reduces to None.
Pure Python: no torch, no ray.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Literal

from rlasync.records import MetricValue

Reduction = Literal["rate", "sum", "max", "min", "last", "mean"]

COUNTER_WORDS = ("total", "count")
LAST_KEYS = frozenset({"num_tokens"})  # running totals: the window reports the latest value


def reduction_for(key: str, value: MetricValue) -> Reduction:
    """Which rule of docs/algorithms.md §8.1 reduces `key` (given one of its values)."""
    if isinstance(value, tuple):
        return "rate"
    if key in LAST_KEYS:
        return "last"
    words = key.rsplit("/", 1)[-1].split("_")
    if any(word in words for word in COUNTER_WORDS):
        return "sum"
    if "max" in words:
        return "max"
    if "min" in words:
        return "min"
    return "mean"


def reduce_values(key: str, values: list[MetricValue]) -> float | None:
    """Reduce one key's window of values; None when every value was NaN (or there were none)."""
    if not values:
        return None
    rule = reduction_for(key, values[0])
    if rule == "rate":
        num = sum(float(v[0]) for v in values)  # type: ignore[index]
        den = sum(float(v[1]) for v in values)  # type: ignore[index]
        return num / den if den != 0 else math.nan
    floats = [float(v) for v in values if not math.isnan(float(v))]  # type: ignore[arg-type]
    if not floats:
        return None
    if rule == "sum":
        return sum(floats)
    if rule == "max":
        return max(floats)
    if rule == "min":
        return min(floats)
    if rule == "last":
        return floats[-1]
    return sum(floats) / len(floats)


def compress_items(items: Iterable[tuple[str, MetricValue]]) -> list[tuple[str, MetricValue]]:
    """`items` with each key's values folded into one where its rule allows without changing any window they join:
    rate pairs summed into one pair, counters summed, max / min / last kept; a gauge (mean) keeps every value, as a
    key whose values mix floats and pairs does (the sink raises on it). The first-seen order of keys is kept. A
    rollout actor drains thousands of items a step late in a GRPO run (~11 a rollout, every dropped group's too):
    folded there, the driver receives and adds a few hundred."""
    values: dict[str, list[MetricValue]] = {}
    for key, value in items:
        values.setdefault(key, []).append(tuple(value) if isinstance(value, list) else value)
    out: list[tuple[str, MetricValue]] = []
    for key, seen in values.items():
        pairs = [isinstance(v, tuple) for v in seen]
        if len(seen) == 1 or (any(pairs) and not all(pairs)):
            out += [(key, v) for v in seen]
            continue
        rule = reduction_for(key, seen[0])
        if rule == "rate":
            out.append((key, (sum(float(v[0]) for v in seen), sum(float(v[1]) for v in seen))))  # type: ignore[index]
        elif rule == "mean":
            out += [(key, v) for v in seen]
        else:  # a counter, max, min or last: the window's own reduction of these values (all NaN: NaN again)
            value = reduce_values(key, seen)
            out.append((key, math.nan if value is None else value))
    return out


class MetricSink:
    """Collects metric values over a logging window and reduces them by docs/algorithms.md §8.1's rules.

    A key must keep one shape (float or pair) for its whole life; mixing them is a bug and raises.
    """

    def __init__(self) -> None:
        self._values: dict[str, list[MetricValue]] = defaultdict(list)

    def add(self, key: str, value: MetricValue) -> None:
        if isinstance(value, list):
            value = tuple(value)  # pairs may arrive as lists after JSON/Ray round trips
        if isinstance(value, tuple):
            if len(value) != 2:
                raise ValueError(f"metric {key!r}: a rate is a (numerator, denominator) pair, got {value!r}")
            value = (float(value[0]), float(value[1]))
        else:
            value = float(value)
        seen = self._values.get(key)
        if seen and isinstance(seen[0], tuple) != isinstance(value, tuple):
            raise ValueError(f"metric {key!r} was logged both as a rate pair and as a float; keep one shape")
        self._values[key].append(value)

    def update(self, metrics: Mapping[str, MetricValue] | Iterable[tuple[str, MetricValue]]) -> None:
        items = metrics.items() if isinstance(metrics, Mapping) else metrics
        for key, value in items:
            self.add(key, value)

    def items(self) -> list[tuple[str, MetricValue]]:
        """Every value of the window as (key, value) items, in the order added per key (for another sink)."""
        return [(key, value) for key, values in self._values.items() for value in values]

    def __len__(self) -> int:
        return len(self._values)

    def reduce(self, clear: bool = True) -> dict[str, float | None]:
        """Reduce every key of the window; clears the window unless `clear=False`."""
        out = {key: reduce_values(key, values) for key, values in sorted(self._values.items())}
        if clear:
            self._values.clear()
        return out
