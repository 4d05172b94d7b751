"""Metrics: the reduction rules of docs/algorithms.md §8.1 (`reduce`) and where reduced records go (`sinks`).

Pure Python: no torch, no ray (TensorBoard is imported only when its sink is built).
"""

from rlasync.metrics.reduce import COUNTER_WORDS, MetricSink, MetricValue, reduce_values, reduction_for
from rlasync.metrics.sinks import ConsoleSink, JsonlSink, RecordSink, TensorBoardSink, build_sinks

__all__ = [
    "COUNTER_WORDS",
    "ConsoleSink",
    "JsonlSink",
    "MetricSink",
    "MetricValue",
    "RecordSink",
    "TensorBoardSink",
    "build_sinks",
    "reduce_values",
    "reduction_for",
]
