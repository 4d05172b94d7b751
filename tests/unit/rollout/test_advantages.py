"""Group advantages (docs/algorithms.md §2.6.2) against a slow reference, and the degenerate-group rule (§2.6.3)."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlasync.advantages import group_advantages, group_reward_std, is_degenerate_group

rewards_with_nans = st.lists(
    st.one_of(st.none(), st.floats(min_value=-100, max_value=100, allow_nan=False)), min_size=0, max_size=16
).map(lambda values: np.array([math.nan if v is None else v for v in values], dtype=np.float64))


def reference_advantages(rewards):
    """Loop-by-loop reading of the formula: scored rewards only, population std, eps 1e-8, 0 elsewhere."""
    scored = [r for r in rewards if not math.isnan(r)]
    if not scored:
        return [0.0] * len(rewards), math.nan
    mean = math.fsum(scored) / len(scored)
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in scored) / len(scored))
    return [0.0 if math.isnan(r) else (r - mean) / (std + 1e-8) for r in rewards], std


@given(rewards_with_nans)
def test_advantages_match_reference(rewards):
    advantages, std = group_advantages(rewards)
    expected, expected_std = reference_advantages(rewards.tolist())
    np.testing.assert_allclose(advantages, expected, rtol=1e-9, atol=1e-5)
    assert advantages.dtype == np.float64 and advantages.shape == rewards.shape
    assert (math.isnan(std) and math.isnan(expected_std)) or std == pytest.approx(expected_std, rel=1e-9, abs=1e-12)
    assert group_reward_std(rewards) == std or (math.isnan(std) and math.isnan(group_reward_std(rewards)))


@given(rewards_with_nans)
def test_unscorable_rollouts_get_zero_and_scored_advantages_are_centred(rewards):
    advantages, std = group_advantages(rewards)
    assert np.all(advantages[np.isnan(rewards)] == 0.0)
    scored = rewards[~np.isnan(rewards)]
    if scored.size:
        # centring is exact up to rounding of the mean (a few ulps of the largest reward), which the division by
        # (std + 1e-8) amplifies when the rewards are (nearly) equal
        rounding = 4 * scored.size * np.finfo(np.float64).eps * max(1.0, np.abs(scored).max()) / (std + 1e-8)
        assert abs(advantages[~np.isnan(rewards)].sum()) <= rounding + 1e-12


def test_worked_example_and_edge_cases():
    advantages, std = group_advantages(np.array([1.0, 3.0]))
    np.testing.assert_allclose(advantages, [-1.0, 1.0])
    assert std == 1.0
    advantages, std = group_advantages(np.array([math.nan, 2.0]))
    assert advantages.tolist() == [0.0, 0.0] and std == 0.0
    advantages, std = group_advantages(np.array([math.nan, math.nan]))
    assert advantages.tolist() == [0.0, 0.0] and math.isnan(std)
    advantages, std = group_advantages(np.array([]))
    assert advantages.shape == (0,) and math.isnan(std)


def test_input_is_not_modified():
    rewards = np.array([1.0, math.nan, 3.0])
    group_advantages(rewards)
    assert rewards[0] == 1.0 and math.isnan(rewards[1])


@pytest.mark.parametrize(
    ("rewards", "degenerate"),
    [
        ([1.0, 1.0, 1.0], True),  # zero std
        ([0.1, 0.1, 0.1], True),  # equal, although np.std gives 1.4e-17 here
        ([0.0, 1.0], False),
        ([math.nan, 1.0, 1.0], True),  # equal among the scored
        ([math.nan, 0.0, 1.0], False),
        ([math.nan, 5.0], True),  # a single scorable rollout
        ([math.nan, math.nan], True),  # nothing scorable
        ([2.0], True),
        ([], True),
    ],
)
def test_degenerate_group_rule(rewards, degenerate):
    assert is_degenerate_group(np.array(rewards, dtype=np.float64)) is degenerate


def test_equal_rewards_give_zero_advantages():
    advantages, _ = group_advantages(np.full(8, 0.1))
    assert np.all(np.abs(advantages) < 1e-6)
