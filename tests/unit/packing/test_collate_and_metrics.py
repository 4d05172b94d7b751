"""Collator metrics (docs/algorithms.md §4.6) and rectangular stacking on hand-built micro-batches; expected values by hand."""

import math

import numpy as np
import pytest

from rlasync.packing import IGNORE_INDEX, MicroBatch, TreeRow, pack, packing_metrics, pad_rows
from rlasync.records import RolloutSample

X = IGNORE_INDEX


def make_sample(ids, mask, lps=None, advantage=0.0, group_id=0, metrics=None, **extras):
    return RolloutSample(
        input_ids=np.asarray(ids, dtype=np.int64),
        completion_mask=mask,
        sampler_logprobs=np.zeros(len(ids)) if lps is None else lps,
        advantage=advantage,
        group_id=group_id,
        metrics=metrics or {},
        **extras,
    )


def row_of(*samples):
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return row


def worked_micro_batch():
    """docs/algorithms.md §4.4's samples on two ranks: the group-7 pair on rank 0, the group-9 sample on rank 1."""
    s0 = make_sample([11, 12, 13, 21, 22], [0, 0, 0, 1, 1], advantage=1.0, group_id=7, metrics={"reward": 1.0})
    s1 = make_sample(
        [11, 12, 13, 31, 32], [0, 0, 0, 1, 1], advantage=-1.0, group_id=7, metrics={"reward": math.nan, "x": math.nan}
    )
    s2 = make_sample(
        [11, 12, 41, 51], [0, 0, 0, 1], advantage=0.5, group_id=9, metrics={"reward": 0.0, "tools/call_frequency": 2.0}
    )
    return [row_of(s0, s1), row_of(s2)]


def test_packing_metrics_on_hand_built_micro_batch():
    rows = worked_micro_batch()
    # rank 0: 10 raw, 8 unique, load 27; rank 1: 4 raw, 4 unique, load 1+2+3+4 = 10. Trained 2 + 2 + 1.
    metrics = packing_metrics(rows, token_budget=16, dropped_oversize_count=2)
    expected = {
        "sample/forwarded_tokens_mean": 14 / 3,
        "sample/forwarded_tokens_max": 5.0,
        "sample/trained_tokens_mean": 5 / 3,
        "batch/masked_token_frac": (9.0, 14.0),
        "batch/samples_per_row": 1.5,
        "batch/row_tokens_mean": 6.0,
        "batch/row_tokens_max": 8.0,
        "batch/row_imbalance": 27 / 18.5,
        "batch/packing_ratio": (14.0, 12.0),
        "batch/pad_frac": (4.0, 16.0),  # [2, 8] slots, 12 real
        "batch/row_fill_frac": (12.0, 32.0),
        "batch/dropped_oversize_count": 2.0,
        "reward": 0.5,  # NaN ignored
        "tools/call_frequency": 2.0,  # only the samples carrying it
    }
    assert set(metrics) == set(expected) | {"x"}
    assert math.isnan(metrics["x"])  # all NaN -> NaN
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value), key


def test_packing_metrics_without_budget_has_no_fill_fraction():
    # Tree analogue of the distillation collator test: rows [a(3)], [b(2)], nothing shared.
    a = make_sample([0, 1, 2], [0, 1, 1], group_id=1)
    b = make_sample([0, 1], [0, 1], group_id=2)
    metrics = packing_metrics([row_of(a), row_of(b)])
    assert "batch/row_fill_frac" not in metrics and "batch/dropped_oversize_count" not in metrics
    assert metrics["batch/masked_token_frac"] == (2.0, 5.0)
    assert metrics["batch/pad_frac"] == (1.0, 6.0)
    assert metrics["batch/row_imbalance"] == pytest.approx(6 / 4.5)  # loads 6 and 3
    batch = pad_rows([pack(row_of(a)), pack(row_of(b))], pad_token_id=7)
    assert batch["input_ids"].tolist() == [[0, 1, 2], [0, 1, 7]]
    assert batch["global_n_tokens"].tolist() == [3, 3]
    assert batch["global_n_forward_tokens"].tolist() == [5, 5]
    assert batch["mean_seq_len"].tolist() == [2.5, 2.5]


def test_packing_metrics_rejects_an_empty_micro_batch():
    with pytest.raises(ValueError, match="no sample"):
        packing_metrics([TreeRow()], 8)


def test_pad_rows_pads_every_array_with_its_pad_value():
    batch = MicroBatch(worked_micro_batch(), token_budget=16).collate(pad_token_id=99)
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22, 13, 31, 32], [11, 12, 41, 51, 99, 99, 99, 99]]
    assert batch["attention_mask"].tolist() == [[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 3, 4], [0, 1, 2, 3, 0, 0, 0, 0]]
    assert batch["subtree_end"].tolist() == [[8, 8, 5, 5, 5, 8, 8, 8], [4, 4, 4, 4, 0, 0, 0, 0]]
    assert batch["shift_labels"].tolist() == [[X, X, 21, 22, X, 31, 32, X], [X, X, 51, X, X, X, X, X]]
    assert batch["tree_cu_seqlens_q"].tolist() == [[0, 2, 5, 8], [0, 4, -1, -1]]
    assert batch["tree_kv_index"].tolist() == [[0, 1, 0, 1, 2, 3, 4, 0, 1, 5, 6, 7], [0, 1, 2, 3] + [-1] * 8]
    assert batch["tree_cu_seqlens_k"].tolist() == [[0, 2, 7, 12], [0, 4, -1, -1]]
    assert batch["tree_max_seqlens"].tolist() == [[3, 5], [4, 4]]
    assert batch["token_index"].tolist() == [[2, 3, 5, 6], [2, -1, -1, -1]]
    assert batch["target_ids"].tolist() == [[21, 22, 31, 32], [51, 0, 0, 0]]
    assert batch["advantages"].tolist() == [[1.0, 1.0, -1.0, -1.0], [0.5, 0.0, 0.0, 0.0]]
    assert batch["sample_index"].tolist() == [[0, 0, 1, 1], [0, 0, 0, 0]]
    assert batch["num_samples"].tolist() == [2, 1] and batch["load"].tolist() == [27, 10]
    assert batch["global_n_tokens"].tolist() == [5, 5]  # Σ loss terms over both ranks
    assert batch["global_n_forward_tokens"].tolist() == [12, 12]
    assert batch["mean_seq_len"].tolist() == [4.0, 4.0]  # unique tokens per sample
    assert "sampler_topk_ids" not in batch and "sampling_mask" not in batch
    assert batch["tree_cu_seqlens_q"].dtype == np.int32 and batch["sampler_logprobs"].dtype == np.float32


def test_pad_rows_pads_optional_extras_of_rows_without_them():
    topk = make_sample([1, 2], [0, 1], sampler_topk_ids=[[5, 6]] * 2, sampler_topk_logprobs=[[-1.0, -2.0]] * 2)
    masked = make_sample([3, 4, 5], [0, 1, 1], sampling_mask=[[-1], [8], [9]])
    batch = pad_rows([pack(row_of(topk)), pack(row_of(masked))], pad_token_id=0)
    assert batch["sampler_topk_ids"].tolist() == [[[5, 6], [-1, -1]], [[-1, -1], [-1, -1]]]
    assert batch["sampler_topk_logprobs"][0, 0].tolist() == [-1.0, -2.0]
    assert np.isneginf(batch["sampler_topk_logprobs"][1]).all()
    assert batch["sampling_mask"].tolist() == [[[-1], [-1]], [[8], [9]]]
    assert batch["has_sampling_mask"].tolist() == [[False, False], [True, True]]
