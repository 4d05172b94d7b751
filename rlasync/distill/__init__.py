"""On-policy distillation, data side (docs/algorithms.md §9): the sample, MOPD routing, Σ L² batching and collation, and the
worker loop (the distillation policy on the rollout task scheduler) that generates with the student and scores
with the teacher engines. No torch, no ray."""

from rlasync.distill.batching import (
    DROPPED_OVERSIZE_METRIC,
    DistillMicroBatch,
    DistillRow,
    FixedCountBatcher,
    TokenBudgetBatcher,
    balance_by_squared_length,
    batch_metrics,
    collate_rows,
)
from rlasync.distill.loop import AsyncDistillationLoop, resolve_max_inflight_tasks
from rlasync.distill.policy import DistillationPolicy
from rlasync.distill.routing import TEACHER_ID_COLUMN, TeacherRouter, teacher_indices
from rlasync.distill.samples import (
    DEFAULT_TEACHER_ID,
    Candidates,
    DistillationSample,
    build_distillation_sample,
    candidates_from_score,
    parse_position,
    parse_prompt_logprobs,
)

__all__ = [
    "AsyncDistillationLoop",
    "DEFAULT_TEACHER_ID",
    "DROPPED_OVERSIZE_METRIC",
    "TEACHER_ID_COLUMN",
    "Candidates",
    "DistillMicroBatch",
    "DistillationPolicy",
    "DistillRow",
    "DistillationSample",
    "FixedCountBatcher",
    "TeacherRouter",
    "TokenBudgetBatcher",
    "balance_by_squared_length",
    "batch_metrics",
    "build_distillation_sample",
    "candidates_from_score",
    "collate_rows",
    "parse_position",
    "parse_prompt_logprobs",
    "resolve_max_inflight_tasks",
    "teacher_indices",
]
