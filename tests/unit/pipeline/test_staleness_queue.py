"""StalenessQueue: FIFO takes to a token target, staleness drops, per-sample metrics, and the waiting take."""

import asyncio

import numpy as np
import pytest

from rlasync.metrics import MetricSink
from rlasync.pipeline import QueueEntry, StalenessQueue
from rlasync.records import RolloutSample


class FakeClock:
    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


def entries(group_id, sizes, version=0):
    return [
        QueueEntry(payload=f"g{group_id}s{i}", group_id=group_id, policy_version=version, num_tokens=n)
        for i, n in enumerate(sizes)
    ]


def payloads(result):
    return [entry.payload for entry in result.entries]


def test_take_stops_once_the_token_target_is_reached():
    queue = StalenessQueue(clock=FakeClock())
    queue.put(entries(0, [10, 10, 10]))
    queue.put(entries(1, [10, 10]))
    result = queue.take(token_target=25, current_version=0, max_staleness=0)
    assert payloads(result) == ["g0s0", "g0s1", "g0s2"] and result.num_tokens == 30
    assert len(queue) == 2 and queue.num_tokens == 20
    assert payloads(queue.take(100, 0, 0)) == ["g1s0", "g1s1"]  # FIFO, then whatever is left


def test_take_always_returns_one_entry_when_one_is_available():
    queue = StalenessQueue(clock=FakeClock())
    queue.put(entries(0, [500, 7]))
    assert payloads(queue.take(token_target=1, current_version=0, max_staleness=0)) == ["g0s0"]
    assert payloads(queue.take(token_target=0, current_version=0, max_staleness=0)) == ["g0s1"]
    empty = queue.take(token_target=10, current_version=0, max_staleness=0)
    assert empty.entries == () and empty.dropped_stale == ()
    assert empty.metrics == {"sample/dropped_stale_count": 0.0}


def test_stale_entries_are_dropped_counted_and_returned():
    queue = StalenessQueue(clock=FakeClock())
    queue.put(entries(0, [4, 4], version=1))
    queue.put(entries(1, [4], version=2))
    result = queue.take(token_target=1, current_version=2, max_staleness=0)
    assert [e.payload for e in result.dropped_stale] == ["g0s0", "g0s1"]
    assert payloads(result) == ["g1s0"]
    assert result.metrics["sample/dropped_stale_count"] == 2.0
    assert len(queue) == 0 and queue.num_tokens == 0


def test_dropped_stale_entries_do_not_count_toward_the_target():
    queue = StalenessQueue(clock=FakeClock())
    queue.put(entries(0, [100], version=0))
    queue.put(entries(1, [3, 3, 3], version=5))
    result = queue.take(token_target=6, current_version=5, max_staleness=4)
    assert [e.payload for e in result.dropped_stale] == ["g0s0"] and payloads(result) == ["g1s0", "g1s1"]


def test_a_sample_exactly_max_staleness_old_is_kept():
    queue = StalenessQueue(clock=FakeClock())
    queue.put(entries(0, [1], version=3))
    assert payloads(queue.take(1, current_version=5, max_staleness=2)) == ["g0s0"]


def test_metrics_by_hand():
    clock = FakeClock(10.0)
    queue = StalenessQueue(clock=clock)
    queue.put(entries(0, [5, 5], version=3))  # enqueued at 10
    clock.now = 12.0
    queue.put(entries(1, [5], version=4))  # enqueued at 12
    queue.put(entries(2, [5], version=1))  # stale at version 4 with S=2
    clock.now = 15.0
    result = queue.take(token_target=100, current_version=4, max_staleness=2)
    # consumed: g0s0 (3 left behind it, waited 5 s, staleness 1), g0s1 (2 left, 5 s, 1), g1s0 (1 left, 3 s, 0)
    assert result.metrics == {
        "sample/dropped_stale_count": 1.0,
        "rollout/queue_size": (3 + 2 + 1, 3),
        "sample/time_in_queue_s": (13.0, 3),
        "sample/staleness_mean": (2.0, 3),
        "sample/staleness_max": 1.0,
    }
    # A second take in the same window: the sink's rate is the mean over all consumed samples, not over takes.
    queue.put(entries(3, [5], version=0), now=15.0)
    second = queue.take(token_target=100, current_version=4, max_staleness=4, now=16.0)
    sink = MetricSink()
    sink.update(result.metrics)
    sink.update(second.metrics)
    reduced = sink.reduce()
    assert reduced["sample/staleness_mean"] == pytest.approx((1 + 1 + 0 + 4) / 4)
    assert reduced["sample/time_in_queue_s"] == pytest.approx((5 + 5 + 3 + 1) / 4)
    assert reduced["rollout/queue_size"] == pytest.approx((3 + 2 + 1 + 0) / 4)
    assert reduced["sample/staleness_max"] == 4.0
    assert reduced["sample/dropped_stale_count"] == 1.0


