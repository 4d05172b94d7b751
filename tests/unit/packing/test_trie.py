"""TreeRow: keys, costs and the two budget bounds of docs/algorithms.md §4.1."""

import numpy as np
import pytest

from rlasync.packing import TreeRow
from rlasync.records import RolloutSample


def make_sample(ids, mask=None, group_id=0, advantage=0.0):
    mask = [1] * len(ids) if mask is None else mask
    return RolloutSample(
        input_ids=np.asarray(ids, dtype=np.int64),
        completion_mask=mask,
        sampler_logprobs=np.zeros(len(ids)),
        advantage=advantage,
        group_id=group_id,
    )


def worked_example():
    """docs/algorithms.md §4.4: group 7 has two rollouts, group 9 one."""
    return [
        make_sample([11, 12, 13, 21, 22], [0, 0, 0, 1, 1], group_id=7),
        make_sample([11, 12, 13, 31, 32], [0, 0, 0, 1, 1], group_id=7),
        make_sample([11, 12, 41, 51], [0, 0, 0, 1], group_id=9),
    ]


def row_of(samples):
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return row


def test_worked_example_costs_after_each_sample():
    row = TreeRow()
    table = []
    for sample in worked_example():
        row.add(sample)
        table.append((row.num_tokens, row.load, row.trained))
    assert table == [(5, 15, 2), (8, 27, 4), (11, 36, 5)]
    assert row.num_raw_tokens == 14
    assert row.num_samples == 3
    assert row.groups == {7, 9}


def test_trie_branches_one_token_before_divergence():
    s0, s1, s2 = worked_example()
    row = row_of([s0])
    # s1 shares (11,12) (12,13) but needs (13,31): its 13 is a new node.
    assert row.shared_length(s1) == 2
    # s2's 12 is keyed (12,41) != (12,13): only 11 is shared.
    assert row.shared_length(s2) == 1
    row.add(s1)
    assert [row.node_tokens[n] for n in row.sample_nodes[1]] == [11, 12, 13, 31, 32]
    assert row.sample_nodes[1][:2].tolist() == row.sample_nodes[0][:2].tolist()
    assert row.sample_nodes[1][2] != row.sample_nodes[0][2]


def test_chain_extension_duplicates_only_the_last_token_of_the_shorter_sample():
    turn1 = make_sample([1, 2, 3])
    turn2 = make_sample([1, 2, 3, 4, 5])
    row = row_of([turn1, turn2])
    # (3, None) vs (3, 4): 3 is duplicated, 1 and 2 shared.
    assert row.num_tokens == 3 + 3
    assert row.load == (1 + 2 + 3) + (3 + 4 + 5)


def test_identical_samples_share_every_node_but_count_their_trained_tokens():
    sample = make_sample([5, 6, 7], [0, 1, 1])
    row = row_of([sample, sample])
    assert row.num_tokens == 3
    assert row.load == 6
    assert row.trained == 4
    assert row.sample_nodes[0].tolist() == row.sample_nodes[1].tolist()


def test_fits_bounds_unique_tokens():
    s0, s1, _ = worked_example()
    row = row_of([s0])
    assert row.fits(s1, budget=8)  # 5 + 3 novel
    assert not row.fits(s1, budget=7)


def test_fits_bounds_trained_tokens_even_when_nothing_is_novel():
    sample = make_sample([1, 2, 3, 4], [0, 1, 1, 1])
    row = row_of([sample, sample])  # 4 unique tokens, 6 trained
    assert row.fits(sample, budget=9)
    assert not row.fits(sample, budget=8)  # 6 + 3 > 8 although no token is novel


def test_delta_load_is_the_load_the_sample_adds():
    s0, s1, s2 = worked_example()
    row = TreeRow()
    for sample in (s0, s1, s2, s1):
        expected = row.delta_load(sample)
        before = row.load
        row.add(sample)
        assert row.load - before == expected
    assert TreeRow().delta_load(s0) == 15


def test_children_and_roots_keep_insertion_order():
    row = row_of([make_sample([9, 1]), make_sample([3, 1]), make_sample([9, 2])])
    assert [row.node_tokens[n] for n in row.root_nodes] == [9, 3, 9]  # (9,1) (3,1) (9,2)
    fork = row_of([make_sample([1, 2, 7]), make_sample([1, 2, 5]), make_sample([1, 2, 6])])
    (root,) = fork.root_nodes  # (1,2); the 2s are keyed (2,7) (2,5) (2,6): the branch is at 1
    assert [fork.node_tokens[c] for n in fork.children(root) for c in fork.children(n)] == [7, 5, 6]


def test_empty_sample_is_rejected():
    with pytest.raises(ValueError, match="at least one token"):
        TreeRow().add(make_sample([]))


def test_unshared_rows_are_plain_padding_free_packing():
    from rlasync.packing import TokenBudgetBatcher, pack, sample_positions

    samples = [make_sample([1, 2, 3, 4], [0, 0, 1, 1]), make_sample([1, 2, 3, 5], [0, 0, 1, 1])]
    shared, unshared = TreeRow(), TreeRow(share_prefixes=False)
    for sample in samples:
        shared.add(sample)
        unshared.add(sample)
    assert shared.num_tokens == 6 and unshared.num_tokens == 8 == unshared.num_raw_tokens
    assert unshared.load == 2 * (4 * 5 // 2)
    packed = pack(unshared)
    assert packed.input_ids.tolist() == [1, 2, 3, 4, 1, 2, 3, 5]
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert packed.subtree_end.tolist() == [4, 4, 4, 4, 8, 8, 8, 8]
    assert [p.tolist() for p in sample_positions(unshared)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    batch = TokenBudgetBatcher(num_ranks=1, token_budget=8, share_prefixes=False).plan(samples)
    assert len(batch) == 1 and batch[0].rows[0].num_tokens == 8
