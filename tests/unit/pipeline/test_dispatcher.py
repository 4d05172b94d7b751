"""PromptDispatcher: leases, epochs, outcomes, the resume position, and the exactly-once epoch invariant."""

import math
from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from rlasync.pipeline import PromptDispatcher


def lease_all(dispatcher):
    leases = []
    while (lease := dispatcher.lease()) is not None:
        leases.append(lease)
    return leases


def train(dispatcher, lease, num_samples=1):
    dispatcher.mark_queued(lease.group_id, num_samples)
    return dispatcher.mark_trained(lease.group_id, num_samples)


def test_one_epoch_leases_every_row_once_in_order_with_a_global_group_counter():
    dispatcher = PromptDispatcher(num_rows=3, num_epochs=2)
    leases = lease_all(dispatcher)
    assert [(lease.epoch, lease.row_index) for lease in leases] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [lease.group_id for lease in leases] == list(range(6))
    assert [lease.position for lease in leases] == list(range(6))
    assert not dispatcher.done
    for lease in leases:
        train(dispatcher, lease)
    assert dispatcher.done and dispatcher.consumed_groups == 6 and dispatcher.first_untrained_index() == 6


def test_fractional_epochs_end_at_ceil_of_epochs_times_rows():
    dispatcher = PromptDispatcher(num_rows=4, num_epochs=1.3)
    assert len(lease_all(dispatcher)) == math.ceil(1.3 * 4) == 6


def test_resume_start_index_begins_mid_dataset_then_later_passes_are_full():
    dispatcher = PromptDispatcher(num_rows=5, num_epochs=2, start_index=3)
    leases = lease_all(dispatcher)
    assert [(lease.epoch, lease.row_index) for lease in leases] == [(0, 3), (0, 4)] + [(1, row) for row in range(5)]
    assert leases[0].group_id == 0  # group ids restart at 0 after a resume (docs/algorithms.md §2.2)
    assert dispatcher.first_untrained_index() == 3


def test_resume_index_beyond_the_first_epoch_and_past_the_budget():
    dispatcher = PromptDispatcher(num_rows=4, num_epochs=3, start_index=9)
    first = dispatcher.lease()
    assert (first.epoch, first.row_index) == (2, 1)
    finished = PromptDispatcher(num_rows=4, num_epochs=1, start_index=4)
    assert finished.done and finished.lease() is None


def test_streaming_forever_never_runs_out():
    dispatcher = PromptDispatcher(num_rows=2, num_epochs=None)
    leases = [dispatcher.lease() for _ in range(7)]
    assert [lease.row_index for lease in leases] == [0, 1, 0, 1, 0, 1, 0]
    assert leases[-1].epoch == 3 and not dispatcher.done


def test_first_untrained_index_stops_at_a_hole():
    dispatcher = PromptDispatcher(num_rows=10, num_epochs=1)
    leases = [dispatcher.lease() for _ in range(4)]
    for index in (0, 1, 3):
        train(dispatcher, leases[index])
    assert dispatcher.first_untrained_index() == 2
    train(dispatcher, leases[2])
    assert dispatcher.first_untrained_index() == 4


def test_first_untrained_index_is_start_plus_first_untrained_group_as_in_trl():
    # TRL: prompt_index = dataset_start_index + first_untrained = 10 + 5.
    dispatcher = PromptDispatcher(num_rows=100, num_epochs=1, start_index=10)
    leases = [dispatcher.lease() for _ in range(8)]
    for index in (0, 1, 2, 3, 4, 6, 7):
        train(dispatcher, leases[index])
    assert dispatcher.first_untrained_index() == 15


def test_dropped_groups_count_as_consumed_for_the_epoch():
    dispatcher = PromptDispatcher(num_rows=3, num_epochs=1)
    a, b, c = lease_all(dispatcher)
    assert dispatcher.mark_dropped(a.group_id, "zero_std") == "zero_std"
    assert dispatcher.mark_dropped(b.group_id, "filtered") == "filtered"
    train(dispatcher, c)
    assert dispatcher.done
    assert dispatcher.outcome_counts == Counter({"zero_std": 1, "filtered": 1, "trained": 1})


