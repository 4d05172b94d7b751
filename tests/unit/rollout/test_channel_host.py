"""The generation actor's side of the channels (`actors.engine_channel.ChannelHost`): every request answered once
through its channel's one stream, whichever submission it came in; in slices that leave the event loop to other
calls; cancelled when the caller goes away; channels kept apart."""

import asyncio
import random
import time

import pytest

pytest.importorskip("ray")

from actors.engine_channel import ChannelHost  # noqa: E402
from rlasync.engine.base import EngineError  # noqa: E402


class SlowAdmission:
    """`generate` blocks the loop for `admit_s` (an engine's synchronous admission), then finishes after a random
    delay; prompts starting with -1 fail, with 0 are cancelled inside the engine."""

    def __init__(self, admit_s=0.0, seed=0):
        self.admit_s, self.started, self.random = admit_s, 0, random.Random(seed)

    async def generate(self, prompt_ids, sampling):
        self.started += 1
        if self.admit_s:
            time.sleep(self.admit_s)
        await asyncio.sleep(self.random.uniform(0, 0.02))
        if prompt_ids[0] == -1:
            raise ValueError("bad request")
        if prompt_ids[0] == 0:
            raise asyncio.CancelledError
        return ("record", prompt_ids[0])


async def collect(engine, requests, admit_slice=16, submissions=1):
    """`requests` submitted in `submissions` calls on one channel; the stream's batches until all are answered."""
    host = ChannelHost(engine, admit_slice=admit_slice)
    stream = host.results("c")
    numbered = [(i, ids, sampling) for i, (ids, sampling) in enumerate(requests)]
    size = -(-len(numbered) // submissions)
    for begin in range(0, len(numbered), size):
        asyncio.ensure_future(host.submit("c", numbered[begin : begin + size]))
    batches, answered = [], 0
    while answered < len(requests):
        ready = await stream.__anext__()
        assert ready  # never an empty list
        batches.append(ready)
        answered += len(ready)
    await stream.aclose()
    return batches


@pytest.mark.parametrize("submissions", [1, 5])
def test_every_request_is_answered_once_with_its_own_outcome(submissions):
    requests = [([i if i % 7 else -1], None) for i in range(1, 101)] + [([0], None)]
    batches = asyncio.run(collect(SlowAdmission(), requests, admit_slice=8, submissions=submissions))
    results = [item for batch in batches for item in batch]
    assert sorted(index for index, _, _ in results) == list(range(len(requests)))
    for index, ok, value in results:
        first = requests[index][0][0]
        if first == -1:
            assert not ok and isinstance(value, ValueError)
        elif first == 0:
            assert not ok and isinstance(value, EngineError) and "cancelled" in str(value)
        else:
            assert ok and value == ("record", first)
    assert len(batches) < len(requests)  # results that finish together go out together


def test_a_call_arriving_during_a_large_batch_runs_after_one_slice():
    """The batch's requests each block the loop while being admitted; another coroutine (a weight sync) made
    ready meanwhile runs once the current slice is in, not after all 256."""
    engine = SlowAdmission(admit_s=0.0005)
    started_before_probe = []

    async def main():
        stream = asyncio.ensure_future(collect(engine, [([i + 1], None) for i in range(256)], admit_slice=16))
        await asyncio.sleep(0)  # the submission starts its first slice

        async def probe():
            started_before_probe.append(engine.started)

        await asyncio.ensure_future(probe())
        await stream

    asyncio.run(main())
    assert started_before_probe[0] <= 2 * 16


def test_closing_the_stream_cancels_the_requests_still_running():
    class Forever:
        def __init__(self):
            self.cancelled = self.started = 0

        async def generate(self, prompt_ids, sampling):
            self.started += 1
            if prompt_ids[0] == 1:
                return "quick"
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

    engine = Forever()

    async def main():
        host = ChannelHost(engine, admit_slice=8)
        stream = host.results("c")
        submitting = asyncio.ensure_future(host.submit("c", [(0, [1], None)] + [(i, [2], None) for i in range(1, 41)]))
        first = await stream.__anext__()
        await stream.aclose()
        started = engine.started
        await submitting
        await asyncio.sleep(0.05)
        assert engine.started == started  # no slice is admitted after the caller left
        await host.submit("c", [(99, [1], None)])  # a late submission for the closed channel starts nothing
        assert engine.started == started and host.open_channels == 0
        return first

    assert asyncio.run(main()) == [(0, True, "quick")]
    assert 8 <= engine.started < 41 and engine.cancelled == engine.started - 1  # each one still running, cancelled


def test_a_base_exception_from_the_engine_is_that_requests_answer_not_a_hang():
    """`_one` catches Exception only; a request ending in another BaseException is still answered (the stream
    would otherwise wait for it forever)."""

    class Interrupted(BaseException):
        pass

    class Engine:
        async def generate(self, prompt_ids, sampling):
            if prompt_ids[0] == 2:
                raise Interrupted()
            return prompt_ids[0]

    async def main():
        return await asyncio.wait_for(collect(Engine(), [([i], None) for i in range(1, 5)], admit_slice=2), 5)

    results = sorted(item for batch in asyncio.run(main()) for item in batch)
    assert [(index, ok) for index, ok, _ in results] == [(0, True), (1, False), (2, True), (3, True)]
    assert isinstance(results[1][2], Interrupted)


def test_channels_are_kept_apart_and_a_submission_may_come_before_the_stream():
    class Echo:
        async def generate(self, prompt_ids, sampling):
            await asyncio.sleep(0.001 * prompt_ids[0])
            return prompt_ids[0]

    async def main():
        host = ChannelHost(Echo())
        await host.submit("b", [(0, [3], None), (1, [1], None)])  # before b's stream opens
        a, b = host.results("a"), host.results("b")
        await host.submit("a", [(0, [2], None)])
        got_a = await a.__anext__()
        got_b = []
        while len(got_b) < 2:
            got_b += await b.__anext__()
        assert host.open_channels == 2
        await a.aclose()
        assert host.open_channels == 1
        await b.aclose()
        return got_a, got_b

    got_a, got_b = asyncio.run(main())
    assert got_a == [(0, True, 2)]
    assert sorted(got_b) == [(0, True, 3), (1, True, 1)]
