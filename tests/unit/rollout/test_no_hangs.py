"""The rollout side of "progress or a reason, always" (docs/algorithms.md §2.1, §3.2): a prompt the engine rejects
is dropped once with one warning and its cause; a tool past `tool_timeout_s` becomes a tool error; a reward
function past `reward_timeout_s` fails only its group; all-None rewards drop the group as "no_reward"; the health
report names the oldest tool call and request. Fakes only, each case well under a second."""

import asyncio
import logging
import random
import threading
import time

import numpy as np
import pytest

from rlasync.algorithms.grpo.loop import AsyncRolloutLoop
from rlasync.config import AsyncGRPOConfig
from rlasync.engine.base import RequestRejectedError
from rlasync.records import GroupOutcome, PromptLease, RolloutGroup, TurnRecord
from rlasync.rewards.calling import RewardTimeoutError, call_reward_funcs
from rlasync.rollout.scheduler import short_error
from rlasync.rollout.scoring import score_group
from rlasync.rollout.tools import TIMEOUT_METRIC, ToolCallTracker, execute_tool_calls, make_tool_call

EOS = 2


class Tokenizer:
    eos_token_id = EOS
    pad_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kwargs):
        ids = [1] + [10 + ord(c) % 80 for message in messages for c in message["content"]]
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


class Engine:
    """Rejects prompts over `max_model_len` as the built-in engine does; else one short answer."""

    def __init__(self, max_model_len=20, hold=None):
        self.max_model_len, self.hold = max_model_len, hold
        self.requests = 0

    async def generate(self, prompt_ids, sampling):
        self.requests += 1
        if self.hold is not None:
            await self.hold.wait()
        if len(prompt_ids) >= self.max_model_len:
            raise RequestRejectedError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate: max_model_len is {self.max_model_len}"
            )
        ids = [11 + (sampling.seed or 0) % 7, EOS]
        return TurnRecord(list(prompt_ids), ids, [-0.5] * len(ids), finish_reason="stop")


class Source:
    """Leases each row once (one epoch); records releases and reported failures."""

    def __init__(self, rows):
        self.rows, self.leased, self.released, self.failures = rows, [], [], []

    def lease(self):
        if len(self.leased) >= len(self.rows):
            return None
        index = len(self.leased)
        lease = PromptLease(index, index, self.rows[index], 0)
        self.leased.append(lease)
        return lease

    def report_failure(self, lease, cause, detail):
        self.failures.append((lease.row_index, cause, detail))

    def release(self, lease, reason):
        self.released.append((lease.row_index, reason))


class Sink:
    def __init__(self):
        self.results = []

    async def put(self, result):
        self.results.append(result)


def spread_reward(completion_ids, **kwargs):
    return [float(i) for i in range(len(completion_ids))]


def row(text):
    return {"prompt": [{"role": "user", "content": text}]}


def make_loop(rows, engine=None, reward_funcs=(spread_reward,), **config):
    fields = {
        "num_generations": 2,
        "max_completion_length": 4,
        "max_concurrent_rollouts": 4,
        "num_sampler_logprobs": 0,
        "score_centering": False,
        **config,
    }
    return AsyncRolloutLoop(
        config=AsyncGRPOConfig(**fields),
        tokenizer=Tokenizer(),
        engine=engine or Engine(),
        prompt_source=Source(rows),
        sink=Sink(),
        reward_funcs=list(reward_funcs),
        rng=random.Random(0),
    )


def run(coroutine, timeout=5):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def test_a_prompt_too_long_is_dropped_once_with_one_warning_naming_row_and_lengths(caplog):
    loop = make_loop([row("ok"), row("x" * 40), row("fine")])
    with caplog.at_level(logging.WARNING, logger="rlasync.rollout.scheduler"):
        run(loop.run())
    assert loop.prompt_source.released == [(1, GroupOutcome.FAILED)]  # once: "failed" is consumed, never leased again
    [(row_index, cause, detail)] = loop.prompt_source.failures
    assert (row_index, cause) == (1, "too_long")
    assert "row 1" in detail and "prompt of 41 tokens" in detail and "max_model_len is 20" in detail
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.endswith("scheduler")]
    assert len(warnings) == 1 and "row 1" in warnings[0] and "Traceback" not in warnings[0]
    assert len(loop.sink.results) == 2 and loop.counters["groups_failed"] == 1
    assert loop.health_report()["last_failure"] == detail


