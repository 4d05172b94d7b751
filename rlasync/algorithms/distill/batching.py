"""Micro-batching and collation of distillation samples (docs/algorithms.md §9.5): plain padding-free packing, Σ L² balancing.

A micro-batch is one row per DP rank; a row is a list of whole samples laid end to end (no prefix sharing: the
budget counts raw tokens). A row's load is Σ L² over its samples (the attention cost of padding-free packing).

    batcher = TokenBudgetBatcher(num_ranks=P, token_budget=B)     # or FixedCountBatcher(P, B_per_rank × P)
    for sample in stream:
        for micro_batch in batcher.push(sample):
            batch = micro_batch.collate(pad_token_id, teacher_ids)
            metrics = micro_batch.metrics()

Both batchers share GRPO's planner interface (`push`, `flush`, `plan`, `pending`, `take_pending`;
`rlasync.packing.planner`). Every emitted micro-batch has exactly `num_ranks` rows, none empty.

Collated arrays (`collate_rows`), `[P, N]` with `N` the longest row:
  input_ids (pad id), position_ids (restart at 0 per sample; 0 on padding), attention_mask (0 on padding),
  completion_mask (0), teacher_topk_ids `[P, N, W]` (-1), teacher_topk_logprobs (-inf), teacher_id_idx (-1; only
  with more than one teacher), num_samples `[P]`, and broadcast `[P]` scalars global_n_tokens (Σ completion tokens
  of the micro-batch), global_n_forward_tokens (Σ raw tokens), mean_seq_len (raw tokens per sample).
No torch, no ray.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlasync.algorithms.distill.samples import PAD_TEACHER_ID, PAD_TEACHER_LOGPROB, DistillationSample
from rlasync.metrics import MetricValue
from rlasync.packing.planner import BudgetBatcher
from rlasync.packing.planner import FixedCountBatcher as PlannerFixedCountBatcher

logger = logging.getLogger(__name__)

DROPPED_OVERSIZE_METRIC = "batch/dropped_oversize_total"


@dataclass(eq=False)
class DistillRow:
    """One rank's row: whole samples end to end; `load` = Σ L²."""

    samples: list[DistillationSample] = field(default_factory=list)
    num_tokens: int = 0
    load: int = 0

    def add(self, sample: DistillationSample) -> None:
        self.samples.append(sample)
        self.num_tokens += len(sample)
        self.load += len(sample) ** 2

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def num_trained_tokens(self) -> int:
        return sum(sample.num_trained_tokens for sample in self.samples)


def balance_by_squared_length(samples: Sequence[DistillationSample], num_rows: int) -> list[DistillRow]:
    """Longest first, each sample into the row with the smallest current Σ L² (lowest index on ties).

    With at least `num_rows` non-empty samples no row stays empty. Examples (docs/algorithms.md §9.5): lengths (3,3,2,2) over 2
    rows -> Σ L² 13 and 13; (4,3,2,1) -> [4] | [3,2,1] with loads 16 and 14.
    """
    if num_rows < 1:
        raise ValueError(f"balance_by_squared_length: num_rows must be >= 1, got {num_rows}")
    rows = [DistillRow() for _ in range(num_rows)]
    for sample in sorted(samples, key=lambda s: -len(s)):  # stable: equal lengths keep arrival order
        min(rows, key=lambda row: row.load).add(sample)
    return rows


@dataclass(eq=False)
class DistillMicroBatch:
    """One row per rank, as planned. `token_budget`: the budget the rows were planned under (None for fixed-count
    batches); `dropped_oversize_count`: oversize samples dropped since the previous micro-batch (None without a
    budget)."""

    rows: list[DistillRow]
    token_budget: int | None = None
    dropped_oversize_count: int | None = None

    @property
    def samples(self) -> list[DistillationSample]:
        return [sample for row in self.rows for sample in row.samples]

    @property
    def num_samples(self) -> int:
        return sum(row.num_samples for row in self.rows)

    @property
    def prompt_ids(self) -> set[int]:
        """Prompts trained by this micro-batch (feeds the trainer's trained-prompt set)."""
        return {sample.prompt_id for sample in self.samples}

    def collate(
        self, pad_token_id: int, teacher_ids: Sequence[str] | Mapping[str, Any] | None = None
    ) -> dict[str, np.ndarray]:
        return collate_rows(self.rows, pad_token_id, teacher_ids)

    def metrics(self) -> dict[str, MetricValue]:
        return batch_metrics(self.rows, self.token_budget, dropped_oversize_count=self.dropped_oversize_count)


