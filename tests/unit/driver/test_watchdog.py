"""The watchdog: a run that makes no step stops fast with the reason, built from the queue's outcome and cause
counts and the rollout actors' health (docs/algorithms.md §2.1). Fakes only; each case well under a second."""

import asyncio
import logging
import time

import pytest
from transformers import TrainerState  # noqa: F401  (the step loop imports it when built: not in the timed runs)

from rlasync.driver import Checkpointer, NoProgressError, StepLoop, StepSettings, Taken, Watchdog, WatchdogSettings


class StuckQueue:
    """Never hands out a sample; `state()` reports the counts the test sets (growing with each poll)."""

    def __init__(self, outcomes=None, causes=None, last=None, grow=None, done_after=None):
        self.outcomes, self.causes, self.last = dict(outcomes or {}), dict(causes or {}), dict(last or {})
        self.grow = grow or {}
        self.polls = 0
        self.done_after = done_after

    async def take(self, token_target, timeout_s):
        await asyncio.sleep(min(timeout_s, 0.01))
        self.polls += 1
        return Taken()

    async def finish_step(self, tokens, unplanned=0):
        pass

    async def set_policy_version(self, version):
        pass

    async def state(self):
        for key, value in self.grow.items():
            bucket = self.causes if "/" in key else self.outcomes
            bucket[key] = bucket.get(key, 0) + value
        done = self.done_after is not None and self.polls >= self.done_after
        return {
            "done": done,
            "queue_size": 0,
            "inflight_groups": 0 if done else 2,
            "outcomes": dict(self.outcomes),
            "causes": dict(self.causes),
            "last_failures": dict(self.last),
        }

    async def rollout_state(self):
        return {"prompt_index": 0, "model_version": 0}


class Learners:
    async def train_step(self, refs):
        return []

    async def save(self, directory, tokenizer):
        pass


class Weights:
    async def sync(self, version):
        return version + 1, {}


class Fleet:
    def __init__(self, healths=()):
        self.healths = list(healths)

    async def check_health(self, stale_after_s):
        return self.healths

    async def drain_metrics(self):
        return []

    async def stop(self):
        pass


def run_stuck(tmp_path, queue, fleet=None, timeout_s=0.2, action="error"):
    settings = StepSettings(
        horizon=5, tokens_per_step=100, poll_s=0.01, watchdog=WatchdogSettings(timeout_s=timeout_s, action=action)
    )
    loop = StepLoop(
        settings,
        queue=queue,
        learners=Learners(),
        weights=Weights(),
        fleet=fleet or Fleet(),
        checkpointer=Checkpointer(str(tmp_path)),
    )
    started = time.monotonic()
    result = asyncio.run(asyncio.wait_for(loop.run(), timeout=5))
    return result, time.monotonic() - started


def raised(tmp_path, queue, fleet=None, timeout_s=0.2):
    started = time.monotonic()
    with pytest.raises(NoProgressError) as info:
        run_stuck(tmp_path, queue, fleet, timeout_s)
    assert time.monotonic() - started < 2.0  # the bound (0.2 s) plus a few polls, never the 300-s default
    return str(info.value)


def test_constant_reward_stops_the_run_with_the_zero_spread_count(tmp_path):
    queue = StuckQueue(
        outcomes={"zero_std": 500},
        causes={"zero_std/constant": 500},
        grow={"zero_std": 4, "zero_std/constant": 4},
        last={"zero_std/constant": "8 of 8 rollouts scored, every reward 1 (acc)"},
    )
    message = raised(tmp_path, queue)
    assert "no training step completed in" in message and "watchdog_timeout_s=0.2" in message
    assert "groups in a row had zero reward spread" in message and "check the reward functions" in message
    assert "every reward 1 (acc)" in message
    count = int(message.split(" groups in a row")[0].rsplit(" ", 1)[-1])
    assert count > 0 and count % 4 == 0  # counted since the wait began, not the run's 500 before it


def test_all_none_rewards_are_reported_as_not_applicable(tmp_path):
    queue = StuckQueue(
        grow={"zero_std": 2, "zero_std/no_reward": 2}, last={"zero_std/no_reward": "every reward None (f)"}
    )
    message = raised(tmp_path, queue)
    assert "returned None for every sample of" in message and "every reward None (f)" in message
    assert "zero reward spread" not in message  # the None groups are not double-counted as constant rewards


