"""StreamingDispatcher: leases carry their rows, one pass (or repeated under max_steps), holes leased again with
their row, the resume position skips consumed rows, and the epoch invariant of the indexed dispatcher holds."""

import random

import pytest

from rlasync.pipeline.dispatcher import PromptDispatcher
from rlasync.pipeline.dispatcher_stream import StreamingDispatcher
from rlasync.pipeline.service import QueueService
from rlasync.pipeline.settings import QueueSettings


class Rows:
    """A re-iterable of rows without len() or indexing (like a datasets.IterableDataset)."""

    def __init__(self, n):
        self.n = n
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        return ({"prompt": [{"role": "user", "content": f"q{i}"}], "i": i} for i in range(self.n))


def drain(dispatcher):
    leases = []
    while dispatcher.has_leasable():
        lease = dispatcher.lease()
        leases.append(lease)
        dispatcher.mark_dropped(lease.group_id, "zero_std")
    return leases


def test_one_pass_leases_every_row_once_with_its_row_and_ends():
    dispatcher = StreamingDispatcher(Rows(5), repeat=False)
    leases = drain(dispatcher)
    assert [lease.row["i"] for lease in leases] == [0, 1, 2, 3, 4]
    assert [(lease.epoch, lease.row_index, lease.position) for lease in leases] == [(0, i, i) for i in range(5)]
    assert dispatcher.done and dispatcher.first_untrained_index() == 5 and dispatcher.lease() is None
    assert dispatcher.pass_length == 5


def test_repeat_iterates_again_with_epochs_and_row_indices_of_the_pass():
    rows = Rows(3)
    dispatcher = StreamingDispatcher(rows, repeat=True)
    leases = [dispatcher.lease() for _ in range(7)]
    assert [(lease.epoch, lease.row_index, lease.row["i"]) for lease in leases] == [
        (0, 0, 0),
        (0, 1, 1),
        (0, 2, 2),
        (1, 0, 0),
        (1, 1, 1),
        (1, 2, 2),
        (2, 0, 0),
    ]
    assert rows.passes == 3 and not dispatcher.done


def test_a_released_lease_is_leased_again_with_the_same_row_and_rows_are_freed_once_consumed():
    dispatcher = StreamingDispatcher(Rows(4), repeat=False)
    first, second = dispatcher.lease(), dispatcher.lease()
    dispatcher.release(first)
    again = dispatcher.lease()
    assert again.position == first.position and again.row == first.row and again.group_id != first.group_id
    dispatcher.mark_queued(again.group_id, 2)
    dispatcher.mark_stale(again.group_id, 2)  # every sample stale: leased again, row kept
    third = dispatcher.lease()
    assert third.position == first.position and third.row["i"] == 0
    dispatcher.mark_dropped(third.group_id, "zero_std")
    dispatcher.mark_dropped(second.group_id, "filtered")
    assert set(dispatcher._rows) == set()  # consumed rows are not kept
    assert dispatcher.first_untrained_index() == 2


def test_resume_skips_the_consumed_rows():
    dispatcher = StreamingDispatcher(Rows(5), repeat=False, start_index=3)
    leases = drain(dispatcher)
    assert [lease.row["i"] for lease in leases] == [3, 4] and [lease.position for lease in leases] == [3, 4]
    repeated = StreamingDispatcher(Rows(3), repeat=True, start_index=4)  # past the first pass
    lease = repeated.lease()
    assert (lease.epoch, lease.row_index, lease.position) == (1, 1, 4)
    with pytest.raises(ValueError, match="only 5"):
        StreamingDispatcher(Rows(5), repeat=False, start_index=9)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="no row"):
        StreamingDispatcher(Rows(0), repeat=False).has_leasable()
    with pytest.raises(ValueError, match="one-shot iterator"):
        StreamingDispatcher(iter([{"prompt": []}]), repeat=False)
    dispatcher = StreamingDispatcher(Rows(2), repeat=True)
    with pytest.raises(ValueError, match="rejected every prompt of pass 0"):
        for _ in range(3):
            dispatcher.mark_dropped(dispatcher.lease().group_id, "filtered")


def test_random_interleavings_consume_every_position_once_like_the_indexed_dispatcher():
    """The same random schedule of outcomes on an indexed and a streaming dispatcher over the same rows gives the
    same positions, rows and watermark (the streaming one is the indexed one with the rows carried)."""
    rng = random.Random(0)
    for trial in range(20):
        n = rng.randint(1, 7)
        indexed, streaming = PromptDispatcher(n, 1.0), StreamingDispatcher(Rows(n), repeat=False)
        live, schedule_rng = [], random.Random(trial)
        while not indexed.done:
            if live and (schedule_rng.random() < 0.5 or not indexed.has_leasable()):
                a, b = live.pop(schedule_rng.randrange(len(live)))
                action = schedule_rng.choice(["release", "zero_std", "trained"])
                for dispatcher, lease in ((indexed, a), (streaming, b)):
                    if action == "release":
                        dispatcher.release(lease)
                    elif action == "zero_std":
                        dispatcher.mark_dropped(lease.group_id, "zero_std")
                    else:
                        dispatcher.mark_queued(lease.group_id, 1)
                        dispatcher.mark_trained(lease.group_id, 1)
            else:
                a, b = indexed.lease(), streaming.lease()
                assert (a.position, a.row_index, a.epoch) == (b.position, b.row_index, b.epoch)
                assert b.row["i"] == a.row_index
                live.append((a, b))
            assert indexed.first_untrained_index() == streaming.first_untrained_index()
        assert not streaming.has_leasable() and streaming.done


def test_queue_settings_and_service_for_a_streaming_dataset():
    class Config:
        max_steps, num_train_epochs, max_staleness, weight_sync_steps = -1, 3.0, 2, 1

    rows = Rows(3)
    settings = QueueSettings.for_dataset(Config, rows)
    assert settings.stream is rows and settings.num_epochs == 1.0  # one pass: the length is unknown
    Config.max_steps = 5
    assert QueueSettings.for_dataset(Config, rows).num_epochs is None  # repeated under max_steps
    assert QueueSettings.for_dataset(Config, [{"prompt": []}] * 4).num_rows == 4
    service = QueueService.create(QueueSettings(0, 1.0, 2, tokens_per_step=100, stream=rows))
    lease = service.try_next_group(2)
    assert isinstance(service.dispatcher, StreamingDispatcher) and lease.row["i"] == 0
