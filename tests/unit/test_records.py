"""rlasync.records: the one lease (dispatcher and loop), the one outcome vocabulary, and the sample protocol that
packing works on."""

import pickle
from dataclasses import dataclass, field

import numpy as np
import pytest

from rlasync.packing import TreeRow, pack
from rlasync.pipeline import PromptDispatcher
from rlasync.records import DROP_REASONS, RELEASE_REASONS, GroupOutcome, PromptLease, RolloutSample


def test_the_dispatchers_lease_is_the_loops_lease_and_travels_between_actors():
    lease = PromptDispatcher(num_rows=3, num_epochs=2).lease()
    assert isinstance(lease, PromptLease) and (lease.group_id, lease.row_index, lease.epoch) == (0, 0, 0)
    assert lease.position == 0 and dict(lease.row) == {} and lease.waited_s == 0.0
    assert pickle.loads(pickle.dumps(lease)) == lease
    filled = lease._replace(row={"prompt": "p"}, waited_s=1.5)
    assert filled.row["prompt"] == "p" and filled.position == 0


def test_a_users_tuple_lease_is_coerced():
    lease = PromptLease.coerce((4, 1, {"a": 1}, 2))
    assert (lease.group_id, lease.row_index, lease.epoch, lease.position) == (4, 1, 2, -1)
    assert PromptLease.coerce(lease) is lease


def test_one_outcome_vocabulary_compares_as_strings():
    assert GroupOutcome("zero_std") is GroupOutcome.ZERO_STD and GroupOutcome.TRAINED == "trained"
    assert {"failed": 1}[GroupOutcome.FAILED] == 1
    assert set(DROP_REASONS) == {"zero_std", "filtered", "failed"}
    assert set(RELEASE_REASONS) == {"filtered", "failed", "cancelled"}


@dataclass
class PlainSample:
    """Not a RolloutSample: only what packing reads (`PackableSample`)."""

    input_ids: np.ndarray
    completion_mask: np.ndarray
    sampler_logprobs: np.ndarray
    advantage: float
    group_id: int
    sampler_topk_ids: np.ndarray | None = None
    sampler_topk_logprobs: np.ndarray | None = None
    sampling_mask: np.ndarray | None = None
    metrics: dict = field(default_factory=dict)

    def __len__(self):
        return len(self.input_ids)

    @property
    def num_trained_tokens(self):
        return int(self.completion_mask.sum())


def test_packing_takes_any_sample_with_the_protocols_fields():
    ids, mask, lps = [11, 12, 21, 22], [0, 0, 1, 1], [0.0, 0.0, -0.1, -0.2]
    plain, record = TreeRow(), TreeRow()
    plain.add(PlainSample(np.array(ids), np.array(mask, np.int8), np.array(lps, np.float32), 1.0, 3))
    record.add(RolloutSample(ids, mask, lps, advantage=1.0, group_id=3))
    a, b = pack(plain), pack(record)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.advantages, b.advantages)


def test_top_logprobs_read_as_dicts_pickle_as_arrays_and_build_from_packed_rows():
    from rlasync.records import TopLogprobs

    rows = [np.array([5.0, 9.0, 2.0, -0.1, -1.0, -np.inf]), np.array([3.0, 4.0, 8.0, -0.2, -0.3, -0.4])]
    top = TopLogprobs.from_rows(rows, k=3)
    assert list(top) == [{5: -0.1, 9: -1.0}, {3: -0.2, 4: -0.3, 8: -0.4}]  # the -inf pad is not an entry
    assert top.ids.tolist() == [[5, 9, -1], [3, 4, 8]] and top[0:1] == [{5: -0.1, 9: -1.0}]
    assert TopLogprobs.from_rows(rows, k=2) == [{5: -0.1, 9: -1.0}, {3: -0.2, 4: -0.3}]
    assert top == list(top) and top != [{5: -0.1}] and top == pickle.loads(pickle.dumps(top))
    arrays = TopLogprobs(top.ids, top.logprobs)  # from arrays (not packed rows): the same, pickled too
    assert arrays == top and pickle.loads(pickle.dumps(arrays)) == top and repr(arrays) == repr(top)
    assert len(TopLogprobs.from_rows([], k=4)) == 0
    with pytest.raises(ValueError, match="same"):
        TopLogprobs(np.zeros((2, 3)), np.zeros((2, 4)))
