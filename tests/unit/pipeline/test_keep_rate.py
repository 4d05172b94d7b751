"""TokenAllowance's keep rate (issue 35): the estimate, the gate that counts in-flight work at it, its floor, the cold
start, what counts as a drop, the synchronous mode, and the `rollout/keep_rate` gauge of the queue's takes."""

import random

import pytest

from rlasync.metrics import MetricSink
from rlasync.pipeline import KEEP_RATE_FLOOR, KEEP_RATE_METRIC, QueueEntry, QueueService, TokenAllowance
from rlasync.pipeline.settings import QueueSettings

G = 4  # rollouts per group
TOKENS = 100  # raw tokens per rollout


def scored(allowance, pattern, tokens=G * TOKENS):
    """Run one group per entry of `pattern` (True: queued, False: dropped after scoring), nothing consumed."""
    for kept in pattern:
        allowance.start_group(G)
        allowance.finish_group(G, num_tokens=tokens, queued=kept)
    allowance.consumed(allowance.queued_tokens, num_samples=allowance.queued_samples)


def admitted(allowance, limit=10_000):
    """How many groups the gate admits now, with nothing finishing."""
    count = 0
    while count < limit and allowance.try_acquire(G):
        count += 1
    return count


def test_the_estimate_converges_to_the_kept_share_of_tokens():
    allowance = TokenAllowance(max_staleness=2, tokens_per_step=10**6)
    scored(allowance, [i % 5 == 0 for i in range(1000)])  # one group in five kept
    assert allowance.keep_rate_estimate == pytest.approx(0.2, abs=0.01)
    assert allowance.keep_rate == allowance.keep_rate_estimate
    # token-weighted: half the groups kept, but the dropped ones are three times as long -> a quarter of the tokens
    weighted = TokenAllowance(max_staleness=2, tokens_per_step=10**6)
    for i in range(1000):
        weighted.start_group(G)
        weighted.finish_group(G, num_tokens=100 if i % 2 else 300, queued=bool(i % 2))
    assert weighted.keep_rate_estimate == pytest.approx(0.25, abs=0.01)


def test_the_estimate_follows_a_falling_keep_rate_within_a_few_windows():
    allowance = TokenAllowance(max_staleness=2, tokens_per_step=10**6)
    rng = random.Random(0)
    scored(allowance, [True] * 300)
    assert allowance.keep_rate == 1.0
    scored(allowance, [rng.random() < 0.2 for _ in range(600)])  # the task is being solved
    assert allowance.keep_rate_estimate == pytest.approx(0.2, abs=0.06)


def test_the_gate_admits_about_one_over_the_keep_rate_more_groups():
    """Allowance 10 000 tokens, groups of 400: 25 groups counted at full; at a keep rate of 1/4, 4x that counting
    the mean alone (margin 0), and in between with the default margin of two standard deviations."""
    full = TokenAllowance(max_staleness=1, tokens_per_step=10_000, keep_rate_floor=1.0)
    mean_only = TokenAllowance(max_staleness=1, tokens_per_step=10_000, keep_rate_margin_sd=0.0)
    margin = TokenAllowance(max_staleness=1, tokens_per_step=10_000)
    pattern = [i % 4 == 0 for i in range(2000)]
    for allowance in (full, mean_only, margin):
        scored(allowance, pattern)
    assert full.keep_rate == 1.0 and mean_only.keep_rate == pytest.approx(0.25, abs=0.01)
    n_full, n_mean, n_margin = admitted(full), admitted(mean_only), admitted(margin)
    assert n_full == 25
    assert n_mean == pytest.approx(4 * n_full, abs=3)
    # 100 n + 2 * 400 * sqrt(n * 0.25 * 0.75) < 10 000  ->  n = 71
    assert n_full < n_margin < n_mean and n_margin == pytest.approx(71, abs=2)
    assert not margin.can_start(G) and margin.inflight_tokens > 2.5 * margin.allowance_tokens


def test_the_new_group_counts_at_the_keep_rate():
    """The new group's own tokens count as what it is expected to queue: its rollouts at the mean, times k̂."""
    allowance = TokenAllowance(max_staleness=1, tokens_per_step=10_000)
    scored(allowance, [i % 4 == 0 for i in range(2000)])  # keep rate 1/4
    assert allowance.expected_group_tokens(G) == pytest.approx(G * TOKENS * allowance.keep_rate)
    assert allowance.expected_group_tokens(2 * G) == pytest.approx(2 * allowance.expected_group_tokens(G))
    while allowance.try_acquire(G):
        pass
    counted = allowance.queued_tokens + allowance.counted_inflight_tokens
    assert counted <= allowance.allowance_tokens < counted + allowance.expected_group_tokens(G)


def test_the_margin_never_counts_more_than_the_rollouts_themselves():
    allowance = TokenAllowance(max_staleness=1, tokens_per_step=10_000)
    scored(allowance, [True, False] * 200)  # keep rate 1/2
    allowance.start_group(G)  # one group: mean 200 + 2 sd (2 * 400 * 0.5) = 600 > 400
    assert allowance.counted_inflight_tokens == allowance.inflight_tokens == G * TOKENS


def test_the_floor_bounds_the_work_in_flight_when_everything_is_dropped():
    allowance = TokenAllowance(max_staleness=1, tokens_per_step=10_000)
    scored(allowance, [False] * 2000)
    assert allowance.keep_rate_estimate < 1e-3 and allowance.keep_rate == KEEP_RATE_FLOOR == 1 / 16
    n = admitted(allowance)
    assert allowance.inflight_tokens < allowance.allowance_tokens / KEEP_RATE_FLOOR  # 16 x the allowance at most
    assert 25 < n < 16 * 25
    with pytest.raises(ValueError, match="keep_rate_floor=0"):
        TokenAllowance(max_staleness=1, tokens_per_step=10, keep_rate_floor=0)
    with pytest.raises(ValueError, match="keep_rate_window=0"):
        TokenAllowance(max_staleness=1, tokens_per_step=10, keep_rate_window=0)
    with pytest.raises(ValueError, match="keep_rate_margin_sd=-1"):
        TokenAllowance(max_staleness=1, tokens_per_step=10, keep_rate_margin_sd=-1)


