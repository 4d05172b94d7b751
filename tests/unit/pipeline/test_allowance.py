"""TokenAllowance: cold start, the allowance after a step, waits released by consumption, backpressure seconds."""

import asyncio

import pytest

from rlasync.pipeline import TokenAllowance, initial_tokens_per_step


class FakeClock:
    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


def test_initial_tokens_per_step_assumes_full_rows():
    assert initial_tokens_per_step(token_budget=2048, num_learners=2, gradient_accumulation_steps=4) == 16384
    with pytest.raises(ValueError, match="token_budget"):
        initial_tokens_per_step(0, 1, 1)


def test_initial_tokens_per_step_counts_a_shared_prompt_once():
    """A row of `token_budget` unique tokens holds 2G / (G + 1) times that in raw tokens when a group of G shares a
    prompt as long as a completion: 8 samples of prompt 10 + completion 10 are 90 unique tokens, 160 raw."""
    assert initial_tokens_per_step(90, 1, 1, group_size=8) == 160
    assert initial_tokens_per_step(256, 1, 2, group_size=4) == 819  # 512 unique tokens, 1.6x raw
    assert initial_tokens_per_step(256, 2, 2, group_size=1) == 1024  # nothing shared: raw = unique
    with pytest.raises(ValueError, match="group_size=0"):
        initial_tokens_per_step(256, 1, 1, group_size=0)


def test_cold_start_runs_one_group_at_a_time_until_the_first_completes():
    allowance = TokenAllowance(max_staleness=4, tokens_per_step=10_000)
    assert allowance.try_acquire(num_rollouts=4)
    assert not allowance.try_acquire(num_rollouts=4)
    allowance.cancel_group(4)  # a failed group does not end the cold start
    assert allowance.try_acquire(num_rollouts=4)
    assert not allowance.try_acquire(num_rollouts=4)
    allowance.finish_group(4, num_tokens=400)
    assert allowance.mean_tokens_per_rollout == 100
    assert allowance.try_acquire(4) and allowance.try_acquire(4)


def test_queued_plus_inflight_plus_the_new_group_must_fit_the_allowance():
    allowance = TokenAllowance(max_staleness=2, tokens_per_step=1000)  # allowance 2000
    assert allowance.allowance_tokens == 2000
    allowance.try_acquire(4)
    allowance.finish_group(4, num_tokens=400)  # 100 tokens per rollout; 400 queued
    assert allowance.expected_group_tokens(4) == 400
    assert allowance.try_acquire(4)  # 400 queued + 0 in flight + 400 of its own <= 2000
    assert allowance.try_acquire(4)  # 400 + 400 + 400
    assert allowance.try_acquire(4)  # 400 + 800 + 400
    assert allowance.inflight_tokens == 1200 and allowance.inflight_rollouts == 12 and allowance.inflight_groups == 3
    assert allowance.try_acquire(4)  # 400 + 1200 + 400 = 2000: it fits exactly
    assert not allowance.try_acquire(4)  # 400 + 1600 + 400 > 2000
    allowance.consumed(400)  # the learner took the queued group
    assert allowance.try_acquire(4)


def test_the_new_group_counts_its_own_expected_tokens():
    """The marginal group: 1900 tokens queued, allowance 2000, groups of 380. Counting only what is ahead of it (1900
    < 2000) admitted it, and its own samples then ended past `S` steps of tokens: stale when taken. Counting its own
    tokens, it waits for the learner; a smaller group that fits still starts."""
    allowance = TokenAllowance(max_staleness=2, tokens_per_step=1000)
    for _ in range(5):
        assert allowance.try_acquire(4)
        allowance.finish_group(4, num_tokens=380)  # 95 tokens per rollout
    assert allowance.queued_tokens == 1900 and allowance.expected_group_tokens(4) == 380
    assert not allowance.can_start(4) and not allowance.try_acquire(4)  # 1900 + 380 > 2000
    assert allowance.can_start(1)  # 1900 + 95 fits
    allowance.consumed(380)
    assert allowance.try_acquire(4)  # 1520 + 380 = 1900
    assert allowance.try_acquire(1)  # 1520 + 380 in flight + 95 = 1995
    assert not allowance.try_acquire(1)  # 1520 + 475 in flight + 95 > 2000


