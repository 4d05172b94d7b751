"""A GRPO group on its way from lease to sink: the rollouts collected so far (`GroupState`) and what the sink
receives (`GroupResult`). No torch, no ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rlasync.data.prompts import PROMPT_COLUMN
from rlasync.records import PromptLease, Rollout, RolloutGroup, TrainingSequence
from rlasync.rollout.scoring import ScoredGroup

NOT_REWARD_KWARGS = frozenset({PROMPT_COLUMN, "completion", "completion_ids"})
"""Dataset columns not passed to the reward functions (every other column is, repeated G times)."""


@dataclass(frozen=True, slots=True)
class GroupResult:
    """A scored group, as handed to the sink (dropped groups too: the sink accounts for them)."""

    lease: PromptLease
    policy_version: int
    scored: ScoredGroup
    num_rollout_tokens: int = 0
    """Raw tokens of every training sequence of the group's rollouts, dropped or not (the per-rollout token
    estimate of the allowance needs them even for a dropped group)."""

    @property
    def group_id(self) -> int:
        return self.lease.group_id

    @property
    def row_index(self) -> int:
        return self.lease.row_index

    @property
    def epoch(self) -> int:
        return self.lease.epoch

    @property
    def dropped(self) -> bool:
        return self.scored.dropped

    @property
    def num_tokens(self) -> int:
        """Raw tokens of the samples to train on (0 for a dropped group)."""
        return sum(len(sample) for sample in self.scored.samples)


class RolloutOutcome(NamedTuple):
    """What a rollout task returns: the rollout, its duration, its environment reward (`(class name, value)`)
    and the prompt it was generated from when an environment's reset extended the group's prompt."""

    rollout: Rollout
    duration_s: float
    env_reward: tuple[str, float | None] | None = None
    prompt: list[dict[str, Any]] | None = None


@dataclass(eq=False)
class GroupState:
    """The rollouts of one leased prompt, filled in as its tasks finish."""

    lease: PromptLease
    prompt: list[dict[str, Any]]
    rollouts: list[Rollout | None]
    sequences: list[list[TrainingSequence] | None]
    rollout_prompts: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Per rollout index, the prompt it was generated from when an environment's reset extended it."""
    env_rewards: dict[int, tuple[str, float | None]] = field(default_factory=dict)
    """Per rollout index, `(environment class name, get_reward())` for environments that own a reward."""
    scored: Any = None
    """Set by the policy's `collect` for its `handed_over`."""
    done_at: float | None = None
    """When its latest rollout finished (the policy's clock): `rollout/score_wait_s` runs from there."""

    @classmethod
    def for_lease(cls, lease: PromptLease, prompt: list[dict[str, Any]], size: int) -> GroupState:
        return cls(lease, prompt, [None] * size, [None] * size)

    @property
    def size(self) -> int:
        return len(self.rollouts)

    def add(self, index: int, outcome: RolloutOutcome, sequences: list[TrainingSequence]) -> None:
        """Rollout `index` finished with its training sequences."""
        if outcome.prompt is not None:
            self.rollout_prompts[index] = outcome.prompt
        if outcome.env_reward is not None:
            self.env_rewards[index] = outcome.env_reward
        self.rollouts[index] = outcome.rollout
        self.sequences[index] = sequences

    def rollout_group(self, policy_version: int, provides_rollout_rewards: bool, now: float) -> RolloutGroup:
        """The group as the scorer takes it (TRL's RolloutGroup): the row's other columns as reward kwargs."""
        rollouts = [rollout for rollout in self.rollouts if rollout is not None]
        size = len(rollouts)
        rewards = [rollout.reward for rollout in rollouts]
        reward_kwargs = {
            name: [value] * size for name, value in self.lease.row.items() if name not in NOT_REWARD_KWARGS
        }
        return RolloutGroup(
            prompts=[self.rollout_prompts.get(index, self.prompt) for index in range(size)],
            completions=[rollout.completion for rollout in rollouts],
            completions_ids=[list(rollout.completion_ids) for rollout in rollouts],
            completions_sequences=[list(sequences or []) for sequences in self.sequences],
            group_id=self.lease.group_id,
            policy_version=policy_version,
            row_index=self.lease.row_index,
            tool_call_counts=[rollout.tool_call_count for rollout in rollouts],
            tool_failure_counts=[rollout.tool_failure_count for rollout in rollouts],
            env_rewards=[self.env_rewards.get(index) for index in range(size)] if self.env_rewards else [],
            rollout_rewards=rewards if provides_rollout_rewards or any(r is not None for r in rewards) else [],
            reward_kwargs=reward_kwargs,
            queued_at=now,
        )


__all__ = ["NOT_REWARD_KWARGS", "GroupResult", "GroupState", "RolloutOutcome"]