def test_every_prompt_too_long_is_named_with_the_lengths(tmp_path):
    detail = "row 3: RequestRejectedError: prompt of 700 tokens leaves no room to generate: max_model_len is 512"
    queue = StuckQueue(grow={"failed": 1, "failed/too_long": 1}, last={"failed/too_long": detail})
    message = raised(tmp_path, queue)
    assert "every prompt so far" in message and "raise max_model_len" in message and "700 tokens" in message


def test_other_failures_carry_the_last_message(tmp_path):
    queue = StuckQueue(
        grow={"failed": 1, "failed/reward_timeout": 1},
        last={"failed/reward_timeout": "reward function 'judge' did not return within reward_timeout_s=5 s"},
    )
    message = raised(tmp_path, queue)
    assert "groups failed (last: reward function 'judge' did not return" in message


def test_a_hung_tool_is_named_from_the_fleet_health(tmp_path):
    health = {
        "error": None,
        "running": True,
        "heartbeat_age_s": 0.1,
        "num_inflight": 8,
        "oldest_tool_call": {"name": "slow_tool", "age_s": 300.0},
        "oldest_request": None,
    }
    message = raised(tmp_path, StuckQueue(), Fleet([("rollout actor 0", health)]))
    assert "rollout actor 0: tool `slow_tool` has not returned in 300 s" in message and "tool_timeout_s" in message


def test_a_frozen_engine_is_named_from_the_fleet_health(tmp_path):
    health = {"error": None, "running": True, "heartbeat_age_s": 0.1, "oldest_request": {"engine": 1, "age_s": 99.0}}
    message = raised(tmp_path, StuckQueue(), Fleet([("rollout actor 0", health)]))
    assert "generation engine 1 has not answered a request in 99 s" in message


def test_nothing_at_all_reports_the_flight_and_the_heartbeats(tmp_path):
    health = {"error": None, "running": True, "heartbeat_age_s": 0.4, "num_inflight": 3}
    message = raised(tmp_path, StuckQueue(), Fleet([("rollout actor 0", health)]))
    assert "no group finished: 2 groups in flight" in message
    assert "rollout actor 0 heartbeat 0.4 s ago, 3 tasks in flight" in message


def test_warn_mode_warns_once_per_bound_and_keeps_going(tmp_path, caplog):
    queue = StuckQueue(grow={"zero_std": 1, "zero_std/constant": 1}, done_after=60)
    with caplog.at_level(logging.WARNING):
        result, _ = run_stuck(tmp_path, queue, timeout_s=0.1, action="warn")
    assert result["global_step"] == 0
    warnings = [r.message for r in caplog.records if "zero reward spread" in r.message]
    assert 1 <= len(warnings) <= 12  # one per bound (and one at the end), not one per poll (60 polls)


def test_an_epoch_of_dropped_groups_ends_with_the_reason_not_silently(tmp_path):
    queue = StuckQueue(outcomes={"zero_std": 64}, causes={"zero_std/no_reward": 64}, done_after=1)
    with pytest.raises(
        NoProgressError, match="ended without a single training step: the reward functions returned None"
    ):
        run_stuck(tmp_path, queue, timeout_s=100)


def test_a_resumed_run_with_nothing_left_ends_quietly(tmp_path):
    result, _ = run_stuck(tmp_path, StuckQueue(done_after=1), timeout_s=100)
    assert result["global_step"] == 0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_bound_is_the_floor_then_a_multiple_of_the_median_step():
    clock = Clock()
    dog = Watchdog(WatchdogSettings(floor_s=300.0), clock)
    assert dog.bound_s() == 300.0
    clock.now = 100.0
    dog.step_done()
    assert dog.bound_s() == 500.0  # 5 x the 100-s step
    clock.now = 220.0
    dog.step_done()
    assert dog.bound_s() == 550.0  # 5 x the median of 100 and 120 s
    clock.now = 760.0
    dog.check({"outcomes": {}})  # 540 s waited: within the bound
    clock.now = 771.0
    with pytest.raises(NoProgressError, match=r"bound 550 s: 5 x the median step so far \(110 s\)"):
        dog.check({"outcomes": {}})
    assert Watchdog(WatchdogSettings(timeout_s=7.0), clock).bound_s() == 7.0


def test_the_floor_names_its_config_field():
    clock = Clock()
    dog = Watchdog(WatchdogSettings(floor_s=60.0, floor_setting="heartbeat_stale_after_s"), clock)
    clock.now = 61.0
    with pytest.raises(NoProgressError, match="heartbeat_stale_after_s=60"):
        dog.check({"outcomes": {}})


