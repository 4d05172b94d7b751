"""RequestBatcher (rlasync/rewards/model/batcher.py): requests that arrive within the wait bound are scored in one
call, each gets its own results in its order, a full batch does not wait, later requests form the next batch, and a
failing score function fails every request of its batch with a named error while the batcher keeps serving."""

import asyncio
import threading
import time

import pytest

from rlasync.rewards.model import REQUEST_SOURCE, RequestBatcher, RewardModelError


class Recorder:
    def __init__(self, fail_on=None, delay_s=0.0):
        self.calls, self.records, self.fail_on, self.delay_s = [], [], fail_on, delay_s

    def score(self, items):
        self.calls.append(list(items))
        time.sleep(self.delay_s)
        if self.fail_on is not None and self.fail_on in items:
            raise RuntimeError("CUDA out of memory (injected)")
        return [float(item) * 10 for item in items]


def batcher(recorder, max_wait_s=0.05, max_items=100):
    return RequestBatcher(
        recorder.score, name="rm", max_wait_s=max_wait_s, max_items=max_items, on_batch=recorder.records.append
    )


def test_concurrent_requests_within_the_wait_bound_share_one_call():
    recorder = Recorder()
    merger = batcher(recorder, max_wait_s=5.0, max_items=6)  # goes when the 6th item arrives, well within 5 s

    async def main():
        async def send(items, source, delay_s):
            await asyncio.sleep(delay_s)
            return await merger.submit(items, source=source)

        return await asyncio.gather(send([1, 2], "a", 0.0), send([3], "b", 0.01), send([4, 5, 6], "a", 0.02))

    assert asyncio.run(main()) == [[10.0, 20.0], [30.0], [40.0, 50.0, 60.0]]
    assert recorder.calls == [[1, 2, 3, 4, 5, 6]]
    (record,) = recorder.records
    assert (record.items, record.requests, record.sources) == (6, 3, 2)


def test_a_full_batch_goes_at_once_and_late_requests_form_the_next():
    recorder = Recorder()
    merger = batcher(recorder, max_wait_s=5.0, max_items=3)

    async def main():
        started = time.monotonic()
        first = await asyncio.gather(merger.submit([1, 2]), merger.submit([3]))
        elapsed = time.monotonic() - started
        return first, elapsed

    (first, elapsed) = asyncio.run(main())
    assert first == [[10.0, 20.0], [30.0]] and elapsed < 2.0  # 3 items waiting: no 5 s wait
    assert recorder.calls == [[1, 2, 3]]

    started, release = threading.Event(), threading.Event()
    calls = []

    def blocking(items):  # the first forward holds until the late requests have arrived
        calls.append(list(items))
        started.set()
        assert release.wait(30)
        return [float(item) * 10 for item in items]

    records = []
    merger2 = RequestBatcher(blocking, name="rm", max_wait_s=0.01, max_items=100, on_batch=records.append)

    async def staggered():
        first = asyncio.ensure_future(merger2.submit([1]))
        while not started.is_set():
            await asyncio.sleep(0.005)
        late = [asyncio.ensure_future(merger2.submit([2])), asyncio.ensure_future(merger2.submit([3]))]
        await asyncio.sleep(0.05)  # both are waiting while the first forward runs
        release.set()
        return await asyncio.gather(first, *late)

    assert asyncio.run(staggered()) == [[10.0], [20.0], [30.0]]
    assert calls == [[1], [2, 3]]
    assert [record.sources for record in records] == [1, 2]  # unnamed senders count one each


def test_a_failing_forward_reaches_every_waiting_request_named_and_the_batcher_goes_on():
    recorder = Recorder(fail_on=3)
    merger = batcher(recorder)

    async def main():
        outcomes = await asyncio.gather(merger.submit([1, 2]), merger.submit([3]), return_exceptions=True)
        after = await merger.submit([7])
        return outcomes, after

    outcomes, after = asyncio.run(main())
    assert all(isinstance(outcome, RewardModelError) for outcome in outcomes)
    message = str(outcomes[0])
    assert "reward model 'rm'" in message and "batch of 3 completions from 2 request(s)" in message
    assert "RuntimeError: CUDA out of memory (injected)" in message
    assert isinstance(outcomes[1].__cause__, RuntimeError)
    assert after == [70.0] and recorder.records[-1].items == 1


def test_the_sender_comes_from_the_context_and_a_wrong_result_count_is_an_error():
    recorder = Recorder()
    merger = batcher(recorder)

    async def main():
        async def from_actor(name, items):
            REQUEST_SOURCE.set(name)
            return await merger.submit(items)

        return await asyncio.gather(from_actor("rollout 0", [1]), from_actor("rollout 1", [2]))

    assert asyncio.run(main()) == [[10.0], [20.0]]
    assert recorder.records[0].sources == 2
    short = RequestBatcher(lambda items: [1.0], name="short", max_wait_s=0.0, max_items=10)
    with pytest.raises(RewardModelError, match="returned 1 results for 2 items"):
        asyncio.run(short.submit(["x", "y"]))


@pytest.mark.parametrize(("field", "value"), [("max_wait_s", -0.1), ("max_items", 0)])
def test_bad_settings_name_the_field(field, value):
    kwargs = {"max_wait_s": 0.01, "max_items": 8, field: value}
    with pytest.raises(ValueError, match=f"{field}={value}"):
        RequestBatcher(lambda items: items, name="rm", **kwargs)


class Reporting:
    """A reward function object that reports metrics (as RewardModel does)."""

    __name__ = "reporting"

    def __init__(self):
        self.pending = [("rewards/reporting/batch_size", 2.0)]

    def __call__(self, completions, **kwargs):
        return [1.0] * len(completions)

    def drain_metrics(self):
        items, self.pending = self.pending, []
        return items


def test_reported_metrics_are_drained_once_into_the_table_and_the_group_metrics():
    import numpy as np

    from rlasync.records import RolloutGroup
    from rlasync.rewards import call_reward_funcs
    from rlasync.rollout.scoring import score_group

    reward = Reporting()
    table = asyncio.run(
        call_reward_funcs(
            [reward, reward], prompts=["p", "p"], completions=["a", "b"], completion_ids=[[1], [2]], reward_kwargs={}
        )
    )
    assert table.metrics == (("rewards/reporting/batch_size", 2.0),)  # the same object twice: drained once
    reward.pending = [("rewards/reporting/batch_requests", 3.0)]
    group = RolloutGroup(
        group_id=0,
        row_index=0,
        policy_version=0,
        prompts=["p", "p"],
        completions=["a", "b"],
        completions_ids=[[1], [2]],
        completions_sequences=[[], []],
    )
    scored = asyncio.run(score_group(group, [reward]))
    assert ("rewards/reporting/batch_requests", 3.0) in scored.metrics
    assert np.allclose(scored.rewards, [1.0, 1.0])