def test_a_cold_start_behaves_as_before_the_keep_rate():
    """The prior 1.0: before any group is scored, and over a run where everything is kept, the gate decides exactly
    as one that counts in-flight work at full; the first drop moves the estimate by one part in 17, not to 0."""
    fresh = TokenAllowance(max_staleness=2, tokens_per_step=2000)
    assert fresh.keep_rate == 1.0 and fresh.keep_rate_estimate == 1.0
    rng = random.Random(1)
    new, old = (
        TokenAllowance(max_staleness=2, tokens_per_step=2000, keep_rate_floor=f) for f in (KEEP_RATE_FLOOR, 1.0)
    )
    inflight = 0
    for _ in range(500):
        assert new.can_start(G) == old.can_start(G)
        assert new.counted_inflight_tokens == old.counted_inflight_tokens
        if inflight and (rng.random() < 0.5 or not new.can_start(G)):
            tokens = rng.randint(1, 4) * TOKENS
            for allowance in (new, old):
                allowance.finish_group(G, num_tokens=tokens)
            inflight -= 1
        elif new.can_start(G):
            assert new.try_acquire(G) and old.try_acquire(G)
            inflight += 1
        if new.queued_tokens and rng.random() < 0.3:
            for allowance in (new, old):
                allowance.consumed(allowance.queued_tokens)
    dropped_first = TokenAllowance(max_staleness=2, tokens_per_step=2000)
    scored(dropped_first, [False])
    assert dropped_first.keep_rate == pytest.approx(16 / 17, abs=0.005)  # the prior decays by 127/128 too


def test_failed_and_cancelled_groups_are_not_drops():
    allowance = TokenAllowance(max_staleness=2, tokens_per_step=10**6)
    scored(allowance, [True, False] * 50)
    before = allowance.keep_rate_estimate
    for _ in range(50):
        allowance.start_group(G)
        allowance.cancel_group(G)  # failed before producing anything, filtered, released, cancelled
        allowance.start_group(G)
        allowance.finish_group(G, num_tokens=400, queued=False, scored=False)  # generated, then failed
    assert allowance.keep_rate_estimate == before
    scored(allowance, [False] * 50)  # zero-spread drops do count
    assert allowance.keep_rate_estimate < before - 0.1
    with pytest.raises(ValueError, match="scored=False"):
        allowance.start_group(G)
        allowance.finish_group(G, num_tokens=400, queued=True, scored=False)


def test_the_queue_service_feeds_only_zero_spread_drops_to_the_keep_rate():
    service = QueueService.create(QueueSettings(1000, None, max_staleness=2, tokens_per_step=10**6))
    for _ in range(20):
        lease = service.try_next_group(G)
        service.drop_group(lease.group_id, "failed", num_tokens=400, cause="engine", detail="rejected")
    for _ in range(20):
        lease = service.try_next_group(G)
        service.drop_group(lease.group_id, "filtered")
    for _ in range(20):
        service.release(service.try_next_group(G))
    assert service.allowance.keep_rate == 1.0 and service.allowance.mean_tokens_per_rollout == 100
    for _ in range(20):
        lease = service.try_next_group(G)
        service.drop_group(lease.group_id, "zero_std", num_tokens=400, cause="constant")
    assert service.allowance.keep_rate < 0.6
    state = service.state()
    assert state.keep_rate == service.allowance.keep_rate and state.counted_inflight_tokens == 0.0


def test_synchronous_mode_counts_work_in_flight_at_full():
    """S = 0: a version generates its budget and no more, so nothing is over-provisioned for drops (the estimate is
    still kept and published): the gate decides exactly as one without the keep rate."""
    new, old = (
        TokenAllowance(max_staleness=0, tokens_per_step=2000, keep_rate_floor=f) for f in (KEEP_RATE_FLOOR, 1.0)
    )
    for allowance in (new, old):
        scored(allowance, [i % 5 == 0 for i in range(1000)])
        allowance.new_version()
    assert new.keep_rate == pytest.approx(0.2, abs=0.02) and old.keep_rate == 1.0
    assert admitted(new) == admitted(old) == 5  # 5 groups of 400 fill the version's 2000 tokens
    assert new.counted_inflight_tokens == new.inflight_tokens == 2000


def test_every_take_publishes_the_keep_rate_as_a_gauge():
    service = QueueService.create(QueueSettings(1000, None, max_staleness=2, tokens_per_step=10**6))
    assert service.take(100).metrics[KEEP_RATE_METRIC] == 1.0  # an empty take too
    sink = MetricSink()
    for i in range(200):
        lease = service.try_next_group(2)
        if i % 2:
            entries = [
                QueueEntry(payload=j, group_id=lease.group_id, policy_version=0, num_tokens=50) for j in range(2)
            ]
            service.put_group(entries)
        else:
            service.drop_group(lease.group_id, "zero_std", num_tokens=100)
        sink.update(service.take(100).metrics.items())
    rate = sink.reduce()[KEEP_RATE_METRIC]
    assert 0.5 < rate < 1.0  # a mean over the takes of an estimate falling from 1.0 towards 0.5
    assert service.take(100).metrics[KEEP_RATE_METRIC] == pytest.approx(0.5, abs=0.1)