def test_the_same_row_failing_again_is_not_warned_twice(caplog):
    loop = make_loop([row("x" * 40)] * 3)  # three leases of rows 0, 1, 2 (distinct rows): three warnings
    loop.prompt_source.rows = [row("x" * 40)]
    source = loop.prompt_source
    source.lease = lambda: None if len(source.leased) >= 3 else _lease_row0(source)  # row 0, three epochs
    with caplog.at_level(logging.WARNING, logger="rlasync.rollout.scheduler"):
        run(loop.run())
    assert len(source.failures) == 3
    assert len([r for r in caplog.records if r.levelno == logging.WARNING and r.name.endswith("scheduler")]) == 1


def _lease_row0(source):
    lease = PromptLease(len(source.leased), 0, source.rows[0], len(source.leased))
    source.leased.append(lease)
    return lease


def test_short_error_unwraps_a_remote_error_and_drops_its_traceback():
    class Remote(Exception):
        pass

    remote = Remote("Traceback (most recent call last):\n  File x\nRequestRejectedError: too long")
    remote.cause = RequestRejectedError("prompt of 9 tokens leaves no room to generate: max_model_len is 8")
    assert (
        short_error(remote) == "RequestRejectedError: prompt of 9 tokens leaves no room to generate: max_model_len is 8"
    )
    assert short_error(ValueError("a\nb")) == "ValueError: a"
    assert len(short_error(ValueError("x" * 1000))) == 300