class FixedCountBatcher(PlannerFixedCountBatcher):
    """Micro-batches of exactly `microbatch_size` samples (B × P), split over the ranks by
    `balance_by_squared_length`; emits when the buffer reaches that size. No budget: peak memory is unbounded.
    (GRPO's `rlasync.packing.FixedCountBatcher` with plain rows instead of prefix trees.)"""

    def __init__(self, num_ranks: int, microbatch_size: int) -> None:
        super().__init__(num_ranks, microbatch_size, share_prefixes=False)

    def _make_batch(self, samples: list[Any]) -> DistillMicroBatch:
        return DistillMicroBatch(balance_by_squared_length(samples, self.num_ranks))


class TokenBudgetBatcher(BudgetBatcher):
    """Rows of at most `token_budget` raw tokens (docs/algorithms.md §9.5; the default, budget = the student's
    max_model_len), on the planner skeleton GRPO's batcher uses (`rlasync.packing.planner.BudgetBatcher`).

    A sample longer than the budget is dropped and counted (`dropped_oversize_count`: running total; each
    micro-batch carries its drops since the previous one, logged as `batch/dropped_oversize_total`). Otherwise the
    candidate rows are those with `tokens + len ≤ budget`; with none, the open micro-batch is emitted and the
    sample starts fresh rows; else it goes to the candidate with the smallest Σ L² (lowest rank on ties). An empty
    row is always a candidate of least load, so an emitted micro-batch never has an empty row.
    """

    def _new_rows(self) -> list[DistillRow]:
        return [DistillRow() for _ in range(self.num_ranks)]

    def _batch(self, rows: list[Any], dropped: int) -> DistillMicroBatch:
        return DistillMicroBatch(rows, self.token_budget, dropped)

    def _fits(self, row: DistillRow, sample: DistillationSample) -> bool:
        return row.num_tokens + len(sample) <= self.token_budget

    def _describe(self, sample: Any) -> str:
        return f"prompt {sample.prompt_id}"

    def flush(self) -> DistillMicroBatch | None:
        """Emit the open rows at the end of a finite stream; None (samples stay pending) if a row is empty."""
        if any(row.num_samples == 0 for row in self._rows):
            return None
        return self._emit()

    def _place(self, sample: DistillationSample) -> int | None:
        fitting = [r for r, row in enumerate(self._rows) if row.num_tokens + len(sample) <= self.token_budget]
        return min(fitting, key=lambda r: (self._rows[r].load, r), default=None)


# ---- collation ------------------------------------------------------------------------------------------------


def collate_rows(
    rows: Sequence[DistillRow | Sequence[DistillationSample]],
    pad_token_id: int,
    teacher_ids: Sequence[str] | Mapping[str, Any] | None = None,
    *,
    width: int = 0,
) -> dict[str, np.ndarray]:
    """Pack each row's samples end to end and pad the rows to `[P, N]` (see the module docstring).

    `width`: the candidates' slots at least (a rank collating its own row pads to its micro-batch's widest sample).

    `teacher_ids` (ids in stable order, e.g. `teacher_server_urls`): with more than one, `teacher_id_idx` `[P, N]`
    holds each token's teacher index (-1 on padding); a sample whose teacher is not listed raises `ValueError`.
    """
    samples_by_row = [list(row.samples) if isinstance(row, DistillRow) else list(row) for row in rows]
    if not samples_by_row:
        raise ValueError("collate_rows: no row to stack")
    num_samples = sum(len(samples) for samples in samples_by_row)
    if num_samples == 0:
        raise ValueError("collate_rows: the rows hold no sample")
    ids_order = list(teacher_ids) if teacher_ids is not None else []
    multi_teacher = len(ids_order) > 1
    index_of = {teacher_id: index for index, teacher_id in enumerate(ids_order)}
    num_rows = len(samples_by_row)
    lengths = [sum(len(sample) for sample in samples) for samples in samples_by_row]
    width = max(width, *(sample.width for samples in samples_by_row for sample in samples))
    longest = max(lengths)

    input_ids = np.full((num_rows, longest), pad_token_id, dtype=np.int64)
    position_ids = np.zeros((num_rows, longest), dtype=np.int64)
    attention_mask = np.zeros((num_rows, longest), dtype=np.int64)
    completion_mask = np.zeros((num_rows, longest), dtype=np.int8)
    topk_ids = np.full((num_rows, longest, width), PAD_TEACHER_ID, dtype=np.int64)
    topk_logprobs = np.full((num_rows, longest, width), PAD_TEACHER_LOGPROB, dtype=np.float32)
    teacher_id_idx = np.full((num_rows, longest), -1, dtype=np.int64)
    for r, samples in enumerate(samples_by_row):
        start = 0
        for sample in samples:
            end = start + len(sample)
            input_ids[r, start:end] = sample.input_ids
            position_ids[r, start:end] = np.arange(len(sample))
            attention_mask[r, start:end] = 1
            completion_mask[r, start:end] = sample.completion_mask
            topk_ids[r, start:end, : sample.width] = sample.teacher_topk_ids
            topk_logprobs[r, start:end, : sample.width] = sample.teacher_topk_logprobs
            if multi_teacher:
                if sample.teacher_id not in index_of:
                    raise ValueError(
                        f"sample of prompt {sample.prompt_id} has teacher_id {sample.teacher_id!r}, which is not "
                        f"among the teachers {ids_order}"
                    )
                teacher_id_idx[r, start:end] = index_of[sample.teacher_id]
            start = end

    n_tokens = int(completion_mask.sum(dtype=np.int64))
    n_forward = sum(lengths)
    batch = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "completion_mask": completion_mask,
        "teacher_topk_ids": topk_ids,
        "teacher_topk_logprobs": topk_logprobs,
        "num_samples": np.asarray([len(samples) for samples in samples_by_row], dtype=np.int64),
        "global_n_tokens": np.full(num_rows, n_tokens, dtype=np.int64),
        "global_n_forward_tokens": np.full(num_rows, n_forward, dtype=np.int64),
        "mean_seq_len": np.full(num_rows, n_forward / num_samples, dtype=np.float32),
    }
    if multi_teacher:
        batch["teacher_id_idx"] = teacher_id_idx
    return batch


