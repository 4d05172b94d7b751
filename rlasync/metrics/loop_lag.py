"""How late an asyncio event loop runs its callbacks: the symptom of a loop kept busy by synchronous work.

An actor that serves many coroutines on one loop (a GenerationActor with vLLM's AsyncLLM processes every engine output
there) starts a newly arrived call only when the loop gets to it. `LoopLagMonitor` sleeps `interval_s` in a loop and
records how much later than asked it woke; `take_max()` returns the worst lag since the previous call and resets it.
"""

from __future__ import annotations

import asyncio
import time


class LoopLagMonitor:
    def __init__(self, interval_s: float = 0.01) -> None:
        if interval_s <= 0:
            raise ValueError(f"LoopLagMonitor interval_s={interval_s}: must be > 0")
        self.interval_s = interval_s
        self._max = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sampling on the running loop (idempotent; call from a coroutine)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self._max = max(self._max, time.perf_counter() - asked - self.interval_s)

    def take_max(self) -> float:
        """The largest lag (seconds) seen since the last call; resets it."""
        worst, self._max = self._max, 0.0
        return max(worst, 0.0)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