def test_a_group_larger_than_the_allowance_still_starts_on_an_empty_pipeline():
    """No deadlock: a group expected to queue more than the whole allowance waits for nothing queued and nothing in
    flight, then starts alone."""
    allowance = TokenAllowance(max_staleness=1, tokens_per_step=300)
    allowance.try_acquire(4)
    allowance.finish_group(4, num_tokens=400)  # one group is 400 > 300
    assert not allowance.can_start(4)  # 400 queued
    allowance.consumed(400)
    assert allowance.try_acquire(4)  # empty: it starts though 400 > 300
    assert not allowance.try_acquire(1)  # not a second one beside it


def test_max_staleness_zero_fills_the_version_even_when_the_last_group_overshoots():
    """S = 0 keeps its budget rule (taken + queued + in flight < budget, the new group not counted): the learner of
    a synchronous step waits for the whole budget, so a gate that refused the group that overshoots it would leave
    the version short and the learner waiting; the version's last step takes the overshoot (nothing goes stale)."""
    allowance = TokenAllowance(max_staleness=0, tokens_per_step=2000)
    assert allowance.try_acquire(4)
    allowance.finish_group(4, num_tokens=600)
    assert allowance.try_acquire(4) and allowance.try_acquire(4)  # 600 queued + 1200 in flight = 1800
    assert allowance.try_acquire(4)  # 1800 < 2000: admitted though it brings the version to 2400
    assert allowance.inflight_tokens == 1800 and not allowance.can_start(4)  # the budget is covered


def reference_mean(groups, window=128):
    """The slow obvious reference of the mean tokens per rollout: each completed group (rollouts, tokens) weighs
    (1 - 1/window) ** (groups completed after it), the mean is the weighted tokens over the weighted rollouts."""
    decay = 1 - 1 / window
    n = len(groups)
    tokens = sum(t * decay ** (n - 1 - i) for i, (_, t) in enumerate(groups))
    rollouts = sum(r * decay ** (n - 1 - i) for i, (r, _) in enumerate(groups))
    return tokens / rollouts


def test_the_inflight_estimate_follows_the_decayed_mean():
    allowance = TokenAllowance(max_staleness=1, tokens_per_step=10**6)
    allowance.try_acquire(2)
    allowance.finish_group(2, num_tokens=100)  # 50 per rollout
    allowance.try_acquire(2)
    allowance.try_acquire(2)
    assert allowance.mean_tokens_per_rollout == 50 and allowance.inflight_tokens == 200
    allowance.finish_group(2, num_tokens=500)  # 250 per rollout, the earlier group weighing 127/128
    want = reference_mean([(2, 100), (2, 500)])
    assert 149 < want < 151
    assert allowance.mean_tokens_per_rollout == pytest.approx(want, abs=1e-6)
    assert allowance.inflight_tokens == pytest.approx(2 * want, abs=1e-5)


@pytest.mark.parametrize("window", [1, 16, 128])
def test_the_mean_matches_the_reference_over_groups_of_any_size(window):
    import random

    rng = random.Random(window)
    allowance = TokenAllowance(max_staleness=1, tokens_per_step=10**9, keep_rate_window=window)
    groups = []
    for _ in range(300):
        rollouts = rng.randint(1, 16)
        tokens = rollouts * rng.randint(5, 400)
        allowance.try_acquire(rollouts)
        allowance.finish_group(rollouts, num_tokens=tokens, queued=rng.random() < 0.5)
        groups.append((rollouts, tokens))
        assert allowance.mean_tokens_per_rollout == pytest.approx(reference_mean(groups, window), abs=2e-6)


def test_the_mean_follows_completions_that_shrink():
    """Completion lengths fall from 31 to 11 tokens (a sums run being solved): ~400 groups later the decayed mean
    has followed, where a whole-run mean would still count each rollout in flight at ~16 tokens."""
    allowance = TokenAllowance(max_staleness=1, tokens_per_step=10**9)
    for tokens_per_rollout, groups in ((31, 200), (11, 400)):
        for _ in range(groups):
            allowance.try_acquire(8)
            allowance.finish_group(8, num_tokens=8 * tokens_per_rollout, queued=False)
    whole_run = (31 * 200 + 11 * 400) / 600
    assert whole_run > 17
    assert allowance.mean_tokens_per_rollout < 12  # e^(-400/128) of the old length is left