def test_a_group_whose_samples_were_all_stale_is_leased_again_in_the_same_epoch():
    dispatcher = PromptDispatcher(num_rows=3, num_epochs=1)
    a, b, c = lease_all(dispatcher)
    dispatcher.mark_queued(b.group_id, 2)
    assert dispatcher.mark_stale(b.group_id, 1) is None
    assert dispatcher.mark_stale(b.group_id, 1) == "stale"
    again = dispatcher.lease()
    assert (again.epoch, again.row_index, again.position) == (b.epoch, b.row_index, b.position)
    assert again.group_id == 3  # a fresh group id: late samples of the old group cannot be confused with it
    assert dispatcher.outcome_counts["stale"] == 1 and dispatcher.consumed_groups == 0


def test_a_partly_stale_group_counts_as_trained():
    dispatcher = PromptDispatcher(num_rows=1, num_epochs=1)
    lease = dispatcher.lease()
    dispatcher.mark_queued(lease.group_id, 3)
    assert dispatcher.mark_stale(lease.group_id, 2) is None
    assert dispatcher.mark_trained(lease.group_id, 1) == "trained"
    assert dispatcher.done and dispatcher.lease() is None


def test_released_leases_come_back_before_new_positions():
    dispatcher = PromptDispatcher(num_rows=5, num_epochs=1)
    a, b = dispatcher.lease(), dispatcher.lease()
    dispatcher.release(b)
    dispatcher.release(a)
    assert [dispatcher.lease().position for _ in range(3)] == [0, 1, 2]


def test_epoch_done_follows_the_first_untrained_position():
    dispatcher = PromptDispatcher(num_rows=2, num_epochs=2)
    leases = lease_all(dispatcher)
    train(dispatcher, leases[1])
    assert not dispatcher.epoch_done(0)
    train(dispatcher, leases[0])
    assert dispatcher.epoch_done(0) and not dispatcher.epoch_done(1) and dispatcher.current_epoch == 1


def test_filter_rejecting_every_prompt_of_an_epoch_raises():
    dispatcher = PromptDispatcher(num_rows=2, num_epochs=2)
    a, b = dispatcher.lease(), dispatcher.lease()
    dispatcher.mark_dropped(a.group_id, "filtered")
    with pytest.raises(ValueError, match="rejected every prompt of epoch 0"):
        dispatcher.mark_dropped(b.group_id, "filtered")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda d, g: d.mark_trained(g, 1), "no queued samples"),
        (lambda d, g: d.mark_queued(g, 0), "dropped"),
        (lambda d, g: d.mark_dropped(g, "bored"), "unknown reason"),
        (lambda d, g: d.mark_trained(99, 1), "unknown group 99"),
    ],
)
def test_misuse_names_the_problem(call, message):
    dispatcher = PromptDispatcher(num_rows=3, num_epochs=1)
    lease = dispatcher.lease()
    with pytest.raises(ValueError, match=message):
        call(dispatcher, lease.group_id)


def test_double_completion_and_late_calls_raise():
    dispatcher = PromptDispatcher(num_rows=3, num_epochs=1)
    lease = dispatcher.lease()
    train(dispatcher, lease)
    with pytest.raises(ValueError, match="already ended"):
        dispatcher.mark_trained(lease.group_id, 1)
    with pytest.raises(ValueError, match="already ended"):
        dispatcher.release(lease)
    queued = dispatcher.lease()
    dispatcher.mark_queued(queued.group_id, 2)
    with pytest.raises(ValueError, match="already has samples in the queue"):
        dispatcher.release(queued)
    with pytest.raises(ValueError, match="2 samples pending"):
        dispatcher.mark_trained(queued.group_id, 3)


def test_bad_construction_arguments_raise():
    for kwargs in ({"num_rows": 0}, {"num_rows": 2, "num_epochs": 0}, {"num_rows": 2, "start_index": -1}):
        with pytest.raises(ValueError):
            PromptDispatcher(**kwargs)


# ---- the epoch invariant over random interleavings -------------------------------------------------------------

OPS = ("lease", "lease", "queue", "queue", "train", "stale", "stale", "drop", "release")