def slow_tool(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "done"


async def slow_async_tool() -> str:
    """Never returns."""
    await asyncio.sleep(1000)
    return "never"


@pytest.mark.parametrize("tool", [slow_tool, slow_async_tool])
def test_a_tool_past_its_timeout_becomes_a_tool_error_and_a_counted_failure(tool):
    args = {"seconds": 2.0} if tool is slow_tool else {}
    tracker = ToolCallTracker()

    async def timed():  # asyncio.run then waits for the sleeping thread: time the call itself
        started = time.monotonic()
        results = await execute_tool_calls(
            [make_tool_call(tool.__name__, args)], {tool.__name__: tool}, timeout_s=0.1, tracker=tracker
        )
        return results, time.monotonic() - started

    results, elapsed = run(timed())
    assert elapsed < 1.0
    assert results.num_calls == 1 and results.num_failures == 1
    assert f"tool `{tool.__name__}` did not return within tool_timeout_s=0.1 s" in results.messages[0]["content"]
    assert (TIMEOUT_METRIC, 1.0) in results.metrics and (f"tools/{tool.__name__}/failure_count", 1.0) in results.metrics
    assert tracker.oldest() is None  # the call left the tracker


def test_the_tracker_reports_the_oldest_call_in_flight():
    async def main():
        tracker = ToolCallTracker()
        task = asyncio.ensure_future(
            execute_tool_calls(
                [make_tool_call("slow_async_tool")], {"slow_async_tool": slow_async_tool}, tracker=tracker
            )
        )
        await asyncio.sleep(0.05)
        oldest = tracker.oldest()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return oldest

    oldest = run(main())
    assert oldest["name"] == "slow_async_tool" and oldest["age_s"] >= 0.04


def test_the_health_report_names_the_oldest_unanswered_request():
    async def main():
        hold = asyncio.Event()
        loop = make_loop([row("a")], engine=Engine(hold=hold))
        task = asyncio.ensure_future(loop.run())
        await asyncio.sleep(0.1)
        report = loop.health_report()
        hold.set()
        await task
        return report

    report = run(main())
    assert report["oldest_request"]["engine"] == 0 and report["oldest_request"]["age_s"] > 0.05
    assert report["num_inflight"] == 2 and report["oldest_tool_call"] is None


def sleepy_reward(completion_ids, **kwargs):
    time.sleep(2.0)
    return [1.0] * len(completion_ids)


async def hung_reward(completion_ids, **kwargs):
    await asyncio.sleep(1000)


@pytest.mark.parametrize("func", [sleepy_reward, hung_reward])
def test_a_reward_function_past_its_timeout_is_named(func):
    async def timed():  # asyncio.run then waits for the sleeping thread: time the call itself
        started = time.monotonic()
        try:
            await call_reward_funcs(
                [func, spread_reward],
                prompts=["p"] * 2,
                completions=["a", "b"],
                completion_ids=[[1], [2]],
                reward_kwargs={},
                timeout_s=0.1,
            )
        except RewardTimeoutError as exc:
            return str(exc), time.monotonic() - started
        return "no error", 0.0

    message, elapsed = run(timed())
    assert f"reward function '{func.__name__}' did not return within reward_timeout_s=0.1 s" in message
    assert elapsed < 1.0


def test_a_timed_out_sync_reward_is_counted_while_its_thread_runs_on():
    """A sync function's thread cannot be stopped: the timeout error says how many of its calls still run (so a
    later call that only waited for a free thread is not mistaken for a slow one), and the count falls back to
    zero when the threads return."""
    from rlasync.rewards.calling import calls_in_threads

    release = threading.Event()

    def stuck_reward(completion_ids, **kwargs):
        release.wait(10)
        return [0.0] * len(completion_ids)

    async def twice():
        messages = []
        for _ in range(2):
            try:
                await call_reward_funcs(
                    [stuck_reward],
                    prompts=["p"],
                    completions=["a"],
                    completion_ids=[[1]],
                    reward_kwargs={},
                    timeout_s=0.05,
                )
            except RewardTimeoutError as exc:
                messages.append(str(exc))
        return messages

    loop = asyncio.new_event_loop()  # not asyncio.run: it would join the stuck threads before returning
    try:
        messages = loop.run_until_complete(asyncio.wait_for(twice(), 5))
        assert "1 call(s) of it are still running in worker threads" in messages[0]
        assert "2 call(s) of it are still running" in messages[1]  # the first one's thread is still held
        assert calls_in_threads("stuck_reward") == 2
    finally:
        release.set()
        loop.close()
    deadline = time.monotonic() + 5
    while calls_in_threads("stuck_reward") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls_in_threads("stuck_reward") == 0


def test_a_reward_timeout_fails_only_its_group_and_the_loop_goes_on():
    loop = make_loop([row("a"), row("b")], reward_funcs=(hung_reward,), reward_timeout_s=0.1)
    run(loop.run())
    assert sorted(loop.prompt_source.released) == [(0, GroupOutcome.FAILED), (1, GroupOutcome.FAILED)]
    causes = {cause for _, cause, _ in loop.prompt_source.failures}
    assert causes == {"reward_timeout"} and "hung_reward" in loop.prompt_source.failures[0][2]
    assert loop.sink.results == [] and loop.counters["groups_failed"] == 2


def none_reward(completions, **kwargs):
    return [None] * len(completions)


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def group_of(n=4):
    return RolloutGroup(
        group_id=0,
        row_index=0,
        policy_version=0,
        prompts=["p"] * n,
        completions=[[{"role": "assistant", "content": "c"}]] * n,
        completions_ids=[[1]] * n,
        completions_sequences=[[]] * n,
    )


def test_all_none_rewards_drop_the_group_as_no_reward_following_trl():
    scored = run(score_group(group_of(), [none_reward]))
    assert scored.dropped and np.isnan(scored.rewards).all() and scored.samples == []
    assert scored.drop_cause == "no_reward" and scored.drop_detail() == "every reward None (none_reward)"
    assert ("frac_zero_std_groups", 1.0) in scored.metrics


def test_a_constant_reward_drops_the_group_as_constant():
    scored = run(score_group(group_of(), [constant_reward]))
    assert scored.drop_cause == "constant" and "every reward 1 (constant_reward)" in scored.drop_detail()
    kept = run(score_group(group_of(), [spread_reward]))
    assert kept.drop_cause is None and not kept.dropped


@pytest.mark.parametrize(
    ("field", "value"), [("reward_timeout_s", 0), ("tool_timeout_s", -1.0), ("reward_timeout_s", True)]
)
def test_timeout_fields_are_validated(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}: must be a number of seconds > 0, or None"):
        AsyncGRPOConfig(**{field: value})


def test_timeout_fields_reach_the_rollout_settings():
    loop = make_loop([row("a")], reward_timeout_s=7.0, tool_timeout_s=3.0)
    assert (loop.settings.reward_timeout_s, loop.settings.tool_timeout_s) == (7.0, 3.0)
    assert (AsyncGRPOConfig().reward_timeout_s, AsyncGRPOConfig().tool_timeout_s) == (300.0, 120.0)
