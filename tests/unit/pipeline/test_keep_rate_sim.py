"""The keep rate in a discrete-event run of the real queue (`bench/keep_rate_sim.py`: QueueService on a simulated
clock, a generator of fixed rate and concurrency, a learner of fixed step time; milliseconds, deterministic).

Four groups in five dropped for zero spread: counting in-flight rollouts at full starves the learner (~60% of the
step waiting); with the learned keep rate it waits under 25% of the step over the whole run, the trained staleness
never exceeds `max_staleness`, and what reaches the queue ahead of a group stays below the allowance, not the
allowance / keep rate."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from keep_rate_sim import SimSettings, simulate  # noqa: E402

SEEDS = (0, 1, 2)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_learned_keep_rate_keeps_the_learner_fed_without_going_stale(seed):
    learned = simulate(SimSettings(keep_rate=0.2, max_staleness=2, steps=100, seed=seed))
    full = simulate(SimSettings(keep_rate=0.2, max_staleness=2, steps=100, seed=seed, learn_keep_rate=False))
    assert full.rollout_wait_frac > 0.5  # the flaw: the gate admits too little, the learner starves
    assert learned.rollout_wait_frac < 0.25
    assert learned.step_s_mean < 0.6 * full.step_s_mean
    for run in (learned, full):
        assert run.staleness_max <= 2
    assert learned.keep_rate_final == pytest.approx(0.2, abs=0.07)  # a 128-group window's noise
    # what reaches the queue ahead of a group stays ~the allowance (S steps), not the allowance / 0.2
    assert 0.4 < learned.ahead_tokens_mean_over_allowance < 1.0
    assert learned.ahead_over_allowance_frac < 0.06
    assert learned.queue_tokens_mean_over_allowance < 0.5 and learned.queue_tokens_max_over_allowance < 2.0
    assert learned.dropped_stale_frac < 0.05  # over-provisioning wastes little as stale
    assert full.ahead_tokens_mean_over_allowance < 0.3  # counting at full held the queue far below the allowance


def test_a_keep_rate_falling_over_the_run_and_a_wider_staleness():
    """The task being solved: the keep rate falls from 0.9 to 0.1 over the run; and S = 4."""
    falling = simulate(SimSettings(keep_rate_start=0.9, keep_rate=0.1, max_staleness=2, steps=150))
    falling_full = simulate(
        SimSettings(keep_rate_start=0.9, keep_rate=0.1, max_staleness=2, steps=150, learn_keep_rate=False)
    )
    assert falling.rollout_wait_frac < 0.25 < falling_full.rollout_wait_frac
    assert falling.staleness_max <= 2 and falling.dropped_stale_frac < 0.05
    wide = simulate(SimSettings(keep_rate=0.2, max_staleness=4, steps=100))
    wide_full = simulate(SimSettings(keep_rate=0.2, max_staleness=4, steps=100, learn_keep_rate=False))
    assert wide.rollout_wait_frac < 0.05 and wide_full.rollout_wait_frac > 0.15
    assert wide.staleness_max <= 4 and wide.dropped_stale_frac < 0.05


def test_nothing_changes_when_nothing_is_dropped():
    kept = simulate(SimSettings(keep_rate=1.0, max_staleness=2, steps=100))
    kept_full = simulate(SimSettings(keep_rate=1.0, max_staleness=2, steps=100, learn_keep_rate=False))
    assert kept == kept_full


@pytest.mark.parametrize("seed", SEEDS)
def test_the_marginal_group_does_not_go_stale_when_nothing_is_dropped(seed):
    """The gate counts the new group's own tokens: with every group kept (no keep-rate noise) the group admitted at
    the threshold no longer lands past `max_staleness` steps. Counting only what was ahead of it, ~3% of the queued
    samples were dropped as stale (generation wasted); the learner does not wait for it."""
    kept = simulate(SimSettings(keep_rate=1.0, max_staleness=2, steps=100, seed=seed))
    assert kept.dropped_stale_frac < 0.01
    assert kept.ahead_over_allowance_frac < 0.005
    assert kept.rollout_wait_frac < 0.01
