"""GcPauseMonitor times real collections; freeze_heap makes later full collections skip the frozen heap."""

import gc
import time

import pytest

from rlasync.metrics.gc_pauses import GcPauseMonitor, freeze_heap


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
