"""GcPauseMonitor times real collections; freeze_heap makes later full collections skip the frozen heap."""

import gc
import time

import pytest

from rlasync.metrics.gc_pauses import CollectionHold, GcPauseMonitor, freeze_heap


class Node:
    def __init__(self):
        self.other = None


def cycles(count):
    nodes = [Node() for _ in range(count)]
    for a, b in zip(nodes, nodes[1:] + nodes[:1]):
        a.other = b
    return nodes


def test_the_monitor_times_each_collection_and_resets():
    monitor = GcPauseMonitor()
    try:
        keep = cycles(200_000)
        monitor.take()  # the collections the allocations set off
        started = time.perf_counter()
        gc.collect()
        gc.collect()
        elapsed = time.perf_counter() - started
        taken = monitor.take()
        assert taken["gc_collections"] >= 2
        assert 0 < taken["gc_max_s"] <= taken["gc_total_s"] <= elapsed
        assert monitor.take() == {"gc_max_s": 0.0, "gc_total_s": 0.0, "gc_collections": 0.0, "gc_refreezes": 0.0}
        del keep
    finally:
        monitor.close()
    gc.collect()
    assert monitor.take()["gc_collections"] == 0  # closed: no longer called


def test_a_frozen_heap_is_not_walked_again():
    keep = cycles(300_000)
    monitor = GcPauseMonitor()
    try:
        gc.collect()
        monitor.take()
        for _ in range(3):
            gc.collect()
        walked = monitor.take()["gc_max_s"]
        assert freeze_heap() >= 300_000
        monitor.take()
        for _ in range(3):
            gc.collect()
        frozen = monitor.take()["gc_max_s"]
        assert frozen < walked / 3  # the 300k live objects are no longer traversed
    finally:
        monitor.close()
        gc.unfreeze()
        del keep


def test_a_slow_full_collection_freezes_what_survived_it_up_to_the_cap():
    """`refreeze_over_s`: the heap built after the first freeze (here 300k live objects in cycles) is frozen right
    after the full collection that walked it slowly, so the next full collections are fast again; garbage that
    collection found is not frozen; young collections never refreeze; the cap holds."""
    gc.collect()
    frozen_before = gc.get_freeze_count()
    monitor = GcPauseMonitor(refreeze_over_s=1e-6, max_refreezes=1)
    gc.disable()  # only the collections the test makes
    try:
        keep = cycles(300_000)
        gc.collect(0)  # a young collection: no refreeze whatever it took
        assert monitor.take()["gc_refreezes"] == 0
        garbage = cycles(10_000)
        del garbage
        tracked = len(gc.get_objects())  # the live ones and the 10k in garbage cycles
        gc.collect()  # walks the 300k, collects the 10k cycles, then freezes the survivors
        slow = monitor.take()
        assert slow["gc_refreezes"] == 1
        # the live ones only: not the 10k in garbage cycles (give or take the few objects made since `tracked`, by
        # the monitor's callback or another thread of the test process; once it was off by one)
        assert 300_000 <= gc.get_freeze_count() - frozen_before <= tracked - 9_000
        gc.collect()
        fast = monitor.take()
        assert fast["gc_max_s"] < slow["gc_max_s"] / 3
        more = cycles(300_000)  # past the cap: walked, not frozen
        gc.collect()
        assert monitor.take()["gc_refreezes"] == 1 and gc.get_freeze_count() - frozen_before <= tracked
        del more
    finally:
        gc.enable()
        monitor.close()
        gc.unfreeze()
        del keep


def test_no_refreeze_without_a_threshold_and_a_bad_threshold_is_refused():
    monitor = GcPauseMonitor()
    try:
        keep = cycles(50_000)
        frozen = gc.get_freeze_count()
        gc.collect()
        assert gc.get_freeze_count() == frozen and monitor.take()["gc_refreezes"] == 0
        del keep
    finally:
        monitor.close()
    with pytest.raises(ValueError, match="refreeze_over_s"):
        GcPauseMonitor(refreeze_over_s=0)


def test_a_hold_defers_automatic_collections_until_released():
    """Inside a hold the allocations that would set off collections set off none; the release lets them run."""
    monitor = GcPauseMonitor()
    hold = CollectionHold()
    assert gc.isenabled()
    try:
        gc.collect()
        monitor.take()
        hold.hold()
        hold.hold()  # nested: one window
        assert hold.held and not gc.isenabled() and hold.holds == 1
        keep = cycles(50_000)  # far past gen 0's threshold
        assert monitor.take()["gc_collections"] == 0
        hold.release()
        assert gc.isenabled() and not hold.held
        more = cycles(50_000)
        assert monitor.take()["gc_collections"] > 0
        hold.release()  # idempotent
        assert gc.isenabled()
        del keep, more
    finally:
        hold.release()
        monitor.close()


def test_a_hold_keeps_collection_off_if_it_was_off_and_a_forgotten_hold_expires():
    now = [0.0]
    hold = CollectionHold(limit_s=2.0, clock=lambda: now[0])
    gc.disable()
    try:
        hold.hold()
        hold.release()
        assert not gc.isenabled()  # someone else had turned it off: left off
    finally:
        gc.enable()
    hold.hold()
    now[0] = 1.5
    assert not hold.release_if_stale() and hold.held
    now[0] = 2.5
    assert hold.stale() and hold.release_if_stale()
    assert gc.isenabled() and not hold.held and hold.overdue == 1
    with pytest.raises(ValueError, match="limit_s"):
        CollectionHold(limit_s=0)
