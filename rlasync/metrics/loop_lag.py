"""How late an asyncio event loop runs its callbacks: the symptom of a loop kept busy by synchronous work.

An actor that serves many coroutines on one loop (a GenerationActor with vLLM's AsyncLLM processes every engine output
there) starts a newly arrived call only when the loop gets to it. `LoopLagMonitor` sleeps `interval_s` in a loop and
records how much later than asked it woke; `take_max()` returns the worst lag since the previous call and resets it.

With `stall_s`, a watchdog thread also says where a late loop is: every `poll_s` it compares the monitor's last wake
with the clock, and while the loop is more than `stall_s` late it samples the loop thread's Python stack
(`sys._current_frames`). `take_stalls()` returns the stacks seen most, with their sample counts (one per `poll_s`
while the loop lets the GIL go; while it holds the GIL, one per handoff of it, `sys.getswitchinterval()` apart) and
the worst lateness at which each was seen. A loop thread that waits for the GIL, or runs the event loop's own C code,
shows only the frames above that (for a thread started on a C function: `threading.py ... run`); one that runs Python
shows that code. Each wake of the watchdog takes the GIL from whichever thread holds it, a cost where the host side
is GIL-bound (a GenerationActor on a GPU: a sums run with a 5 ms watchdog generated 19% fewer tokens a second than the
run before it, 2026-12-06, not an A/B; on a CPU, bench/engine_host_gil.py: 3% fewer), so it is a diagnostic, off
unless `stall_s` is given, polling at 20 ms.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import threading
import time
import traceback
from typing import Any

STACK_DEPTH = 12  # innermost frames kept of a sampled stack


class LoopLagMonitor:
    def __init__(self, interval_s: float = 0.01, *, stall_s: float | None = None, poll_s: float = 0.02) -> None:
        if interval_s <= 0:
            raise ValueError(f"LoopLagMonitor interval_s={interval_s}: must be > 0")
        if stall_s is not None and not stall_s > 0:
            raise ValueError(f"LoopLagMonitor stall_s={stall_s}: must be > 0, or None for no stall sampling")
        if not poll_s > 0:
            raise ValueError(f"LoopLagMonitor poll_s={poll_s}: must be > 0")
        self.interval_s, self.stall_s, self.poll_s = interval_s, stall_s, poll_s
        self._max = 0.0
        self._task: asyncio.Task[None] | None = None
        self._beat = time.perf_counter()  # when the monitor last asked to sleep (the watchdog's reference)
        self._loop_thread: int | None = None
        self._watchdog: threading.Thread | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._stall_samples: collections.Counter[tuple[str, ...]] = collections.Counter()
        self._stall_worst: dict[tuple[str, ...], float] = {}
        self._reported_at: float | None = None

    def start(self) -> None:
        """Start sampling on the running loop (idempotent; call from a coroutine)."""
        if self._task is None or self._task.done():
            self._loop_thread = threading.get_ident()
            self._beat = time.perf_counter()
            self._task = asyncio.get_running_loop().create_task(self._run())
        if self.stall_s is not None and (self._watchdog is None or not self._watchdog.is_alive()):
            self._stopped.clear()
            self._watchdog = threading.Thread(target=self._watch, name="loop-stall-watchdog", daemon=True)
            self._watchdog.start()

    async def _run(self) -> None:
        while True:
            asked = self._beat = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self._max = max(self._max, time.perf_counter() - asked - self.interval_s)

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            late = time.perf_counter() - self._beat - self.interval_s
            if late > self.stall_s and self._loop_thread is not None:
                frame = sys._current_frames().get(self._loop_thread)
                if frame is not None:
                    self._record(stack_of(frame), late)

    def _record(self, stack: tuple[str, ...], late: float) -> None:
        with self._lock:
            self._stall_samples[stack] += 1
            self._stall_worst[stack] = max(self._stall_worst.get(stack, 0.0), late)

    def take_max(self) -> float:
        """The largest lag (seconds) seen since the last call; resets it."""
        worst, self._max = self._max, 0.0
        return max(worst, 0.0)

    def take_stalls(self, top: int = 3) -> list[dict[str, Any]]:
        """The `top` stacks the loop thread was sampled in while late since the last call, most samples first: each
        `{"stack": [innermost frame last], "samples": n, "late_max_s": s}`; resets them."""
        with self._lock:
            samples, worst = self._stall_samples, self._stall_worst
            self._stall_samples, self._stall_worst = collections.Counter(), {}
        return [
            {"stack": list(stack), "samples": count, "late_max_s": round(worst[stack], 4)}
            for stack, count in samples.most_common(top)
        ]

    def stall_report(self, every_s: float) -> str | None:
        """`describe_stalls` of the stalls since the last report, at most once every `every_s` seconds (the samples
        add up meanwhile); None when it is too soon or there were none."""
        now = time.monotonic()
        if self._reported_at is not None and now - self._reported_at < every_s:
            return None
        stalls = self.take_stalls()
        if not stalls:
            return None
        self._reported_at = now
        return describe_stalls(stalls, self.stall_s or 0.0)

    def log_stalls(self, logger: logging.Logger, who: str, every_s: float = 60.0) -> None:
        """`stall_report(every_s)` as a warning of `logger`, when there is one."""
        report = self.stall_report(every_s)
        if report:
            logger.warning("%s: %s", who, report)

    def stop(self) -> None:
        self._stopped.set()
        if self._task is not None:
            self._task.cancel()
            self._task = None


def describe_stalls(stalls: list[dict[str, Any]], stall_s: float) -> str:
    """One log message of `take_stalls()`'s answer (not empty): how late the loop ran, and its most sampled stack."""
    top = stalls[0]
    frames = "\n  ".join(top["stack"])
    return (
        f"its event loop ran up to {max(stall['late_max_s'] for stall in stalls):.2f} s late (a call arriving then "
        f"waits as long: a weight sync's too); sampled {top['samples']} times while over {stall_s:.2f} s late in:"
        f"\n  {frames}"
    )


def stack_of(frame: Any, depth: int = STACK_DEPTH) -> tuple[str, ...]:
    """`frame`'s innermost `depth` frames as `file:line function` (outermost first)."""
    entries = traceback.extract_stack(frame)[-depth:]
    return tuple(f"{_short(entry.filename)}:{entry.lineno} {entry.name}" for entry in entries)


def _short(path: str) -> str:
    """The last two parts of a source path (`engine/runner.py`)."""
    return "/".join(path.replace("\\", "/").rsplit("/", 2)[-2:])
