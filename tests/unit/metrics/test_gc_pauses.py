"""GcPauseMonitor times real collections; freeze_heap makes later full collections skip the frozen heap."""

import gc
import time

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
        assert monitor.take() == {"gc_max_s": 0.0, "gc_total_s": 0.0, "gc_collections": 0.0}
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