def test_the_allowance_follows_the_published_tokens_per_step():
    allowance = TokenAllowance(max_staleness=2, tokens_per_step=100)
    allowance.try_acquire(2)
    allowance.finish_group(2, num_tokens=500)
    assert not allowance.can_start(2)  # 500 queued + the group's own 500 > 200
    allowance.set_tokens_per_step(400)
    assert allowance.allowance_tokens == 800 and not allowance.can_start(2)  # 1000 > 800
    allowance.set_tokens_per_step(500)
    assert allowance.allowance_tokens == 1000 and allowance.can_start(2)  # 1000 fits


def test_max_staleness_zero_still_allows_one_step_ahead():
    assert TokenAllowance(max_staleness=0, tokens_per_step=100).allowance_tokens == 100


def test_the_running_mean_counts_dropped_groups_but_only_queued_tokens_fill_the_queue():
    allowance = TokenAllowance(max_staleness=1, tokens_per_step=1000)
    allowance.try_acquire(2)
    allowance.finish_group(2, num_tokens=300, queued=False)
    allowance.try_acquire(2)
    allowance.finish_group(2, num_tokens=100)
    assert allowance.queued_tokens == 100  # the dropped group's 300 never entered the queue
    assert allowance.mean_tokens_per_rollout == pytest.approx(reference_mean([(2, 300), (2, 100)]), abs=1e-6)
    assert 99 < allowance.mean_tokens_per_rollout < 101  # but they count in the mean (~100 per rollout)


def test_an_empty_pipeline_always_admits():
    allowance = TokenAllowance(max_staleness=1, tokens_per_step=1)
    allowance.try_acquire(8)
    allowance.finish_group(8, num_tokens=8000)
    allowance.consumed(8000)
    assert allowance.can_start(8)  # nothing queued, nothing in flight, even though one group overshoots


def test_misuse_names_the_problem():
    allowance = TokenAllowance(max_staleness=1, tokens_per_step=10)
    with pytest.raises(ValueError, match="0 groups / 0 rollouts are in flight"):
        allowance.finish_group(3, 10)
    allowance.start_group(3)
    with pytest.raises(ValueError, match="3 rollouts are in flight"):
        allowance.cancel_group(4)
    with pytest.raises(ValueError, match="at least one rollout"):
        allowance.start_group(0)
    with pytest.raises(ValueError, match="only 0 are queued"):
        allowance.consumed(5)
    with pytest.raises(ValueError, match="tokens_per_step"):
        allowance.set_tokens_per_step(0)
    with pytest.raises(ValueError, match="max_staleness"):
        TokenAllowance(max_staleness=-1, tokens_per_step=10)


def test_acquire_waits_until_consumption_and_reports_the_waited_seconds():
    clock = FakeClock(100.0)

    async def scenario():
        allowance = TokenAllowance(max_staleness=1, tokens_per_step=100, clock=clock)
        allowance.try_acquire(1)
        allowance.finish_group(1, num_tokens=150)  # the queue holds 150 >= 100: closed
        waiter = asyncio.create_task(allowance.acquire(1))
        await asyncio.sleep(0)
        assert not waiter.done()
        clock.now = 102.5
        allowance.set_tokens_per_step(120)  # 150 >= 120: still closed; the waiter re-checks and waits on
        await asyncio.sleep(0)
        assert not waiter.done()
        clock.now = 107.0
        allowance.consumed(150)
        result = await asyncio.wait_for(waiter, 1.0)
        return allowance, result

    allowance, result = asyncio.run(scenario())
    assert result.acquired and result.waited_s == 7.0
    assert allowance.inflight_groups == 1


def test_acquire_without_waiting_reports_zero():
    async def scenario():
        return await TokenAllowance(1, 100, clock=FakeClock(5.0)).acquire(4)

    result = asyncio.run(scenario())
    assert result.acquired and result.waited_s == 0.0


def test_acquire_times_out_cleanly_and_starts_nothing():
    async def scenario():
        allowance = TokenAllowance(max_staleness=1, tokens_per_step=100)
        allowance.try_acquire(1)
        result = await allowance.acquire(1, timeout_s=0.01)
        return allowance, result

    allowance, result = asyncio.run(scenario())
    assert not result.acquired and allowance.inflight_groups == 1
