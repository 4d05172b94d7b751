"""Group-relative advantages (GRPO) and the degenerate-group rule, on numpy arrays only.

A group is the `G` rollouts of one prompt. `rewards[i]` is rollout `i`'s (weighted) summed reward, NaN when no reward
source scored it (unscorable). With `M` the scorable rollouts (docs/algorithms.md §2.6.2):

    m = mean(R[M]),  s = std(R[M])            population std (ddof = 0)
    A_i = (R_i - m) / (s + 1e-8)   for i in M     (scale=True: TRL's scale_rewards="group", the default)
    A_i = R_i - m                  for i in M     (scale=False: scale_rewards="none", Dr. GRPO)
    A_i = 0                        for i not in M

TRL's scale_rewards="batch" (the std of the whole generation batch) has no counterpart: groups are scored one at
a time as they finish, there is no batch at scoring time (the config refuses it). For the same reason
multi_objective_aggregation="normalize_then_sum" (GDPO) is refused; its group part, each reward column normalised
in its group before the weighted sum, is `decoupled_group_advantages`, for a `compute_advantages` hook:

    z_k,i = (r_k,i - mean_k) / (std_k + 1e-4)     per column k over its scored rollouts (TRL's GDPO epsilon)
    S_i   = nansum_k w_k z_k,i                    NaN where no column scored rollout i
    A     = group_advantages(S)                   (TRL standardises S over the generation batch instead)

A group is degenerate (docs/algorithms.md §2.6.3) when fewer than two rollouts are scorable or every scored reward is equal; the rollout loop drops
such groups, because their advantages are zero everywhere and they would cost a forward/backward for nothing.
"""

from __future__ import annotations

import numpy as np

STD_EPSILON = 1e-8
"""Added to the group std before dividing, so an all-equal group gives zero advantages instead of 0/0."""

DECOUPLED_STD_EPSILON = 1e-4
"""TRL's epsilon of GDPO's per-column normalisation (`normalize_then_sum`)."""


def _scored(rewards: np.ndarray) -> np.ndarray:
    """The rewards that are not NaN (the scorable rollouts)."""
    return rewards[~np.isnan(rewards)]


def group_reward_std(rewards: np.ndarray) -> float:
    """Population std of the scored rewards of a group: the advantage divisor; NaN if none is scored."""
    scored = _scored(np.asarray(rewards, dtype=np.float64))
    return float(scored.std()) if scored.size else float("nan")


def group_advantages(rewards: np.ndarray, scale: bool = True, epsilon: float = STD_EPSILON) -> tuple[np.ndarray, float]:
    """Advantages `[G]` (float64) of one group and the group std (the divisor when `scale`, plus `epsilon`; NaN if
    nothing is scored).

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
    advantages[is_scored] = centred / (std + epsilon) if scale else centred
    return advantages, std


def is_degenerate_group(rewards: np.ndarray) -> bool:
    """True when a group carries no learning signal: fewer than two scored rewards, or all of them equal.

    "Zero std" is tested as exact equality of the scored rewards: the floating-point std of equal values can
    come out a hair above zero, and such a group still has all-zero advantages in exact arithmetic.
    """
    scored = _scored(np.asarray(rewards, dtype=np.float64))
    return scored.size < 2 or bool(np.all(scored == scored[0]))


def decoupled_group_advantages(values: np.ndarray, weights: np.ndarray | None = None, scale: bool = True) -> np.ndarray:
    """GDPO's decoupled normalisation within one group (see the module docstring): `values` [C, G] per-column
    rewards (NaN where a column did not score a rollout), `weights` [C] (None: 1 each); returns the advantages [G].

    Each column is centred and divided by its own group std before the weighted sum, so a reward with a large
    range or spread does not drown the others; the sum then gets GRPO's group normalisation (`scale=False`: only
    centred). A column that scored fewer than two rollouts, or gave them all the same value, contributes 0 to the
    rollouts it scored. Use it from a loop's hook with the table scoring leaves on the group:

        def compute_advantages(self, group):
            table = group.reward_table
            return decoupled_group_advantages(table.values, table.weights)
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2:
        raise ValueError(f"values must be [columns, rollouts], got shape {values.shape}")
    num_columns = values.shape[0]
    weights = np.ones(num_columns) if weights is None else np.asarray(weights, dtype=np.float64)
    if weights.shape != (num_columns,):
        raise ValueError(f"weights must hold one weight per column ({num_columns}), got shape {weights.shape}")
    # each column's own group normalisation (a rollout the column did not score gets 0: nothing in the sum)
    normalised = np.stack([group_advantages(column, epsilon=DECOUPLED_STD_EPSILON)[0] for column in values])
    unscored = np.isnan(values).all(axis=0)
    summed = (normalised * weights[:, None]).sum(axis=0)
    summed[unscored] = np.nan
    return group_advantages(summed, scale=scale)[0]