@pytest.mark.parametrize(
    ("kwargs", "field"), [({"action": "ignore"}, "watchdog_action"), ({"timeout_s": 0}, "watchdog_timeout_s")]
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        WatchdogSettings(**kwargs)


def test_settings_from_config_read_the_watchdog_fields():
    from rlasync.config import AsyncGRPOConfig

    config = AsyncGRPOConfig(output_dir="x", watchdog_timeout_s=12.0, watchdog_action="warn")
    settings = StepSettings.from_config(config, horizon=1, tokens_per_step=1, samples_per_step=None, hang_timeout_s=60)
    assert settings.watchdog == WatchdogSettings(timeout_s=12.0, floor_s=60, action="warn")
    for bad in (
        {"watchdog_timeout_s": -1},
        {"watchdog_action": "x"},
        {"reward_timeout_s": 0},
        {"tool_timeout_s": float("nan")},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AsyncGRPOConfig(output_dir="x", **bad)


def test_the_bound_cannot_grow_without_limit_and_a_slowing_run_is_warned(caplog):
    """A one-row dataset whose steps slow from 5 s to 150 s: the bound follows the median step, capped at 4 x the
    floor, and the slowdown is warned with the step times before the run stalls."""
    clock = Clock()
    dog = Watchdog(WatchdogSettings(floor_s=30.0), clock)
    with caplog.at_level("WARNING"):
        for step_s in (5, 5, 5, 6, 40, 150, 150, 150, 150, 150):
            clock.now += step_s
            dog.step_done()
    assert dog.bound_s() == 120.0  # 5 x the median (150 s) is 750 s: capped at 4 x the 30-s floor
    warnings = [r.getMessage() for r in caplog.records if "slowing down" in r.getMessage()]
    assert len(warnings) == 2 and "step 5 took 40 s" in warnings[0] and "step 6 took 150 s" in warnings[1]
    assert "recent step times, s: 5.0, 5.0, 5.0, 6.0, 40" in warnings[1]
    clock.now += 121.0
    with pytest.raises(NoProgressError, match=r"bound 120 s: the cap, 4 x rollout_worker_timeout=30"):
        dog.check({"outcomes": {}})


def zero_spread(groups, trained=0):
    return {"outcomes": {"zero_std": groups, "trained": trained}, "causes": {"zero_std/constant": groups}}


def test_conclusive_evidence_stops_a_no_signal_run_before_the_bound(caplog):
    from rlasync.driver.watchdog import NO_SIGNAL_GROUPS

    clock = Clock()
    dog = Watchdog(WatchdogSettings(floor_s=300.0), clock)
    clock.now = 5.0
    dog.step_done()
    dog.check(zero_spread(10))  # the baseline after a step: groups before the wait do not count
    clock.now = 20.0
    dog.check(zero_spread(10 + NO_SIGNAL_GROUPS - 1))  # one short: goes on
    clock.now = 25.0
    with pytest.raises(NoProgressError) as info:
        dog.check(zero_spread(10 + NO_SIGNAL_GROUPS))
    message = str(info.value)
    assert message.startswith(
        f"no training step completed in 20 s and the last {NO_SIGNAL_GROUPS} groups in a row had no learning signal "
        f"({NO_SIGNAL_GROUPS} in a row are conclusive: stopped before the bound, 300 s"
    )
    assert f"{NO_SIGNAL_GROUPS} groups in a row had zero reward spread" in message


def test_a_trained_group_or_a_step_means_the_evidence_is_not_conclusive(caplog):
    clock = Clock()
    dog = Watchdog(WatchdogSettings(floor_s=300.0), clock)
    dog.check(zero_spread(0))
    clock.now = 10.0
    dog.check(zero_spread(500, trained=1))  # a group trained since the last step: a step is coming
    dog.step_done()
    dog.check(zero_spread(500, trained=1))  # the new baseline
    clock.now = 20.0
    dog.check(zero_spread(530, trained=1))
    warn = Watchdog(WatchdogSettings(floor_s=300.0, action="warn"), clock)
    warn.check(zero_spread(0))
    with caplog.at_level("WARNING"):
        warn.check(zero_spread(100))
        warn.check(zero_spread(200))  # once per wait
    assert sum("no learning signal" in r.getMessage() for r in caplog.records) == 1
