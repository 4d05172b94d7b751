"""The queue counts dropped groups per cause and keeps each cause's last message: what the watchdog's reason is
built from (docs/algorithms.md §2.1). A failed group is consumed: never leased again in its epoch."""

from rlasync.pipeline.service import QueueService
from rlasync.pipeline.settings import QueueSettings


def service(num_rows=3):
    return QueueService.create(QueueSettings(num_rows, 1.0, max_staleness=1, tokens_per_step=100))


def test_drops_are_counted_per_cause_with_the_last_detail():
    queue = service()
    queue.drop_group(queue.try_next_group(2).group_id, "zero_std", 10, "no_reward", "every reward None (f)")
    queue.drop_group(queue.try_next_group(2).group_id, "failed", 0, "too_long", "row 1: prompt of 41 tokens > 20")
    queue.drop_group(queue.try_next_group(2).group_id, "zero_std", 10)  # no cause given: counted by outcome only
    state = queue.state().to_dict()
    assert state["outcomes"] == {"zero_std": 2, "failed": 1}
    assert state["causes"] == {"zero_std/no_reward": 1, "failed/too_long": 1}
    assert state["last_failures"]["failed/too_long"].startswith("row 1: prompt of 41 tokens")
    assert state["done"] and queue.try_next_group(2) is None  # the failed row is consumed, not leased again


def test_a_long_detail_is_cut():
    queue = service(1)
    lease = queue.try_next_group(2)
    queue.drop_group(lease.group_id, "failed", 0, "error", "x" * 5000)
    assert len(queue.state().last_failures["failed/error"]) == 500
