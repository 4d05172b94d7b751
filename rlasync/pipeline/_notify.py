"""A "something changed" signal for coroutines of one asyncio actor.

`notify()` wakes every coroutine currently waiting and arms a fresh event for later waiters, so a waiter that
checks its condition and then calls `wait()` (with no `await` in between) can never miss a change: it grabs
the current event before yielding. Waiters always re-check their condition after waking; a wake-up only means
"look again".
"""

from __future__ import annotations

import asyncio


class Notifier:
    """Wakes all waiters on `notify()`; an `asyncio.Event` that is replaced, never cleared."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float | None) -> bool:
        """Wait for the next `notify()`; True when notified, False when `timeout_s` ran out first."""
        event = self._event
        if timeout_s is None:
            await event.wait()
            return True
        if timeout_s <= 0:
            return False
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
