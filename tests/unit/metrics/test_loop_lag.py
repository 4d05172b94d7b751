import asyncio
import time

import pytest

from rlasync.metrics.loop_lag import LoopLagMonitor


def test_a_blocked_loop_shows_its_blocking_time_and_take_max_resets():
    async def main():
        monitor = LoopLagMonitor(interval_s=0.002)
        monitor.start()
        await asyncio.sleep(0.02)
        quiet = monitor.take_max()
        time.sleep(0.15)  # synchronous work on the loop: nothing else runs meanwhile
        await asyncio.sleep(0.01)
        blocked = monitor.take_max()
        after = monitor.take_max()
        monitor.stop()
        return quiet, blocked, after

    quiet, blocked, after = asyncio.run(main())
    assert blocked >= 0.12
    assert quiet < 0.1
    assert after < blocked


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        LoopLagMonitor(0)
