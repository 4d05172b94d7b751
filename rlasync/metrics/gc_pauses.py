"""Pauses of Python's garbage collector in this process: the other way, besides synchronous work, that an event
loop runs late (a full collection walks every tracked object; with vLLM's or torch's heap loaded that can take
hundreds of milliseconds).

`GcPauseMonitor` times every collection through `gc.callbacks`; `take()` returns the worst and the total pause,
and the number of collections, since the previous call. `freeze_heap()` collects once and moves every object
that survives into the permanent generation (`gc.freeze`), so later full collections only walk what was
allocated since: what vLLM does in its EngineCore after start-up, and what a long-lived actor does once its
engine is built.

What a process builds after that freeze is walked by every full collection again. In a GenerationActor that is
mostly torch.compile's work done lazily at the first steps (the compiled sampler's first call leaves ~360k tracked
objects: dynamo's and inductor's modules, graphs and caches), which made each full collection take ~80 ms on an
H100 host, once every step or two of a GRPO run, each a stall of the engine's event loop that a weight sync waits
behind. `GcPauseMonitor(refreeze_over_s=...)` freezes again right after a full collection that took longer: at
that moment every tracked object has just survived a full collection, so what is frozen is live. The cost is that
objects then live and later left in a reference cycle are never collected; hence the cap on refreezes
(`max_refreezes`), and the threshold, which a heap of in-flight requests alone does not reach.
"""

from __future__ import annotations

import gc
import time
from typing import Any

REFREEZE_OVER_S = 0.02
"""The GenerationActor's `refreeze_over_s`: above what a heap of in-flight requests alone costs a full collection
(~5 ms for a thousand requests on a CPU core), well below the ~80 ms of a compiled sampler's heap."""

FULL_COLLECTION = 2
"""The generation a full collection reports in `gc.callbacks`' info (the oldest one)."""


class GcPauseMonitor:
    def __init__(self, refreeze_over_s: float | None = None, max_refreezes: int = 8) -> None:
        """`refreeze_over_s`: freeze the heap (`gc.freeze`) right after a full collection that took at least this
        long, at most `max_refreezes` times (see the module doc); None: never."""
        if refreeze_over_s is not None and not refreeze_over_s > 0:
            raise ValueError(f"refreeze_over_s={refreeze_over_s!r}: a positive number of seconds, or None")
        self.refreeze_over_s = refreeze_over_s
        self.max_refreezes = max_refreezes
        self.refreezes = 0  # in this process's life, not reset by take()
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
            if (
                self.refreeze_over_s is not None
                and info.get("generation") == FULL_COLLECTION
                and pause >= self.refreeze_over_s
                and self.refreezes < self.max_refreezes
            ):
                gc.freeze()  # what survived the collection just ended: live objects only
                self.refreezes += 1

    def take(self) -> dict[str, float]:
        """`{"gc_max_s", "gc_total_s", "gc_collections", "gc_refreezes"}`: the first three since the last call
        (reset by it), the last over the process's life."""
        taken = {
            "gc_max_s": self._max,
            "gc_total_s": self._total,
            "gc_collections": float(self._count),
            "gc_refreezes": float(self.refreezes),
        }
        self._max = self._total = 0.0
        self._count = 0
        return taken

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class CollectionHold:
    """Automatic garbage collection off for a short window that something else waits on (a weight sync: the learner
    is blocked until every engine has paused, loaded and resumed); a collection due inside the window runs after it.

    `hold()` disables automatic collection (`gc.disable`) unless something else already had; `release()` restores
    it (idempotent). A hold outlives its window only if no `release()` follows: `stale()` says so after `limit_s`,
    and `release_if_stale()` (called where the next work starts) ends it, so collection is never off for long.
    `holds` counts the windows held; `overdue` those ended by `release_if_stale`."""

    def __init__(self, limit_s: float = 5.0, clock: Any = time.monotonic) -> None:
        if not limit_s > 0:
            raise ValueError(f"limit_s={limit_s!r}: a positive number of seconds")
        self.limit_s = limit_s
        self._clock = clock
        self._since: float | None = None
        self._reenable = False
        self.holds = 0
        self.overdue = 0

    @property
    def held(self) -> bool:
        return self._since is not None

    def hold(self) -> None:
        if self._since is not None:
            return
        self._reenable = gc.isenabled()
        gc.disable()
        self._since = self._clock()
        self.holds += 1

    def release(self) -> None:
        if self._since is None:
            return
        self._since = None
        if self._reenable:
            gc.enable()

    def stale(self) -> bool:
        return self._since is not None and self._clock() - self._since > self.limit_s

    def release_if_stale(self) -> bool:
        """End a hold older than `limit_s` (its window's release never came); True if one was ended."""
        if not self.stale():
            return False
        self.overdue += 1
        self.release()
        return True


def freeze_heap() -> int:
    """Collect, then freeze what survived (see the module doc); returns how many objects are frozen now."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
