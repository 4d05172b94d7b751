"""The distillation sample (docs/algorithms.md §9.2) and the parsing of a teacher's teacher-forced top-k log-probs (§9.1).

A `DistillationSample` is one prompt's student completion with the teacher's per-position candidates:

    input_ids              [L] int64     prompt_ids + completion_ids
    completion_mask        [L] int8      0 on the prompt, 1 on the completion
    teacher_topk_ids       [L, K+1] int64    -1 where no candidate
    teacher_topk_logprobs  [L, K+1] float32  -inf where no candidate

Row `j` of the teacher arrays holds the teacher's distribution for **predicting token `j`** (conditioned on the
tokens before it): row `len(prompt) + i` receives completion position `i`'s candidates, left-aligned and sorted by
rank (rank 1, the teacher's top-1, first); prompt rows stay all-sentinel. `K = teacher_top_k`; the `+1` holds the
realised token when it is outside the teacher's top-k (vLLM reports it in `prompt_logprobs`; it is always kept).

Candidates come either from vLLM's raw `prompt_logprobs` (`parse_prompt_logprobs`) or from an engine's
`ScoreResult` (`candidates_from_score`). `ScoreResult` keeps only the top-k per position plus the realised token's
log-prob in a separate list (`token_logprobs`); `candidates_from_score` puts the realised token back as the
`K+1`-th candidate when it is not among the top-k, so both paths give the same arrays.

No torch, no ray.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlasync.engine.base import ScoreResult

DEFAULT_TEACHER_ID = "default"
PAD_TEACHER_ID = -1
PAD_TEACHER_LOGPROB = -np.inf

Candidates = tuple[list[int], list[float]]
"""One position's teacher candidates: ids and log-probs, sorted by rank (best first)."""


@dataclass(frozen=True, slots=True)
class DistillationSample:
    """What the distillation learner trains on: one student completion and the teacher's candidates (docs/algorithms.md §9.2).

    `policy_version` is the student's weight version when the task started (the spec's `model_version`; aliased);
    `prompt_id` is the global prompt counter (GRPO's `group_id` with one rollout per prompt; aliased as `group_id`
    so the staleness queue handles distillation samples as one-sample groups). `metrics` are per-sample scalars the
    collator averages (empty for the built-in worker). No advantage, no reward, no sampler log-probs.
    """

    input_ids: np.ndarray
    completion_mask: np.ndarray
    teacher_topk_ids: np.ndarray
    teacher_topk_logprobs: np.ndarray
    prompt_id: int
    teacher_id: str = DEFAULT_TEACHER_ID
    policy_version: int = 0
    row_index: int = -1
    prompt: Any = None
    completion: Any = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    enqueued_at: float = 0.0

    def __post_init__(self) -> None:
        coerce = object.__setattr__
        for name, dtype in (("input_ids", np.int64), ("completion_mask", np.int8)):
            value = np.asarray(getattr(self, name), dtype=dtype)
            if value.ndim != 1:
                raise ValueError(f"DistillationSample.{name} must be 1-D, got shape {value.shape}")
            coerce(self, name, value)
        n = self.input_ids.shape[0]
        if self.completion_mask.shape != (n,):
            raise ValueError(
                f"DistillationSample.completion_mask has shape {self.completion_mask.shape} but input_ids has {n} "
                "tokens: every per-token array must have one entry per token of input_ids"
            )
        for name, dtype in (("teacher_topk_ids", np.int64), ("teacher_topk_logprobs", np.float32)):
            value = np.asarray(getattr(self, name), dtype=dtype)
            if value.ndim != 2 or value.shape[0] != n or value.shape[1] < 1:
                raise ValueError(
                    f"DistillationSample.{name} must have shape [{n}, K+1] (one row per token, K+1 >= 1), "
                    f"got {value.shape}"
                )
            coerce(self, name, value)
        if self.teacher_topk_ids.shape != self.teacher_topk_logprobs.shape:
            raise ValueError(
                f"DistillationSample: teacher_topk_ids {self.teacher_topk_ids.shape} and teacher_topk_logprobs "
                f"{self.teacher_topk_logprobs.shape} must have the same shape"
            )
        if bool((self.teacher_topk_ids[self.completion_mask == 0] != PAD_TEACHER_ID).any()):
            raise ValueError("DistillationSample: prompt (completion_mask = 0) rows of teacher_topk_ids must be all -1")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trained_tokens(self) -> int:
        return int(self.completion_mask.sum())

    @property
    def model_version(self) -> int:
        """The spec's name of `policy_version`."""
        return self.policy_version

    @property
    def group_id(self) -> int:
        """`prompt_id` (a group of one sample, for code keyed on groups such as the staleness queue)."""
        return self.prompt_id

    @property
    def width(self) -> int:
        """Candidate slots per position (K+1)."""
        return int(self.teacher_topk_ids.shape[1])

    def replace(self, **changes: Any) -> DistillationSample:
        return dataclasses.replace(self, **changes)