class Model:
    """The test's own account of every lease, checked against the dispatcher after each call."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self.leased = {}  # group_id -> lease, not queued
        self.queued = {}  # group_id -> [lease, pending]
        self.relet = set()  # positions that must be leased again
        self.consumed = Counter()  # position -> times consumed

    def lease(self):
        lease = self.dispatcher.lease()
        if lease is None:
            assert not self.relet
            return
        if self.relet:
            assert lease.position == min(self.relet), "holes are leased before new positions"
            event("a hole was leased again")
            self.relet.remove(lease.position)
        self.leased[lease.group_id] = lease

    def queue(self, group_id, num_samples):
        self.dispatcher.mark_queued(group_id, num_samples)
        self.queued[group_id] = [self.leased.pop(group_id), num_samples]

    def account(self, group_id, count, stale):
        mark = self.dispatcher.mark_stale if stale else self.dispatcher.mark_trained
        entry = self.queued[group_id]
        entry[1] -= count
        entry.append("trained" if not stale else None)
        outcome = mark(group_id, count)
        if entry[1] > 0:
            assert outcome is None
            return
        del self.queued[group_id]
        if "trained" in entry[2:]:
            assert outcome == "trained"
            self.consumed[entry[0].position] += 1
        else:
            assert outcome == "stale"
            event("a group was all stale")
            self.relet.add(entry[0].position)

    def drop(self, group_id, reason):
        lease = self.leased.pop(group_id)
        try:
            self.dispatcher.mark_dropped(group_id, reason)
        except ValueError as error:  # every prompt of a whole epoch filtered: raised after recording it
            assert "rejected every prompt" in str(error)
        self.consumed[lease.position] += 1

    def release(self, group_id):
        lease = self.leased.pop(group_id)
        self.dispatcher.release(lease)
        self.relet.add(lease.position)

    def check(self):
        start = self.dispatcher.start_index
        end = max(start, self.dispatcher.end_index)
        assert all(count == 1 for count in self.consumed.values()), "a prompt consumed twice"
        first_untrained = next(p for p in range(start, end + 1) if p == end or p not in self.consumed)
        assert self.dispatcher.first_untrained_index() == first_untrained
        assert self.dispatcher.consumed_groups == sum(self.consumed.values())
        assert self.dispatcher.num_leased == len(self.leased) + len(self.queued)

    def drain(self):
        """Finish everything: lease what is left, train every sample."""
        for _ in range(4 * (self.dispatcher.end_index + 1)):
            if self.dispatcher.done:
                return
            self.lease()
            for group_id in list(self.leased):
                self.queue(group_id, 1)
            for group_id, (_, pending, *_) in list(self.queued.items()):
                self.account(group_id, pending, stale=False)
            self.check()
        raise AssertionError("draining did not finish the epochs")


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    num_rows=st.integers(1, 5),
    num_epochs=st.sampled_from([0.5, 1, 1.6, 2, 3]),
    start_index=st.integers(0, 8),
)
def test_every_prompt_of_every_epoch_is_consumed_exactly_once(data, num_rows, num_epochs, start_index):
    dispatcher = PromptDispatcher(num_rows, num_epochs, start_index=start_index)
    model = Model(dispatcher)
    for _ in range(data.draw(st.integers(0, 40))):
        op = data.draw(st.sampled_from(OPS))
        if op == "lease":
            model.lease()
        elif op in ("queue", "drop", "release") and model.leased:
            group_id = data.draw(st.sampled_from(sorted(model.leased)))
            if op == "queue":
                model.queue(group_id, data.draw(st.integers(1, 3)))
            elif op == "drop":
                model.drop(group_id, data.draw(st.sampled_from(["zero_std", "filtered", "failed"])))
            else:
                model.release(group_id)
        elif op in ("train", "stale") and model.queued:
            group_id = data.draw(st.sampled_from(sorted(model.queued)))
            pending = model.queued[group_id][1]
            count = data.draw(st.one_of(st.just(pending), st.integers(1, pending)))
            model.account(group_id, count, stale=op == "stale")
        model.check()
    model.drain()
    expected = range(start_index, dispatcher.end_index)
    assert model.consumed == Counter({position: 1 for position in expected}), "a prompt lost or consumed twice"
    assert dispatcher.done and dispatcher.lease() is None
    assert dispatcher.first_untrained_index() == max(dispatcher.end_index, start_index)


def test_a_group_that_failed_for_good_is_consumed_and_counted_not_leased_again():
    dispatcher = PromptDispatcher(num_rows=2, num_epochs=1.0)
    first = dispatcher.lease()
    assert dispatcher.mark_dropped(first.group_id, "failed") == "failed"
    second = dispatcher.lease()
    assert second.position != first.position and dispatcher.lease() is None
    dispatcher.mark_dropped(second.group_id, "zero_std")
    assert dispatcher.done and dispatcher.outcome_counts == {"failed": 1, "zero_std": 1}
    assert dispatcher.first_untrained_index() == 2