def batch_metrics(
    rows: Sequence[DistillRow], token_budget: int | None = None, *, dropped_oversize_count: int | None = None
) -> dict[str, MetricValue]:
    """Collator metrics of one micro-batch (GRPO's docs/algorithms.md §4.6 set without `batch/packing_ratio`; row tokens are raw
    tokens; `batch/row_imbalance` = max Σ L² / mean Σ L²). `batch/row_fill_frac` only with a positive budget;
    `batch/dropped_oversize_total` only when `dropped_oversize_count` is given. Per-sample `metrics` keys are
    averaged over the samples carrying them, NaN ignored."""
    samples = [sample for row in rows for sample in row.samples]
    if not samples:
        raise ValueError("batch_metrics: the micro-batch holds no sample")
    lengths = [len(sample) for sample in samples]
    trained = [sample.num_trained_tokens for sample in samples]
    raw = sum(lengths)
    row_tokens = [row.num_tokens for row in rows]
    loads = [row.load for row in rows]
    num_rows = len(rows)
    slots = num_rows * max(row_tokens)
    mean_load = sum(loads) / num_rows
    metrics: dict[str, MetricValue] = {
        "sample/forwarded_tokens_mean": raw / len(samples),
        "sample/forwarded_tokens_max": float(max(lengths)),
        "sample/trained_tokens_mean": sum(trained) / len(samples),
        "batch/masked_token_frac": (float(raw - sum(trained)), float(raw)),
        "batch/samples_per_row": len(samples) / num_rows,
        "batch/row_tokens_mean": sum(row_tokens) / num_rows,
        "batch/row_tokens_max": float(max(row_tokens)),
        "batch/row_imbalance": max(loads) / mean_load if mean_load > 0 else math.nan,
        "batch/pad_frac": (float(slots - raw), float(slots)),
    }
    if token_budget is not None and token_budget > 0:
        metrics["batch/row_fill_frac"] = (float(raw), float(token_budget * num_rows))
    if dropped_oversize_count is not None:
        metrics[DROPPED_OVERSIZE_METRIC] = float(dropped_oversize_count)
    carried: dict[str, list[float]] = {}
    for sample in samples:
        for key, value in sample.metrics.items():
            carried.setdefault(key, []).append(float(value))
    for key, values in carried.items():
        kept = [value for value in values if not math.isnan(value)]
        metrics[key] = sum(kept) / len(kept) if kept else math.nan
    return metrics


__all__ = [
    "DROPPED_OVERSIZE_METRIC",
    "DistillMicroBatch",
    "DistillRow",
    "FixedCountBatcher",
    "TokenBudgetBatcher",
    "balance_by_squared_length",
    "batch_metrics",
    "collate_rows",
]
