"""How busy a process is: CPU seconds of all its threads per wall-clock second, between two readings.

A Python process whose host side is bound by the GIL reads close to 1.0 (one core's worth: only one thread runs
Python at a time, and the native work around it adds a little); well under 1.0 means it waits for something else
(the GPU, its callers). The GenerationActor reports it at each weight sync (`perf/generation_cpu_frac`, the busiest
engine), the queue actor with each take (`perf/queue_cpu_frac`): which process of a run that generates too slowly
is the one that is saturated.
"""

from __future__ import annotations

import os
import time


def process_cpu_s() -> float:
    """User + system CPU seconds of this process so far (every thread)."""
    times = os.times()
    return times.user + times.system


class ProcessCpu:
    def __init__(self) -> None:
        self._cpu, self._wall = process_cpu_s(), time.monotonic()

    def take(self) -> float:
        """CPU seconds per wall-clock second since the previous call (or since made); resets."""
        cpu, wall = process_cpu_s(), time.monotonic()
        elapsed = wall - self._wall
        frac = (cpu - self._cpu) / elapsed if elapsed > 0 else 0.0
        self._cpu, self._wall = cpu, wall
        return max(frac, 0.0)
