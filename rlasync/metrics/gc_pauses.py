"""Pauses of Python's garbage collector in this process: the other way, besides synchronous work, that an event
loop runs late (a full collection walks every tracked object; with vLLM's or torch's heap loaded that can take
hundreds of milliseconds).

`GcPauseMonitor` times every collection through `gc.callbacks`; `take()` returns the worst and the total pause,
and the number of collections, since the previous call. `freeze_heap()` collects once and moves every object
that survives into the permanent generation (`gc.freeze`), so later full collections only walk what was
allocated since: what vLLM does in its EngineCore after start-up, and what a long-lived actor does once its
engine is built.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauseMonitor:
    def __init__(self) -> None:
        self._started: float | None = None
        self._max = self._total = 0.0
        self._count = 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            pause = time.perf_counter() - self._started
            self._started = None
            self._max, self._total, self._count = max(self._max, pause), self._total + pause, self._count + 1

    def take(self) -> dict[str, float]:
        """`{"gc_max_s", "gc_total_s", "gc_collections"}` since the last call; resets them."""
        taken = {"gc_max_s": self._max, "gc_total_s": self._total, "gc_collections": float(self._count)}
        self._max = self._total = 0.0
        self._count = 0
        return taken

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def freeze_heap() -> int:
    """Collect, then freeze what survived (see the module doc); returns how many objects are frozen now."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
