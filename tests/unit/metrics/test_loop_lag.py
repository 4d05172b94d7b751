import asyncio
import time

import pytest

from rlasync.metrics.loop_lag import LoopLagMonitor, describe_stalls


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


def sleep_on_the_loop(seconds):  # a C call that lets the GIL go (as a blocking syscall does)
    time.sleep(seconds)


def spin_on_the_loop(seconds):  # Python that keeps the GIL (as a long pure-Python loop does)
    end = time.perf_counter() + seconds
    count = 0
    while time.perf_counter() < end:
        count += 1
    return count


def _stalls_of(block, seconds, stall_s=0.05):
    async def main():
        monitor = LoopLagMonitor(interval_s=0.002, stall_s=stall_s, poll_s=0.005)
        monitor.start()
        await asyncio.sleep(0.05)
        quiet = monitor.take_stalls()
        block(seconds)
        await asyncio.sleep(0.02)
        stalls = monitor.take_stalls()
        again = monitor.take_stalls()
        watchdog = monitor._watchdog
        monitor.stop()
        watchdog.join(1.0)
        return quiet, stalls, again, watchdog.is_alive()

    return asyncio.run(main())


@pytest.mark.parametrize("block", [sleep_on_the_loop, spin_on_the_loop])
def test_a_stalled_loop_is_sampled_where_it_stalls(block):
    quiet, stalls, again, alive = _stalls_of(block, 0.3)
    assert quiet == []  # an idle loop is never late by 50 ms
    assert stalls, "no stall sampled"
    top = stalls[0]
    assert top["stack"][-1].endswith(block.__name__) or any(block.__name__ in frame for frame in top["stack"][-2:])
    assert "test_loop_lag.py" in top["stack"][-1]
    assert top["samples"] >= 3  # ~0.25 s late: one sample per 5 ms, or per GIL handoff while the loop holds it
    assert 0.15 <= top["late_max_s"] <= 1.0
    assert again == []  # taken once
    assert not alive  # stop() ends the watchdog


def test_without_stall_s_there_is_no_watchdog():
    async def main():
        monitor = LoopLagMonitor(interval_s=0.002)
        monitor.start()
        time.sleep(0.1)
        await asyncio.sleep(0.01)
        stalls = monitor.take_stalls()
        watchdog = monitor._watchdog
        monitor.stop()
        return stalls, watchdog

    assert asyncio.run(main()) == ([], None)


def test_stall_threshold_and_poll_must_be_positive():
    with pytest.raises(ValueError, match="stall_s"):
        LoopLagMonitor(stall_s=0)
    with pytest.raises(ValueError, match="poll_s"):
        LoopLagMonitor(stall_s=0.1, poll_s=0)


def test_a_stall_is_described_by_its_worst_lateness_and_most_sampled_stack():
    stalls = [
        {
            "stack": ["engine/torch_engine.py:500 _run_overlapped", "engine/runner.py:396 unpack_packed"],
            "samples": 7,
            "late_max_s": 0.21,
        },
        {"stack": ["asyncio/base_events.py:1980 _run_once"], "samples": 2, "late_max_s": 0.26},
    ]
    text = describe_stalls(stalls, 0.1)
    assert "up to 0.26 s late" in text and "sampled 7 times while over 0.10 s late" in text
    assert text.endswith("\n  engine/torch_engine.py:500 _run_overlapped\n  engine/runner.py:396 unpack_packed")


def test_stall_reports_come_at_most_once_per_period_and_gather_the_samples_between():
    monitor = LoopLagMonitor(stall_s=0.1)
    stack = ("engine/runner.py:396 unpack_packed",)
    assert monitor.stall_report(every_s=60.0) is None  # nothing sampled yet
    monitor._record(stack, 0.2)
    first = monitor.stall_report(every_s=60.0)
    assert "up to 0.20 s late" in first and "sampled 1 times" in first
    monitor._record(stack, 0.3)
    monitor._record(stack, 0.25)
    assert monitor.stall_report(every_s=60.0) is None  # too soon: kept for the next report
    second = monitor.stall_report(every_s=0.0)
    assert "up to 0.30 s late" in second and "sampled 2 times" in second


def test_log_stalls_warns_with_the_report(caplog):
    import logging

    monitor = LoopLagMonitor(stall_s=0.1)
    logger = logging.getLogger("test.loop_lag")
    monitor.log_stalls(logger, "generation actor", every_s=60.0)
    assert not caplog.records  # no stall: no line
    monitor._record(("engine/torch_engine.py:500 _run_overlapped",), 0.22)
    with caplog.at_level(logging.WARNING, logger="test.loop_lag"):
        monitor.log_stalls(logger, "generation actor", every_s=60.0)
    (record,) = caplog.records
    assert record.getMessage().startswith("generation actor: its event loop ran up to 0.22 s late")
