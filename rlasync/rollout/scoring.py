"""Scoring a complete group: rewards, advantages, the zero-std drop, and the samples the learner trains on.

    RolloutGroup ──call_reward_funcs──► RewardTable (one column per source) ──totals──► group.rewards [G]
                                        (weighted: `reward_weights` for the functions' columns, 1 for the others)
        ──compute_advantages(group)──► advantages [G]
        ──degenerate group? (docs/algorithms.md §2.6.3)──► dropped: no samples
                               otherwise ──► one RolloutSample per TrainingSequence, the conversation's
                                             advantage stamped unchanged on each of its rows

Reward columns, in order: the reward functions (called here, or their `function_columns` scored elsewhere, e.g.
by a RewardActor), one column per environment class found in `env_rewards` (named after the class),
`rollout_reward` for `Rollout.reward` values (`group.rollout_rewards`), then the caller's `extra_columns` (e.g.
`harness_reward`). Duplicate names get `_2`, `_3`, ... A rollout's reward is the weighted sum of its columns with NaN
ignored (`RewardTable.totals`): the reward functions' columns weigh `reward_weights` (TRL's field, one weight per
function; None: 1 each), every other column 1 (as TRL weighs an environment's `get_reward` column). The `rollout_reward`
column exists only when some rollout set a reward; a non-empty `rollout_rewards` list still counts as a reward
source, so a group where every `Rollout.reward` is None is unscorable rather than an error.

Metric names are those of docs/algorithms.md §8.3, with no 1.16 aliases:

* per sample (`RolloutSample.metrics`, one dict per row, averaged over trained samples by the collator):
  `reward_trained` (the conversation's weighted summed reward, NaN if unscorable; 1.16 called it `reward`),
  `reward_group_std` (the advantage divisor; 1.16 `reward_std`), `rewards/<name>/group_std` per column. (The tool
  metrics are the rollout loop's, over every rollout: `rlasync.rollout.rollout_metrics.group_metrics`.)
* per group (`ScoredGroup.metrics`, recorded by the worker for every group, dropped ones included):
  `(key, value)` items, one per value, ready for `MetricSink.update`; every key is reduced by mean:
  `reward` (one item per scored weighted sum), `rewards/<name>/mean` (one per scored value of the column, unweighted),
  `frac_zero_std_groups` (1.0 if the group is degenerate, else 0.0) and, for a degenerate group with some
  scored reward, `reward_zero_std_groups` (its mean reward); then the items the reward functions reported
  (`RewardTable.metrics`, e.g. a reward model's `rewards/<name>/batch_size`), reduced by their keys' rules.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rlasync.advantages import group_advantages, group_reward_std, is_degenerate_group
from rlasync.records import RolloutGroup, RolloutSample
from rlasync.rewards.calling import (
    RewardColumns,
    RewardFunc,
    RewardTable,
    call_reward_funcs,
    hook_name,
    reward_column_items,
)

ROLLOUT_REWARD_COLUMN = "rollout_reward"

ComputeAdvantages = Callable[[RolloutGroup], np.ndarray]
"""`compute_advantages(group) -> [G]` advantages; `group.rewards` (the weighted sums) and `group.reward_table` (the
per-source columns behind them) are set when it is called."""


@dataclass(frozen=True, slots=True)
class ScoredGroup:
    """The outcome of scoring one group.

    samples:      what to enqueue (empty when dropped)
    dropped:      the group was degenerate and dropping is on
    rewards:      [G] summed reward per rollout, NaN where unscorable
    advantages:   [G] one advantage per rollout (computed for dropped groups too)
    reward_table: the per-source rewards behind `rewards`
    metrics:      worker-side metric items `(key, value)` of this group (see the module docstring)
    """

    samples: list[RolloutSample]
    dropped: bool
    rewards: np.ndarray
    advantages: np.ndarray
    reward_table: RewardTable
    metrics: list[tuple[str, float]]

    @property
    def drop_cause(self) -> str | None:
        """Why a dropped group carried no signal: "no_reward" (every reward None/NaN: TRL's "not applicable"),
        "one_scored" (a single scored rollout) or "constant" (every scored reward equal); None when kept."""
        if not self.dropped:
            return None
        scored = self.rewards[~np.isnan(self.rewards)]
        return "no_reward" if scored.size == 0 else "one_scored" if scored.size == 1 else "constant"

    def drop_detail(self) -> str:
        """One line for the watchdog: the reward sources and the value every rollout got."""
        names = ", ".join(self.reward_table.names) or "no reward column"
        scored = self.rewards[~np.isnan(self.rewards)]
        if scored.size == 0:
            return f"every reward None ({names})"
        return f"{scored.size} of {self.rewards.size} rollouts scored, every reward {float(scored[0]):g} ({names})"


def default_compute_advantages(group: RolloutGroup, scale_rewards: str = "group") -> np.ndarray:
    """GRPO's group-normalised advantage of `group.rewards` (docs/algorithms.md §2.6.2); `scale_rewards="none"`
    (TRL's field): centred only, not divided by the group std."""
    return group_advantages(group.rewards, scale=scale_rewards != "none")[0]


async def score_group(
    group: RolloutGroup,
    reward_funcs: Sequence[RewardFunc],
    *,
    compute_advantages: ComputeAdvantages | None = None,
    extra_columns: RewardColumns | None = None,
    function_columns: RewardColumns | None = None,
    reward_weights: Sequence[float] | None = None,
    drop_zero_std_groups: bool = True,
    reward_timeout_s: float | None = None,
) -> ScoredGroup:
    """Score `group`, set `group.rewards`, and build its samples unless the group is dropped.

    `function_columns`: the reward functions' columns already scored elsewhere (a RewardActor's table), in place
    of calling `reward_funcs` (give one or the other). `reward_weights`: one weight per reward function (column);
    None: 1 each. `drop_zero_std_groups=False` keeps degenerate groups (TRL 1.16: they train with zero
    advantages). Raises `ValueError` when the group is malformed, has no reward source or `reward_weights` does
    not fit, `RewardFunctionError` when a reward function breaks the calling convention (`RewardTimeoutError`:
    not back within `reward_timeout_s`).
    """
    _check_group(group)
    scored_elsewhere = reward_column_items(function_columns)
    if scored_elsewhere and reward_funcs:
        raise ValueError("score_group: give reward_funcs or function_columns (scored elsewhere), not both")
    num_functions = len(scored_elsewhere) if scored_elsewhere else len(reward_funcs)
    weights = reward_weight_vector(reward_weights, num_functions)
    columns = scored_elsewhere + _group_reward_columns(group, extra_columns)
    if not reward_funcs and not columns and not group.rollout_rewards:
        raise ValueError(
            "No reward source provided: pass reward functions, use an environment that defines `get_reward`, "
            "or a rollout loop that sets `Rollout.reward`."
        )
    table = await call_reward_funcs(
        reward_funcs,
        prompts=group.prompts,
        completions=group.completions,
        completion_ids=group.completions_ids,
        reward_kwargs=group.reward_kwargs,
        extra_columns=columns,
        timeout_s=reward_timeout_s,
    )
    if weights is not None:  # the functions' columns come first, every other column weighs 1
        table = table.with_weights(np.concatenate([weights, np.ones(len(table.names) - num_functions)]))
    group.rewards = table.totals()
    group.reward_table = table
    advantages = _run_compute_advantages(compute_advantages or default_compute_advantages, group)
    degenerate = is_degenerate_group(group.rewards)
    dropped = degenerate and drop_zero_std_groups
    samples = [] if dropped else _build_samples(group, advantages, _sample_metrics(group, table))
    return ScoredGroup(
        samples=samples,
        dropped=dropped,
        rewards=group.rewards,
        advantages=advantages,
        reward_table=table,
        metrics=_group_metrics(table, group.rewards, degenerate),
    )


def reward_weight_vector(reward_weights: Sequence[float] | None, num_functions: int) -> np.ndarray | None:
    """`reward_weights` as a float64 array of one weight per reward function; None when not given.

    Raises `ValueError` naming `reward_weights` when the count differs from the reward functions' or a weight is
    not a finite number (TRL's rule: one weight per reward function, environments' columns weigh 1)."""
    if reward_weights is None:
        return None
    weights = list(reward_weights)
    if len(weights) != num_functions:
        raise ValueError(
            f"reward_weights has {len(weights)} weight(s) {weights} for {num_functions} reward function(s): give one "
            "weight per entry of reward_funcs, in the same order (an environment's get_reward column weighs 1), or "
            "leave reward_weights=None (every function 1.0)"
        )
    bad = [w for w in weights if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w)]
    if bad:
        raise ValueError(f"reward_weights={weights}: every weight must be a finite number (got {bad[0]!r})")
    return np.asarray(weights, dtype=np.float64)


def _check_group(group: RolloutGroup) -> None:
    """Every per-rollout list has one entry per rollout (the optional ones may be empty instead)."""
    num_rollouts = len(group)
    if num_rollouts == 0:
        raise ValueError(f"group {group.group_id} has no rollouts")
    required = {
        "prompts": group.prompts,
        "completions_ids": group.completions_ids,
        "completions_sequences": group.completions_sequences,
    }
    optional = {
        "tool_call_counts": group.tool_call_counts,
        "tool_failure_counts": group.tool_failure_counts,
        "env_rewards": group.env_rewards,
        "rollout_rewards": group.rollout_rewards,
    }
    dataset_columns = {f"reward_kwargs[{name!r}]": values for name, values in group.reward_kwargs.items()}
    checked = {**required, **{name: values for name, values in optional.items() if values}, **dataset_columns}
    for name, values in checked.items():
        if len(values) != num_rollouts:
            raise ValueError(
                f"group {group.group_id}: {name} has {len(values)} entries for {num_rollouts} completions; "
                "every per-rollout field needs one entry per completion"
            )


def _group_reward_columns(
    group: RolloutGroup, extra_columns: RewardColumns | None
) -> list[tuple[str, Sequence[float | None]]]:
    """Reward columns beyond the functions': environment classes, `Rollout.reward`, then `extra_columns`."""
    num_rollouts = len(group)
    env_columns: dict[str, list[float | None]] = {}
    for index, entry in enumerate(group.env_rewards):
        if entry is not None:
            env_name, value = entry
            env_columns.setdefault(env_name, [None] * num_rollouts)[index] = value
    columns = list(env_columns.items())
    if any(value is not None for value in group.rollout_rewards):
        columns.append((ROLLOUT_REWARD_COLUMN, list(group.rollout_rewards)))
    return columns + reward_column_items(extra_columns)


def _run_compute_advantages(compute_advantages: ComputeAdvantages, group: RolloutGroup) -> np.ndarray:
    where = f"compute_advantages ({hook_name(compute_advantages)})"
    advantages = np.asarray(compute_advantages(group), dtype=np.float64)
    if advantages.shape != (len(group),):
        raise ValueError(
            f"{where} must return one advantage per rollout, shape ({len(group)},); got shape {advantages.shape}"
        )
    if not np.isfinite(advantages).all():
        raise ValueError(
            f"{where} returned non-finite advantages {advantages.tolist()}; "
            "give unscorable rollouts (NaN reward) advantage 0"
        )
    return advantages


def _sample_metrics(group: RolloutGroup, table: RewardTable) -> list[dict[str, float]]:
    """Per-rollout metric dicts (shared by the rollout's rows; each row gets its own copy)."""
    shared = {"reward_group_std": group_reward_std(group.rewards)}
    shared.update({f"rewards/{name}/group_std": group_reward_std(table.column(name)) for name in table.names})
    return [{"reward_trained": float(reward), **shared} for reward in group.rewards]


def _build_samples(group: RolloutGroup, advantages: np.ndarray, metrics: list[dict[str, float]]) -> list[RolloutSample]:
    """One sample per training sequence; every row of a conversation gets the conversation's advantage."""
    return [
        RolloutSample(
            input_ids=sequence.input_ids,
            completion_mask=sequence.completion_mask,
            sampler_logprobs=sequence.sampler_logprobs,
            advantage=float(advantages[index]),
            group_id=group.group_id,
            policy_version=group.policy_version,
            row_index=group.row_index,
            sampler_topk_ids=sequence.sampler_topk_ids,
            sampler_topk_logprobs=sequence.sampler_topk_logprobs,
            sampling_mask=sequence.sampling_mask,
            metrics=dict(metrics[index]),
            prompt=group.prompts[index],
            completion=group.completions[index],
            rollout_id=sequence.rollout_id,
        )
        for index, sequences in enumerate(group.completions_sequences)
        for sequence in sequences
    ]


def _group_metrics(table: RewardTable, rewards: np.ndarray, degenerate: bool) -> list[tuple[str, float]]:
    """Worker-side metric items of one group (dropped or not)."""
    scored = rewards[~np.isnan(rewards)]
    items = [("frac_zero_std_groups", float(degenerate))]
    if degenerate and scored.size:
        items.append(("reward_zero_std_groups", float(scored.mean())))
    items += [("reward", value) for value in scored.tolist()]
    for name, column in zip(table.names, table.values, strict=True):
        items += [(f"rewards/{name}/mean", value) for value in column[~np.isnan(column)].tolist()]
    return items + list(table.metrics)
