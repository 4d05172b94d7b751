"""Planners (docs/algorithms.md §4.5, §4.8): TRL-derived cases, placement rules, flush, and properties on random streams."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlasync.packing import PLACEMENTS, FixedCountBatcher, TokenBudgetBatcher, TreeRow, balance_groups
from rlasync.records import RolloutSample

_next_token = itertools.count(1000)


def make_sample(length=None, group_id=None, ids=None, mask=None):
    """A sample; by default with fresh tokens (nothing shared) and its own group."""
    ids = [next(_next_token) for _ in range(length)] if ids is None else ids
    mask = [0] + [1] * (len(ids) - 1) if mask is None else mask
    return RolloutSample(
        input_ids=np.asarray(ids, dtype=np.int64),
        completion_mask=mask,
        sampler_logprobs=np.zeros(len(ids)),
        advantage=0.0,
        group_id=next(_next_token) if group_id is None else group_id,
    )


def push_all(batcher, samples):
    return [batch for sample in samples for batch in batcher.push(sample)]


def row_lengths(batch):
    return [[len(s) for s in row.samples] for row in batch.rows]


def assert_valid(batch, num_ranks, budget=None):
    assert len(batch.rows) == num_ranks
    assert all(row.num_samples > 0 for row in batch.rows)  # no rank forwards zero tokens
    if budget is not None:
        assert all(row.num_tokens <= budget and row.trained <= budget for row in batch.rows)


# ---- TRL-derived cases (docs/algorithms.md §12.1), with unshared samples --------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_token_budget_batcher_respects_budget_and_fills_every_row(placement):
    batcher = TokenBudgetBatcher(num_ranks=2, token_budget=8, placement=placement)
    batches = push_all(batcher, [make_sample(3) for _ in range(100)])[:5]
    assert len(batches) == 5
    for batch in batches:
        assert_valid(batch, 2, budget=8)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_token_budget_batcher_sizes_rows_dynamically(placement):
    long_batch = push_all(TokenBudgetBatcher(2, 8, placement), [make_sample(5) for _ in range(10)])[0]
    short_batch = push_all(TokenBudgetBatcher(2, 8, placement), [make_sample(2) for _ in range(20)])[0]
    assert row_lengths(long_batch) == [[5], [5]]  # 5 + 5 > 8: one per row
    assert row_lengths(short_batch) == [[2] * 4, [2] * 4]  # 4 * 2 = 8: four per row


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_token_budget_batcher_drops_oversized_sample(placement):
    batcher = TokenBudgetBatcher(2, 8, placement)
    batches = push_all(batcher, [make_sample(12)] + [make_sample(3) for _ in range(60)])
    assert batcher.dropped_oversize_count == 1
    for batch in batches[:5]:
        assert_valid(batch, 2, budget=8)
        assert all(len(s) <= 8 for s in batch.samples)
    # The drop is reported by the micro-batch that follows it, once.
    assert [b.dropped_oversize_count for b in batches] == [1] + [0] * (len(batches) - 1)
    assert batches[0].metrics()["batch/dropped_oversize_count"] == 1.0


def test_fixed_count_batcher_yields_balanced_fixed_count_micro_batches():
    lengths = itertools.cycle((4, 3, 2, 1))
    batches = push_all(
        FixedCountBatcher(num_ranks=2, microbatch_size=4), [make_sample(next(lengths)) for _ in range(12)]
    )
    assert len(batches) == 3
    for batch in batches:
        assert_valid(batch, 2)
        assert batch.num_samples == 4


def test_balance_places_every_sample_once_without_empty_rows():
    samples = [make_sample(n) for n in (5, 1, 1, 1, 1)]
    rows = balance_groups(samples, 2)
    assert all(row.num_samples > 0 for row in rows)
    assert sorted(id(s) for row in rows for s in row.samples) == sorted(id(s) for s in samples)


def test_balance_is_lpt_over_group_loads():
    # Loads of lone samples: L(L+1)/2 -> 4:10, 3:6, 2:3, 1:1. LPT: [4] | [3, 2, 1] with loads 10 | 10.
    samples = [make_sample(n) for n in (4, 3, 2, 1)]
    rows = balance_groups(samples, 2)
    assert row_lengths_of(rows) == [[4], [3, 2, 1]]
    assert [row.load for row in rows] == [10, 10]


def row_lengths_of(rows):
    return [[len(s) for s in row.samples] for row in rows]


def test_balance_keeps_groups_whole():
    prompt = [1, 2, 3]
    group_a = [make_sample(group_id=1, ids=prompt + [10 + i]) for i in range(3)]
    group_b = [make_sample(group_id=2, ids=[7, 10 + i]) for i in range(3)]
    rows = balance_groups(group_a + group_b, 2)
    assert [sorted(row.groups) for row in rows] == [[1], [2]]
    assert rows[0].num_tokens == 2 + 3 * 2  # 1 2 forwarded once; the prompt's last token branches


def test_balance_splits_the_largest_group_until_every_rank_has_one():
    group = [make_sample(group_id=5, ids=[1, 2, 3 + i]) for i in range(5)]
    rows = balance_groups(group, 3)
    assert all(row.num_samples > 0 for row in rows)
    assert sorted(row.num_samples for row in rows) == [1, 2, 2]  # 5 -> [2, 3] -> [2, 1, 2]


# ---- placement rules -------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_sample_goes_to_its_home_row_even_when_it_is_the_heavier_row(placement):
    batcher = TokenBudgetBatcher(2, 32, placement)
    first = make_sample(group_id=7, ids=[1, 2, 3, 4, 5, 6])
    other = make_sample(group_id=9, ids=[50, 51])
    sibling = make_sample(group_id=7, ids=[1, 2, 3, 4, 5, 7])
    push_all(batcher, [first, other, sibling])
    batch = batcher.flush()
    assert [sorted(row.groups) for row in batch.rows] == [[7], [9]]
    assert batch.rows[0].num_tokens == 8  # the siblings branch at 5: only 5 and 7 are novel


def home_full_scenario():
    """Row 0 holds group 1 and is full for its next sample; row 1 holds a small unrelated sample."""
    home = make_sample(group_id=1, ids=[1, 2, 3, 4, 5, 6, 7, 8])  # load 36
    small = make_sample(group_id=2, ids=[60, 61])  # load 3
    sibling = make_sample(group_id=1, ids=[1, 2, 90, 91])  # shares 1 token with row 0: 3 novel, 8 + 3 > 10
    return home, small, sibling


def test_seed_moves_a_sample_out_of_its_full_home_row_when_the_max_load_does_not_rise():
    home, small, sibling = home_full_scenario()
    batcher = TokenBudgetBatcher(2, 10, "seed")
    assert push_all(batcher, [home, small, sibling]) == []
    # row 1: load 3 + Δ 10 = 13 <= max load 36: accepted
    assert [[s is sibling for s in row.samples] for row in batcher.flush().rows] == [[False], [False, True]]


def test_116_closes_when_the_home_row_is_full_and_every_row_holds_a_sample():
    home, small, sibling = home_full_scenario()
    batcher = TokenBudgetBatcher(2, 10, "1.16")
    (closed,) = push_all(batcher, [home, small, sibling])
    assert [row.samples for row in closed.rows] == [[home], [small]]
    assert batcher.pending == [sibling]


def test_seed_closes_when_moving_would_raise_the_max_load():
    home = make_sample(group_id=1, ids=[1, 2, 3, 4])  # load 10
    small = make_sample(group_id=2, ids=[60])  # load 1
    sibling = make_sample(group_id=1, ids=[1, 2, 3, 5, 6])  # row 0: 4 + 3 novel > 6; row 1: 1 + 5 <= 6 fits
    batcher = TokenBudgetBatcher(2, 6, "seed")  # but row 1's load would become 1 + 15 > 10
    (closed,) = push_all(batcher, [home, small, sibling])
    assert [row.samples for row in closed.rows] == [[home], [small]]


def test_a_new_group_goes_to_the_least_loaded_fitting_row_lowest_rank_on_ties():
    for placement in PLACEMENTS:
        batcher = TokenBudgetBatcher(3, 16, placement)
        a, b, c, d = (make_sample(n) for n in (4, 2, 2, 3))
        push_all(batcher, [a, b, c, d])
        # a -> 0, b -> 1, c -> 2 (empty rows first), d -> row 1 (load 3, tie with row 2, lowest rank)
        assert [[len(s) for s in row.samples] for row in batcher._rows] == [[4], [2, 3], [2]]


# ---- flush -----------------------------------------------------------------------------------------------


def test_flush_fills_empty_rows_by_moving_samples():
    prompt = [1, 2, 3]
    samples = [make_sample(group_id=4, ids=prompt + [10 + i]) for i in range(3)]
    batcher = TokenBudgetBatcher(3, 64)
    push_all(batcher, samples)
    assert [row.num_samples for row in batcher._rows] == [3, 0, 0]  # home row preferred
    batch = batcher.flush()
    assert_valid(batch, 3, budget=64)
    assert sorted(id(s) for s in batch.samples) == sorted(id(s) for s in samples)
    assert batcher.pending == [] and batcher.flush() is None


def test_flush_with_fewer_samples_than_ranks_returns_none_and_keeps_them():
    batcher = TokenBudgetBatcher(3, 64)
    samples = [make_sample(4), make_sample(5)]
    assert batcher.plan(samples) == []
    assert batcher.pending == samples
    assert batcher.take_pending() == samples and batcher.pending == []

    fixed = FixedCountBatcher(3, 6)
    assert fixed.plan(samples) == []
    assert fixed.pending == samples


def test_plan_completes_a_short_tail_by_moving_a_sample_or_joining_an_earlier_row():
    """`plan` (a whole step, docs/algorithms.md §4.5.2): a last micro-batch of fewer samples than ranks gets a
    sample moved out of a two-sample row; without one, the tail joins an earlier row it fits in; else it stays
    pending (the caller counts it unplanned)."""
    a, b, c, d, tail = (make_sample(n) for n in (10, 10, 10, 10, 35))
    batcher = TokenBudgetBatcher(2, 40)
    batches = batcher.plan([a, b, c, d, tail])
    assert [[row.samples for row in batch.rows] for batch in batches] == [[[a], [b, d]], [[tail], [c]]]
    assert batcher.pending == [] and batcher.tail_planned_count == 1

    small, big, big2, big3, tail = (make_sample(n) for n in (10, 40, 40, 40, 30))
    batcher = TokenBudgetBatcher(2, 45)
    batches = batcher.plan([small, big, big2, big3, tail])
    assert [[row.samples for row in batch.rows] for batch in batches] == [[[small, tail], [big]], [[big2], [big3]]]

    samples = [make_sample(25) for _ in range(3)]
    batcher = TokenBudgetBatcher(2, 40)
    assert len(batcher.plan(samples)) == 1 and batcher.pending == samples[2:] and batcher.tail_planned_count == 0


def test_fixed_count_flush_emits_a_short_micro_batch():
    batches = FixedCountBatcher(2, 4).plan([make_sample(3) for _ in range(7)])
    assert [b.num_samples for b in batches] == [4, 3]
    batcher = FixedCountBatcher(2, 4)
    batches = batcher.plan([make_sample(3) for _ in range(9)])  # a tail of one joins the last micro-batch
    assert [b.num_samples for b in batches] == [4, 5] and batcher.pending == [] and batcher.tail_planned_count == 1


def test_invalid_arguments_raise():
    with pytest.raises(ValueError, match="microbatch_size"):
        FixedCountBatcher(4, 3)
    with pytest.raises(ValueError, match="placement"):
        TokenBudgetBatcher(2, 8, "greedy")
    with pytest.raises(ValueError, match="token_budget"):
        TokenBudgetBatcher(2, 0)


# ---- properties on random streams ------------------------------------------------------------------------


@st.composite
def streams(draw):
    """Samples of a few groups sharing a per-group prompt, with ragged (sometimes oversize) lengths."""
    prompts = draw(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), min_size=1, max_size=4))
    samples = []
    for _ in range(draw(st.integers(0, 30))):
        group_id = draw(st.integers(0, len(prompts) - 1))
        ids = prompts[group_id] + draw(st.lists(st.integers(0, 5), max_size=8))
        mask = draw(st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids)))
        samples.append(make_sample(group_id=group_id, ids=ids, mask=mask))
    return samples


def check_partition(batches, pending, expected):
    placed = [id(s) for batch in batches for s in batch.samples] + [id(s) for s in pending]
    assert sorted(placed) == sorted(id(s) for s in expected)  # each exactly once


@settings(max_examples=60, deadline=None)
@given(streams(), st.integers(1, 3), st.integers(4, 14), st.sampled_from(PLACEMENTS))
def test_token_budget_batcher_properties(samples, num_ranks, budget, placement):
    batcher = TokenBudgetBatcher(num_ranks, budget, placement)
    batches = batcher.plan(samples)
    admissible = [s for s in samples if len(s) <= budget]
    assert batcher.dropped_oversize_count == len(samples) - len(admissible)
    assert sum(b.dropped_oversize_count for b in batches) <= batcher.dropped_oversize_count
    check_partition(batches, batcher.pending, admissible)
    assert len(batcher.pending) < num_ranks
    # a short tail is planned (docs/algorithms.md §4.5.2): what stays pending fits in no row of the step
    assert all(not row.fits(s, budget) for s in batcher.pending for batch in batches for row in batch.rows)
    assert batcher.tail_planned_count <= num_ranks - 1
    for batch in batches:
        assert_valid(batch, num_ranks, budget)
        for row in batch.rows:  # the row's own accounting matches a fresh rebuild
            rebuilt = TreeRow()
            for s in row.samples:
                rebuilt.add(s)
            assert (rebuilt.num_tokens, rebuilt.load) == (row.num_tokens, row.load)


@settings(max_examples=40, deadline=None)
@given(streams(), st.integers(1, 3), st.integers(0, 4))
def test_fixed_count_batcher_properties(samples, num_ranks, extra):
    microbatch_size = num_ranks + extra
    batcher = FixedCountBatcher(num_ranks, microbatch_size)
    batches = batcher.plan(samples)
    check_partition(batches, batcher.pending, samples)
    assert len(batcher.pending) < num_ranks and (not batcher.pending or not batches)  # a tail joins the last one
    for batch in batches[:-1]:
        assert batch.num_samples == microbatch_size
    assert not batches or batches[-1].num_samples < microbatch_size + num_ranks
    for batch in batches:
        assert_valid(batch, num_ranks)
        groups = {s.group_id for s in batch.samples}
        if len(groups) >= num_ranks:  # no split needed: every group stays in one row
            assert sum(len(row.groups) for row in batch.rows) == len(groups)
