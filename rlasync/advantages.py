"""Group-relative advantages (GRPO) and the degenerate-group rule, on numpy arrays only.

A group is the `G` rollouts of one prompt. `rewards[i]` is rollout `i`'s (weighted) summed reward, NaN when no reward
source scored it (unscorable). With `M` the scorable rollouts (docs/algorithms.md §2.6.2):

    m = mean(R[M]),  s = std(R[M])            population std (ddof = 0)
    A_i = (R_i - m) / (s + 1e-8)   for i in M     (scale=True: TRL's scale_rewards="group", the default)
    A_i = R_i - m                  for i in M     (scale=False: scale_rewards="none", Dr. GRPO)
    A_i = 0                        for i not in M

TRL's scale_rewards="batch" (the std of the whole generation batch) has no counterpart: groups are scored one at
a time as they finish, there is no batch at scoring time (the config refuses it). A group is degenerate
(docs/algorithms.md §2.6.3) when fewer than two rollouts are scorable or every scored reward is equal; the rollout loop drops
such groups, because their advantages are zero everywhere and they would cost a forward/backward for nothing.
"""

from __future__ import annotations

import numpy as np

STD_EPSILON = 1e-8
"""Added to the group std before dividing, so an all-equal group gives zero advantages instead of 0/0."""


def _scored(rewards: np.ndarray) -> np.ndarray:
    """The rewards that are not NaN (the scorable rollouts)."""
    return rewards[~np.isnan(rewards)]


def group_reward_std(rewards: np.ndarray) -> float:
    """Population std of the scored rewards of a group: the advantage divisor; NaN if none is scored."""
    scored = _scored(np.asarray(rewards, dtype=np.float64))
    return float(scored.std()) if scored.size else float("nan")


def group_advantages(rewards: np.ndarray, scale: bool = True) -> tuple[np.ndarray, float]:
    """Advantages `[G]` (float64) of one group and the group std (the divisor when `scale`; NaN if nothing is
    scored).

    NaN rewards are left out of the mean and std and get advantage 0. `scale=False` only centres the rewards.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    is_scored = ~np.isnan(rewards)
    advantages = np.zeros_like(rewards)
    if not is_scored.any():
        return advantages, float("nan")
    scored = rewards[is_scored]
    std = float(scored.std())
    centred = scored - scored.mean()
    advantages[is_scored] = centred / (std + STD_EPSILON) if scale else centred
    return advantages, std


def is_degenerate_group(rewards: np.ndarray) -> bool:
    """True when a group carries no learning signal: fewer than two scored rewards, or all of them equal.

    "Zero std" is tested as exact equality of the scored rewards: the floating-point std of equal values can
    come out a hair above zero, and such a group still has all-zero advantages in exact arithmetic.
    """
    scored = _scored(np.asarray(rewards, dtype=np.float64))
    return scored.size < 2 or bool(np.all(scored == scored[0]))