def test_put_stamps_the_enqueue_time_and_checks_the_group():
    queue = StalenessQueue(clock=FakeClock(3.5))
    queue.put(entries(0, [1]))
    assert queue.take(1, 0, 0).entries[0].enqueued_at == 3.5
    with pytest.raises(ValueError, match="no entries"):
        queue.put([])
    with pytest.raises(ValueError, match="several groups"):
        queue.put(entries(0, [1]) + entries(1, [1]))


def test_entry_for_a_rollout_sample_carries_its_metadata():
    sample = RolloutSample(
        input_ids=np.arange(6),
        completion_mask=np.array([0, 0, 0, 1, 1, 0]),
        sampler_logprobs=np.zeros(6),
        advantage=0.5,
        group_id=7,
        policy_version=3,
        row_index=11,
    )
    entry = QueueEntry.for_sample(sample, payload="ref")
    assert (entry.payload, entry.group_id, entry.policy_version) == ("ref", 7, 3)
    assert (entry.num_tokens, entry.num_trained_tokens, entry.row_index) == (6, 2, 11)
    assert QueueEntry.for_sample(sample).payload is sample


def test_wait_take_returns_when_a_put_happens():
    async def scenario():
        queue = StalenessQueue(clock=FakeClock())
        waiter = asyncio.create_task(queue.wait_take(10, current_version=0, max_staleness=0, timeout_s=5.0))
        await asyncio.sleep(0)
        assert not waiter.done()
        queue.put(entries(0, [4]))
        return await asyncio.wait_for(waiter, 1.0)

    result = asyncio.run(scenario())
    assert payloads(result) == ["g0s0"]


def test_wait_take_keeps_waiting_past_stale_entries_and_reports_them():
    async def scenario():
        queue = StalenessQueue(clock=FakeClock())
        waiter = asyncio.create_task(queue.wait_take(10, current_version=3, max_staleness=0, timeout_s=5.0))
        await asyncio.sleep(0)
        queue.put(entries(0, [4], version=1))  # stale: dropped, the waiter keeps waiting
        await asyncio.sleep(0)
        assert not waiter.done()
        queue.put(entries(1, [4], version=3))
        return await asyncio.wait_for(waiter, 1.0)

    result = asyncio.run(scenario())
    assert payloads(result) == ["g1s0"]
    assert [e.payload for e in result.dropped_stale] == ["g0s0"]
    assert result.metrics["sample/dropped_stale_count"] == 1.0


def test_wait_take_times_out_cleanly_with_nothing():
    async def scenario():
        queue = StalenessQueue(clock=FakeClock())
        return await queue.wait_take(10, current_version=0, max_staleness=0, timeout_s=0.01)

    result = asyncio.run(scenario())
    assert result.entries == () and result.metrics == {"sample/dropped_stale_count": 0.0}


def test_wait_take_returns_at_once_when_entries_are_queued():
    async def scenario():
        queue = StalenessQueue(clock=FakeClock())
        queue.put(entries(0, [4, 4]))
        return await queue.wait_take(100, current_version=0, max_staleness=0, timeout_s=None)

    assert payloads(asyncio.run(scenario())) == ["g0s0", "g0s1"]
