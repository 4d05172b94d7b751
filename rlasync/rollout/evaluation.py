"""Evaluation on held-out prompts with a rollout loop's own policy: the same rollout and reward path as training.

    rows ──► GroupState per row (num_generations_eval rollouts) ──► policy.run_task (generate_one, tools,
         environments) ──► policy.reward_group (reward functions here, or the RewardActor pool) ──► EvalTally

Nothing reaches the queue or the training metrics: the completions are scored (zero-spread groups are kept: an
evaluation measures, it does not train) and reduced to the `eval/` metrics of docs/algorithms.md §8.4. The
requests go through the loop's engine pool, next to the training rollouts; at most `max_concurrent` rollouts of an
evaluation are in flight at once. A tally is mergeable (`merge`), so several rollout actors can share the rows of
one evaluation. No torch, no ray.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlasync.data.prompts import row_prompt
from rlasync.records import PromptLease
from rlasync.rollout.groups import GroupState

logger = logging.getLogger(__name__)
EVAL_PREFIX = "eval/"
EVAL_GROUP_ID_BASE = -1_000_000_000
"""Group ids of evaluation groups are negative (never a lease's): `EVAL_GROUP_ID_BASE - row_index`."""


@dataclass
class EvalTally:
    """What one evaluation measured, as sums that merge across actors: the summed reward of every scored rollout,
    each reward column's scored values, completion lengths (tokens), prompts and the wall time of generation and
    scoring (the slowest part when merged: the actors run concurrently)."""

    rewards: list[float] = field(default_factory=list)
    columns: dict[str, list[float]] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)
    num_prompts: int = 0
    failed_prompts: int = 0
    generation_s: float = 0.0
    policy_version: int = -1

    def merge(self, other: EvalTally) -> EvalTally:
        columns = {name: list(values) for name, values in self.columns.items()}
        for name, values in other.columns.items():
            columns.setdefault(name, []).extend(values)
        return EvalTally(
            rewards=[*self.rewards, *other.rewards],
            columns=columns,
            lengths=[*self.lengths, *other.lengths],
            num_prompts=self.num_prompts + other.num_prompts,
            failed_prompts=self.failed_prompts + other.failed_prompts,
            generation_s=max(self.generation_s, other.generation_s),
            policy_version=max(self.policy_version, other.policy_version),
        )

    def metrics(self) -> dict[str, float]:
        """The `eval/` metrics: `eval/reward` (mean weighted summed reward of the scored rollouts), `eval/reward_std`,
        `eval/rewards/<name>/mean` per reward column, `eval/completions/mean_length` (tokens), `eval/num_prompts`,
        `eval/num_completions`, `eval/failed_prompts` (only when some failed), `eval/generation_s` and `eval/policy_version` (the policy the engines served when
        the evaluation started)."""
        out: dict[str, float] = {}
        if self.rewards:
            mean = sum(self.rewards) / len(self.rewards)
            out["reward"] = mean
            out["reward_std"] = math.sqrt(sum((r - mean) ** 2 for r in self.rewards) / len(self.rewards))
        for name, values in self.columns.items():
            if values:
                out[f"rewards/{name}/mean"] = sum(values) / len(values)
        if self.lengths:
            out["completions/mean_length"] = sum(self.lengths) / len(self.lengths)
        out["num_prompts"] = float(self.num_prompts)
        if self.failed_prompts:
            out["failed_prompts"] = float(self.failed_prompts)
        out["num_completions"] = float(len(self.lengths))
        out["generation_s"] = self.generation_s
        out["policy_version"] = float(self.policy_version)
        return {EVAL_PREFIX + key: value for key, value in out.items()}


def trainer_metric_names(metrics: Mapping[str, float]) -> dict[str, float]:
    """transformers' names of evaluation metrics (`Trainer.evaluate()`'s return value, `on_evaluate`'s `metrics`):
    `eval/reward` -> `eval_reward`, `eval/rewards/acc/mean` -> `eval_rewards/acc/mean` (TRL's GRPOTrainer's keys)."""
    return {
        ("eval_" + key[len(EVAL_PREFIX) :] if key.startswith(EVAL_PREFIX) else key): v for key, v in metrics.items()
    }


def _finite(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


async def evaluate_rows(
    policy: Any,
    rows: Iterable[tuple[int, Mapping[str, Any]]],
    *,
    num_generations: int,
    policy_version: int,
    max_concurrent: int | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> EvalTally:
    """Generate `num_generations` completions for each `(row_index, row)` with `policy` (a GRPO `RolloutPolicy`:
    its `run_task` and `reward_group`) and score them; at most `max_concurrent` rollouts (default: the policy's
    `settings.max_concurrent`) in flight. A row whose rollouts or scoring fail as the policy's group failures do
    (a rejected request, a reward past its timeout) is counted in `failed_prompts` and left out, as training drops
    such a group; a row whose prompt is malformed raises `ValueError` naming it, other errors propagate."""
    if num_generations < 1:
        raise ValueError(f"num_generations_eval={num_generations}: use at least 1 completion per eval prompt")
    rows = list(rows)
    limit = max_concurrent if max_concurrent is not None else getattr(policy.settings, "max_concurrent", 8)
    slots = asyncio.Semaphore(max(1, int(limit)))
    started = clock()

    async def rollout(group: GroupState, index: int) -> None:
        async with slots:
            outcome = await policy.run_task(group, index, policy_version)
        group.add(index, outcome, policy.build_sequences(outcome.rollout))

    async def one_row(row_index: int, row: Mapping[str, Any]) -> Any:
        lease = PromptLease(EVAL_GROUP_ID_BASE - row_index, row_index, row)
        group = GroupState.for_lease(lease, row_prompt(row, row_index), num_generations)
        try:
            await asyncio.gather(*(rollout(group, index) for index in range(num_generations)))
            rollout_group = group.rollout_group(policy_version, policy.provides_rollout_rewards, clock())
            scored = await policy.reward_group(rollout_group, drop_zero_std_groups=False)
        except Exception as error:
            if not policy.is_group_failure(error):
                raise
            logger.warning("evaluation: eval_dataset row %d failed (%s: %s)", row_index, type(error).__name__, error)
            return None
        return rollout_group, scored

    results = await asyncio.gather(*(one_row(index, row) for index, row in rows))
    tally = EvalTally(num_prompts=len(rows), policy_version=policy_version)
    tally.failed_prompts = sum(result is None for result in results)
    for rollout_group, scored in filter(None, results):
        tally.rewards += [float(r) for r in scored.rewards if _finite(float(r))]
        for name, values in zip(scored.reward_table.names, scored.reward_table.values, strict=True):
            tally.columns.setdefault(name, []).extend(float(v) for v in values if _finite(v))
        tally.lengths += [len(ids) for ids in rollout_group.completions_ids]
    tally.generation_s = clock() - started
    return tally


def split_rows(num_rows: int, parts: int) -> list[list[int]]:
    """Row indices `0..num_rows-1` dealt round-robin into `parts` lists (empty ones dropped)."""
    return [chunk for chunk in ([i for i in range(num_rows) if i % parts == p] for p in range(max(1, parts))) if chunk]


def indexed_rows(dataset: Sequence[Mapping[str, Any]], indices: Sequence[int]) -> list[tuple[int, Mapping[str, Any]]]:
    return [(index, dataset[index]) for index in indices]


__all__ = ["EVAL_PREFIX", "EvalTally", "evaluate_rows", "indexed_rows", "split_rows", "trainer_metric_names"]