# ---- parsing ------------------------------------------------------------------------------------------------


def parse_position(entry: Mapping[Any, Any] | None) -> Candidates:
    """One position of vLLM's `prompt_logprobs`: `{token_id (int or str): {"logprob": x, "rank": k}}` (or objects
    with `.logprob`/`.rank`, or bare floats) -> (ids, log-probs) sorted by rank (by log-prob, then id, when a rank
    is missing); NaN log-probs dropped; `None` or `{}` -> empty."""
    if not entry:
        return [], []
    items = []
    for token, value in entry.items():
        logprob, rank = _logprob_and_rank(value)
        if math.isnan(logprob):
            continue
        items.append((int(token), logprob, rank))
    if all(rank is not None for _, _, rank in items):
        items.sort(key=lambda item: (item[2], item[0]))
    else:
        items.sort(key=lambda item: (-item[1], item[0]))
    return [token for token, _, _ in items], [logprob for _, logprob, _ in items]


def parse_prompt_logprobs(prompt_logprobs: Sequence[Mapping[Any, Any] | None], prompt_length: int) -> list[Candidates]:
    """The completion positions `[prompt_length, len(prompt_logprobs))` of vLLM's `prompt_logprobs` (entry `i`
    scores `sequence[i]` given `sequence[:i]`), each parsed by `parse_position` (docs/algorithms.md §9.1)."""
    return [parse_position(prompt_logprobs[i]) for i in range(prompt_length, len(prompt_logprobs))]


def candidates_from_score(result: ScoreResult, completion_ids: Sequence[int]) -> list[Candidates]:
    """Per completion position, the `ScoreResult`'s top-k (NaN dropped, rank order kept) plus the realised token
    `completion_ids[i]` with `result.token_logprobs[i]` appended when it is not among them (the `K+1`-th slot
    that `ScoreResult` does not keep in its top-k lists)."""
    num_positions = len(result.topk_ids)
    if len(result.topk_logprobs) != num_positions:
        raise ValueError(
            f"ScoreResult has {num_positions} top-k id lists but {len(result.topk_logprobs)} log-prob lists"
        )
    if num_positions > len(completion_ids):
        raise ValueError(f"ScoreResult scores {num_positions} positions but the completion has {len(completion_ids)}")
    out: list[Candidates] = []
    for i in range(num_positions):
        pairs = [
            (int(t), float(lp)) for t, lp in zip(result.topk_ids[i], result.topk_logprobs[i]) if not math.isnan(lp)
        ]
        ids = [t for t, _ in pairs]
        logprobs = [lp for _, lp in pairs]
        realised = int(completion_ids[i])
        if i < len(result.token_logprobs) and realised not in ids:
            logprob = float(result.token_logprobs[i])
            if not math.isnan(logprob):
                ids.append(realised)
                logprobs.append(logprob)
        out.append((ids, logprobs))
    return out


