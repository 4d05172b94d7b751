"""align_blocks(): invisible padding that puts segment starts on block boundaries (a worked example, the tree rule
on the real tokens unchanged, the loss terms moved with their tokens, the options)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlasync.packing import IGNORE_INDEX, TreeRow, align_blocks, pack
from rlasync.records import RolloutSample


def make_sample(ids, prompt, group_id=0):
    ids = np.asarray(ids, dtype=np.int64)
    mask = (np.arange(len(ids)) >= prompt).astype(np.int8)
    return RolloutSample(ids, mask, -np.arange(len(ids), dtype=np.float32) / 10, advantage=1.0, group_id=group_id)


def packed_of(samples):
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return pack(row)


def worked_row():
    """The layout docs' worked example: 11 12 13 | 21 22 | 13 31 32 | 12 41 51, segments at 0, 1, 2, 5, 8."""
    return packed_of(
        [make_sample([11, 12, 13, 21, 22], 3), make_sample([11, 12, 13, 31, 32], 3), make_sample([11, 12, 41, 51], 3)]
    )


def mask_of(subtree_end):
    index = np.arange(len(subtree_end))
    return (index[None, :] <= index[:, None]) & (index[:, None] < subtree_end[None, :])  # [query, key]


def test_the_worked_example_at_blocks_of_four():
    row = worked_row()
    assert row.tree_cu_seqlens_q.tolist() == [0, 1, 2, 5, 8, 11]
    aligned = align_blocks(row, 4, pad_token_id=0)
    assert aligned.input_ids.tolist() == [11, 0, 0, 0, 12, 0, 0, 0, 13, 21, 22, 0, 13, 31, 32, 0, 12, 41, 51]
    # padding: chains off 11 (1-3), off the first 12 (5-7, 11) and off 11 again (15)
    assert aligned.position_ids.tolist() == [0, 1, 2, 3, 1, 2, 3, 4, 2, 3, 4, 2, 2, 3, 4, 1, 1, 2, 3]
    assert aligned.subtree_end.tolist() == [19, 4, 4, 4, 15, 8, 8, 8, 11, 11, 11, 12, 15, 15, 15, 16, 19, 19, 19]
    real = np.asarray([0, 4, 8, 9, 10, 12, 13, 14, 16, 17, 18])
    assert [s for s in aligned.tree_cu_seqlens_q.tolist() if s in real.tolist()] == [0, 4, 8, 12, 16]
    assert np.array_equal(aligned.token_index, real[row.token_index])
    assert np.array_equal(aligned.shift_labels[real], row.shift_labels)
    assert (np.delete(aligned.shift_labels, real) == IGNORE_INDEX).all()
    for name in ("target_ids", "sampler_logprobs", "advantages", "sample_index"):
        assert np.array_equal(getattr(aligned, name), getattr(row, name)), name
    assert (aligned.load, aligned.num_trained_tokens, aligned.num_raw_tokens) == (row.load, 5, row.num_raw_tokens)
    assert aligned.tree_cu_seqlens_k[-1] == aligned.tree_kv_index.shape[0]  # the varlen fields stay consistent


def _check_invisible(row, aligned, block_size, max_pad=None, at="segments"):
    n = aligned.num_tokens
    is_pad = aligned.input_ids == -1
    real = np.flatnonzero(~is_pad)
    assert real.shape[0] == row.num_tokens and np.array_equal(aligned.input_ids[real], row.input_ids)
    assert np.array_equal(aligned.position_ids[real], row.position_ids)
    before, after = mask_of(row.subtree_end), mask_of(aligned.subtree_end)
    assert np.array_equal(after[np.ix_(real, real)], before)  # every real query sees exactly the keys it saw
    pads = np.flatnonzero(is_pad)
    assert not after[:, pads][~np.isin(np.arange(n), pads)].any()  # no real query sees a padding key
    run = np.cumsum(~is_pad)[pads]  # padding runs are separated by real tokens: each one chain
    chain = (run[:, None] == run[None, :]) & (pads[None, :] <= pads[:, None])
    assert np.array_equal(after[np.ix_(pads, pads)], chain)  # a padding key: the queries of its own chain
    assert np.array_equal(aligned.token_index, real[row.token_index])
    starts = row.tree_cu_seqlens_q[1:-1]
    if at == "roots":  # a root: no earlier token's subtree holds it
        starts = np.asarray([s for s in starts.tolist() if (row.subtree_end[:s] <= s).all()], dtype=np.int64)
    moved_starts = real[starts]
    if max_pad is None:
        assert (moved_starts % block_size == 0).all()
    for start in moved_starts.tolist():  # padding right before a start: at most max_pad, and only to align it
        gap = 0
        while start - gap - 1 >= 0 and is_pad[start - gap - 1]:
            gap += 1
        assert gap <= (block_size - 1 if max_pad is None else max_pad)
        assert gap == 0 or start % block_size == 0


@settings(max_examples=40, deadline=None)
@given(
    groups=st.lists(
        st.tuples(st.integers(1, 9), st.lists(st.integers(1, 9), min_size=1, max_size=4)), min_size=1, max_size=4
    ),
    block_size=st.sampled_from([2, 4, 8, 16]),
    max_pad=st.sampled_from([None, 0, 1, 3]),
    at=st.sampled_from(["segments", "roots"]),
)
def test_padding_is_invisible_and_lands_starts_on_blocks(groups, block_size, max_pad, at):
    rng = np.random.default_rng(len(groups) * 31 + block_size)
    samples = []
    for group, (prompt_length, completions) in enumerate(groups):
        prompt = rng.integers(0, 50, prompt_length).tolist()
        samples += [make_sample(prompt + rng.integers(0, 50, c).tolist(), prompt_length, group) for c in completions]
    row = packed_of(samples)
    aligned = align_blocks(row, block_size, max_pad=max_pad, at=at, pad_token_id=-1)
    if aligned is row:
        return
    _check_invisible(row, aligned, block_size, max_pad, at)


def test_roots_only_moves_the_groups_and_max_pad_leaves_far_starts():
    row = packed_of([make_sample([1, 2, 3], 1, 0), make_sample([1, 2, 4], 1, 0), make_sample([5, 6, 7, 8, 9], 2, 1)])
    # layout: 1 | 2 3 | 2 4 | 5 6 7 8 9 -> segments at 0, 1, 3, 5; the one root after 0 is at 5
    assert row.tree_cu_seqlens_q.tolist() == [0, 1, 3, 5, 10]
    roots = align_blocks(row, 4, at="roots", pad_token_id=-1)
    assert roots.input_ids.tolist() == [1, 2, 3, 2, 4, -1, -1, -1, 5, 6, 7, 8, 9]
    assert roots.subtree_end[5:8].tolist() == [8, 8, 8] and roots.position_ids[5:8].tolist() == [0, 1, 2]
    near = align_blocks(row, 4, max_pad=1, pad_token_id=-1)  # 1 needs 3 (left), 3 needs 1, 5 + 1 needs 2 (left)
    assert near.input_ids.tolist() == [1, 2, 3, -1, 2, 4, 5, 6, 7, 8, 9]
    assert align_blocks(row, 4, max_pad=0) is row and align_blocks(row, 1) is row


def test_bad_options_name_the_field():
    row = worked_row()
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        align_blocks(row, 0)
    with pytest.raises(ValueError, match="max_pad must be >= 0"):
        align_blocks(row, 4, max_pad=-1)
    with pytest.raises(ValueError, match="at must be 'segments' or 'roots'"):
        align_blocks(row, 4, at="leaves")
