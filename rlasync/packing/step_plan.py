"""The step's composition (docs/algorithms.md §4.5.1): which queued samples one optimizer step takes.

A step is `micro_batches` (= gradient_accumulation_steps) micro-batches of `num_ranks` rows each, every row filled
by the learner's own token-budget planner (GRPO: `rlasync.packing.planner.TokenBudgetBatcher`, `token_budget`
*unique* tokens per row, a shared prompt counted once; distillation: its plain-row batcher). That is TRL's
`TokenBudgetBatcher` feeding `gradient_accumulation_steps` micro-batches to one optimizer step.

The queue runs that planner over its entries, in the order it hands them out, before it hands them out:

    composer = StepComposer(plan)
    for entry in queue:                   # FIFO, stale entries already dropped
        if not composer.offer(entry):     # it would open micro-batch micro_batches + 1: the step is full
            break                         # and the entry stays queued: it opens the next step
        take(entry)
    composer.reset()                      # after the step (the queue's finish_step)

so the learner, planning exactly the step's samples in that order, forms exactly `micro_batches` micro-batches
(the last closed by its `flush`). A micro-batch closes only once every row holds a sample, so the last one has no
empty row. An oversize sample is taken and dropped by both (counted by the learner). An entry without token ids
(`QueueEntry.input_ids` None) is planned as a chain of its own (nothing shared): it never makes a row overflow.

Pure numpy: no torch, no ray.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TREE_BATCHER = "rlasync.packing.planner:TokenBudgetBatcher"


@dataclass(frozen=True)
class StepPlan:
    """How the learner plans a step: its token-budget batcher ("module:Class", built as
    `cls(num_ranks, token_budget[, share_prefixes=..., placement=...])`), the rows per micro-batch (learner ranks), the row budget
    in unique tokens and the micro-batches per step (`gradient_accumulation_steps`)."""

    num_ranks: int
    token_budget: int
    micro_batches: int
    batcher: str = TREE_BATCHER
    share_prefixes: bool = True
    """False: every sample its own chain (a model with linear-attention layers trains padding-free)."""
    placement: str = "seed"
    """The tree batcher's placement rule (`rlasync.packing.planner.PLACEMENTS`; "1.16" is TRL 1.16's)."""

    def __post_init__(self) -> None:
        for name in ("num_ranks", "token_budget", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"StepPlan: {name}={getattr(self, name)} must be >= 1")
        if ":" not in self.batcher:
            raise ValueError(f"StepPlan: batcher={self.batcher!r} must be 'module:Class'")

    def new_batcher(self) -> Any:
        """A fresh batcher, as the learner's objective builds it."""
        module, _, name = self.batcher.partition(":")
        cls = getattr(importlib.import_module(module), name)
        accepted = inspect.signature(cls).parameters
        options = {"share_prefixes": self.share_prefixes, "placement": self.placement}
        return cls(self.num_ranks, self.token_budget, **{k: v for k, v in options.items() if k in accepted})


@dataclass(frozen=True, slots=True, eq=False)
class PlanSample:
    """What a batcher reads of a sample (`PackableSample`'s planning part), made from a queue entry; `metrics`
    (the sample's per-sample scalars) for the planner's metrics (`rlasync.learner.sharing`)."""

    input_ids: np.ndarray
    group_id: int
    num_trained_tokens: int
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_id(self) -> int:
        """Distillation's name for the group (one sample per prompt)."""
        return self.group_id


class StepComposer:
    """Runs the learner's planner over the entries one step takes (see the module docstring)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan
        self._own_tokens = 0  # distinct negative token ids for entries without ids: nothing is shared
        self.reset()

    def reset(self) -> None:
        """Start the next step: empty rows, no micro-batch closed."""
        self._batcher = self.plan.new_batcher()
        self.closed = 0
        self.num_samples = 0
        self.full = False

    def offer(self, entry: Any) -> bool:
        """Whether `entry` (a `QueueEntry`) belongs to this step; it is then planned. False once the step is full:
        the entry would open micro-batch `micro_batches + 1` (it is left for the next step)."""
        if self.full:
            return False
        sample = self._sample(entry)
        if len(sample) == 0:  # the learner's planner refuses it with its own message
            self.num_samples += 1
            return True
        if self.closed == self.plan.micro_batches - 1 and self._batcher.would_close(sample):
            self.full = True
            return False
        self.closed += len(self._batcher.push(sample))
        self.num_samples += 1
        return True

    def _sample(self, entry: Any) -> PlanSample:
        ids = getattr(entry, "input_ids", None)
        if ids is None:
            start = self._own_tokens - 1
            self._own_tokens -= entry.num_tokens
            ids = np.arange(start, start - entry.num_tokens, -1, dtype=np.int64)
        return PlanSample(np.asarray(ids), entry.group_id, entry.num_trained_tokens)


__all__ = ["TREE_BATCHER", "PlanSample", "StepComposer", "StepPlan"]