# ---- building -------------------------------------------------------------------------------------------------


def build_distillation_sample(
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    teacher: ScoreResult | Sequence[Candidates],
    top_k: int,
    *,
    prompt_id: int,
    teacher_id: str = DEFAULT_TEACHER_ID,
    policy_version: int = 0,
    row_index: int = -1,
    prompt: Any = None,
    completion: Any = None,
    metrics: Mapping[str, float] | None = None,
    enqueued_at: float = 0.0,
) -> DistillationSample:
    """The docs/algorithms.md §9.2 sample of one task. `teacher` is the teacher engine's `ScoreResult` of `prompt_ids +
    completion_ids` (scored from `len(prompt_ids)`), or per completion position its `(ids, log-probs)` candidates
    sorted by rank (e.g. `parse_prompt_logprobs`). Arrays are `(L, top_k + 1)`; a position with more than
    `top_k + 1` candidates raises `ValueError`; positions beyond the candidates given stay all-sentinel (no
    teacher signal there)."""
    if top_k < 0:
        raise ValueError(f"build_distillation_sample: top_k={top_k} must be >= 0")
    prompt_ids, completion_ids = [int(t) for t in prompt_ids], [int(t) for t in completion_ids]
    if isinstance(teacher, ScoreResult):
        candidates = candidates_from_score(teacher, completion_ids)
    else:
        candidates = list(teacher)
    if len(candidates) > len(completion_ids):
        raise ValueError(
            f"build_distillation_sample: {len(candidates)} positions of teacher candidates for a completion of "
            f"{len(completion_ids)} tokens"
        )
    width = top_k + 1
    num_prompt, length = len(prompt_ids), len(prompt_ids) + len(completion_ids)
    ids = np.full((length, width), PAD_TEACHER_ID, dtype=np.int64)
    logprobs = np.full((length, width), PAD_TEACHER_LOGPROB, dtype=np.float32)
    for i, (position_ids, position_logprobs) in enumerate(candidates):
        count = len(position_ids)
        if count != len(position_logprobs):
            raise ValueError(f"completion position {i}: {count} candidate ids but {len(position_logprobs)} log-probs")
        if count > width:
            raise ValueError(
                f"completion position {i} has {count} teacher candidates: at most teacher_top_k + 1 = {width} "
                "(the top-k plus the realised token)"
            )
        ids[num_prompt + i, :count] = position_ids
        logprobs[num_prompt + i, :count] = position_logprobs
    return DistillationSample(
        input_ids=np.asarray(prompt_ids + completion_ids, dtype=np.int64),
        completion_mask=np.asarray([0] * num_prompt + [1] * len(completion_ids), dtype=np.int8),
        teacher_topk_ids=ids,
        teacher_topk_logprobs=logprobs,
        prompt_id=int(prompt_id),
        teacher_id=teacher_id,
        policy_version=int(policy_version),
        row_index=int(row_index),
        prompt=prompt,
        completion=completion,
        metrics=dict(metrics or {}),
        enqueued_at=float(enqueued_at),
    )


def _logprob_and_rank(value: Any) -> tuple[float, int | None]:
    if isinstance(value, int | float):
        return float(value), None
    if isinstance(value, Mapping):
        logprob, rank = value.get("logprob"), value.get("rank")
    else:
        logprob, rank = getattr(value, "logprob", None), getattr(value, "rank", None)
    if logprob is None:
        return math.nan, None
    return float(logprob), None if rank is None else int(rank)


__all__ = [
    "DEFAULT_TEACHER_ID",
    "PAD_TEACHER_ID",
    "PAD_TEACHER_LOGPROB",
    "Candidates",
    "DistillationSample",
    "build_distillation_sample",
    "candidates_from_score",
    "parse_position",
    "parse_prompt_logprobs",
]
