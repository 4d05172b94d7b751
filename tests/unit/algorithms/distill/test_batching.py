import numpy as np
import pytest

from rlasync.algorithms.distill.batching import (
    FixedCountBatcher,
    TokenBudgetBatcher,
    balance_by_squared_length,
    batch_metrics,
    collate_rows,
)


def _lengths(rows):
    return [[len(sample) for sample in row.samples] for row in rows]


def test_balance_equalises_squared_length(sample_factory):
    samples = [sample_factory(1, n - 1, prompt_id=i) for i, n in enumerate((3, 3, 2, 2))]
    rows = balance_by_squared_length(samples, 2)
    assert [row.load for row in rows] == [13, 13]


def test_balance_longest_first_into_least_loaded(sample_factory):
    samples = [sample_factory(1, n - 1, prompt_id=i) for i, n in enumerate((1, 2, 3, 4))]
    rows = balance_by_squared_length(samples, 2)
    assert _lengths(rows) == [[4], [3, 2, 1]]
    assert [row.load for row in rows] == [16, 14]


def test_fixed_count_emits_at_b_times_p(sample_factory):
    batcher = FixedCountBatcher(num_ranks=2, microbatch_size=4)
    pushed = [batcher.push(sample_factory(1, 1 + i, prompt_id=i)) for i in range(5)]
    assert [len(out) for out in pushed] == [0, 0, 0, 1, 0]
    batch = pushed[3][0]
    assert batch.num_samples == 4 and all(row.num_samples >= 1 for row in batch.rows)
    assert batch.prompt_ids == {0, 1, 2, 3}
    assert [s.prompt_id for s in batcher.pending] == [4]
    assert batcher.flush() is None  # fewer samples than ranks stay pending
    with pytest.raises(ValueError):
        FixedCountBatcher(num_ranks=3, microbatch_size=2)


def test_token_budget_respected_no_empty_row_and_oversize_dropped(sample_factory):
    batcher = TokenBudgetBatcher(num_ranks=2, token_budget=6)
    lengths = [4, 3, 9, 2, 3, 5, 1, 2]
    samples = [sample_factory(1, n - 1, prompt_id=i) for i, n in enumerate(lengths)]
    batches = batcher.plan(samples)
    assert batcher.dropped_oversize_count == 1
    placed = sorted(s.prompt_id for b in batches for s in b.samples)
    assert placed == [0, 1, 3, 4, 5, 6, 7]  # all but the 9-token sample
    for batch in batches:
        assert len(batch.rows) == 2
        assert all(row.num_samples >= 1 and row.num_tokens <= 6 for row in batch.rows)
    assert [b.dropped_oversize_count for b in batches] == [1, 0]
    assert batches[0].metrics()["batch/dropped_oversize_total"] == 1.0
    assert batches[0].metrics()["batch/row_fill_frac"][1] == 12.0


def test_token_budget_places_into_smallest_squared_load(sample_factory):
    batcher = TokenBudgetBatcher(num_ranks=2, token_budget=10)
    for i, n in enumerate((4, 3, 2)):
        batcher.push(sample_factory(1, n - 1, prompt_id=i))
    # 4 -> row 0 (16), 3 -> row 1 (9), 2 -> row 1 (smaller load: 9 < 16)
    assert [[s.prompt_id for s in row.samples] for row in batcher._rows] == [[0], [1, 2]]
    # a 7-token sample fits only row 1 (5 + 7 > 10 fails too) -> nothing fits: emit, start fresh rows
    out = batcher.push(sample_factory(1, 6, prompt_id=3))
    assert len(out) == 1 and [s.prompt_id for s in batcher.pending] == [3]


def test_collator_pads_unequal_rows_and_broadcasts_counts(sample_factory):
    a = sample_factory(1, 2, prompt_id=10, width=3)  # 3 tokens, 2 trained
    b = sample_factory(1, 1, prompt_id=11, width=3)  # 2 tokens, 1 trained
    rows = balance_by_squared_length([a, b], 2)
    batch = collate_rows(rows, pad_token_id=99)
    assert batch["input_ids"].tolist() == [[0, 1, 2], [0, 1, 99]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["completion_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch["teacher_topk_ids"].shape == (2, 3, 3)
    assert batch["teacher_topk_ids"][1].tolist() == [[-1, -1, -1], [100, 200, -1], [-1, -1, -1]]
    assert np.isneginf(batch["teacher_topk_logprobs"][1, 2]).all()
    assert np.isneginf(batch["teacher_topk_logprobs"][:, 0]).all()  # prompt positions all-sentinel
    assert batch["global_n_tokens"].tolist() == [3, 3]
    assert batch["global_n_forward_tokens"].tolist() == [5, 5]
    assert batch["mean_seq_len"].tolist() == [2.5, 2.5]
    assert "teacher_id_idx" not in batch  # one teacher: no per-token index
    metrics = batch_metrics(rows)
    assert metrics["batch/masked_token_frac"] == (2.0, 5.0)
    assert metrics["batch/row_imbalance"] == pytest.approx(9 / 6.5)
    assert metrics["batch/pad_frac"] == (1.0, 6.0)
    assert "batch/row_fill_frac" not in metrics and "batch/packing_ratio" not in metrics
    assert "batch/dropped_oversize_total" not in metrics


def test_positions_restart_per_sample_and_teacher_index_broadcast_under_mopd(sample_factory):
    a = sample_factory(1, 2, prompt_id=0, teacher_id="math")
    b = sample_factory(1, 1, prompt_id=1, teacher_id="code", start_id=50)
    batch = collate_rows([[a, b]], pad_token_id=0, teacher_ids=["math", "code"])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["input_ids"].tolist() == [[0, 1, 2, 50, 51]]
    assert batch["teacher_id_idx"].tolist() == [[0, 0, 0, 1, 1]]
    assert batch["teacher_topk_ids"][0, 4, :2].tolist() == [100, 200]  # b's first completion row
    single = collate_rows([[a, b]], pad_token_id=0, teacher_ids=["math"])
    assert "teacher_id_idx" not in single


def test_teacher_index_padding_and_unknown_teacher(sample_factory):
    a = sample_factory(1, 2, teacher_id="math")
    b = sample_factory(1, 1, teacher_id="code")
    batch = collate_rows([[a], [b]], pad_token_id=0, teacher_ids={"math": "u1", "code": "u2"})
    assert batch["teacher_id_idx"].tolist() == [[0, 0, 0], [1, 1, -1]]
    with pytest.raises(ValueError, match="not among the teachers"):
        collate_rows([[a], [sample_factory(1, 1, teacher_id="chem")]], pad_token_id=0, teacher_ids=["math", "code"])


def test_carried_sample_metrics_are_averaged_ignoring_nan(sample_factory):
    rows = balance_by_squared_length(
        [
            sample_factory(1, 1, metrics={"x": 1.0}),
            sample_factory(1, 2, metrics={"x": 3.0}),
            sample_factory(1, 3, metrics={"x": float("nan")}),
        ],
        2,
    )
    assert batch_metrics(rows)["x"] == 2.0
