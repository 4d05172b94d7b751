"""A dead or restarting GenerationActor's failed requests are retryable EngineErrors for the EnginePool (the core never
sees a Ray error), and the retry lands on another engine or the restarted one (`actors.engine_channel`)."""

import asyncio
import collections

import pytest

ray_exceptions = pytest.importorskip("ray.exceptions")


class _ActorId:
    def hex(self):
        return "ab" * 14


class _Stream:
    """A Ray streaming generator of one channel: each item awaits to one list of (request id, ok, value); `outcome`
    an exception fails the stream itself (the actor died), else each submitted request gets `outcome`."""

    def __init__(self, handle, outcome):
        self.handle, self.outcome = handle, outcome

    async def __aiter__(self):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        while True:
            while not self.handle.submitted:
                await asyncio.sleep(0)
            request_id = self.handle.submitted.popleft()

            async def item(request_id=request_id):
                return [(request_id, True, self.outcome)]

            yield item()


class _Method:
    def __init__(self, call):
        self.call = call

    def options(self, **options):
        assert options == {"num_returns": "streaming"}
        return self

    def remote(self, *args):
        return self.call(*args)


class FakeHandle:
    """A GenerationActor handle: each `results` stream opened takes the next of `outcomes`; `submit` queues ids."""

    def __init__(self, *outcomes):
        self.outcomes = collections.deque(outcomes)
        self.submitted = collections.deque()
        self.channels = []
        self.results = _Method(self._results)
        self.submit = _Method(self._submit)
        self._actor_id = _ActorId()

    def _results(self, channel_id):
        self.channels.append(channel_id)
        self.submitted.clear()  # a new incarnation knows nothing submitted before
        return _Stream(self, self.outcomes.popleft())

    def _submit(self, channel_id, requests):
        assert channel_id == self.channels[-1]
        self.submitted.extend(request_id for request_id, _, _ in requests)

        async def done():
            return None

        return done()


def _pool(engines, slept):
    from rlasync.rollout.engine_pool import EnginePool

    async def sleep(seconds):
        slept.append(seconds)

    return EnginePool(engines, max_concurrent=4, emit=lambda items: None, stats_interval_s=None, sleep=sleep)


def test_an_engine_death_is_retried_on_the_restarted_engine():
    from actors.engine_channel import EngineChannel

    died = ray_exceptions.ActorUnavailableError("The actor is restarting", b"\x00" * 16)
    slept = []
    pool = _pool([EngineChannel(FakeHandle(died, "tokens"))], slept)

    async def run():
        return await pool.retrying("generation", lambda: pool.engines[0].generate([1, 2], None))

    assert asyncio.run(run()) == "tokens"
    assert slept == [1.0] and pool.counters["generation_retries"] == 1
    channel = pool.engines[0]
    assert channel.streams == 2 and len(set(channel.handle.channels)) == 2  # the retry opened a new channel


def test_a_channel_used_from_a_new_event_loop_opens_a_new_stream():
    """The stream's reader lives on the loop that opened it; a later loop (asyncio.run again) gets its own."""
    from actors.engine_channel import EngineChannel

    channel = EngineChannel(FakeHandle("first", "second"))

    async def run():
        return await asyncio.wait_for(channel.generate([1], None), 5)

    assert asyncio.run(run()) == "first"
    assert asyncio.run(run()) == "second"
    assert channel.streams == 2 and channel.calls == 2


def test_the_engine_error_names_the_dead_actor_and_keeps_the_cause():
    from actors.engine_channel import EngineChannel
    from rlasync.engine.base import EngineError

    channel = EngineChannel(FakeHandle(ray_exceptions.ActorDiedError()), name="generation actor 1")

    async def run():
        return await channel.generate([1], None)

    with pytest.raises(EngineError, match=r"generation actor 1 \(abab.*\) did not answer: ActorDiedError") as info:
        asyncio.run(run())
    assert isinstance(info.value.__cause__, ray_exceptions.ActorDiedError)


def test_a_task_error_of_the_call_itself_is_not_translated():
    from actors.engine_channel import EngineChannel

    channel = EngineChannel(FakeHandle(ValueError("bad sampling")))

    async def run():
        return await channel.generate([1], None)

    with pytest.raises(ValueError, match="bad sampling"):
        asyncio.run(run())


class _StatsHandle:
    """A GenerationActor handle whose `stats.remote()` awaits to the engine's gauges."""

    def __init__(self, stats):
        self.stats = self
        self.value = stats
        self._actor_id = _ActorId()

    def remote(self):
        async def answer():
            return self.value

        return answer()


def test_only_the_counting_channel_reports_the_engines_preemptions():
    """Four rollout actors read one engine: each reports the preemptions it saw since its own last look and the
    window sums them, so only the first actor's channels count them (the others read 0); the other gauges pass."""
    from actors.engine_channel import EngineChannel
    from rlasync.engine.base import EngineStats
    from rlasync.rollout.concurrency import ConcurrencyController

    engine = EngineStats(0.3, 5, 1, 0, 640, 64)
    channels = [EngineChannel(_StatsHandle(engine), counts_preemptions=i == 0) for i in range(4)]
    controllers = [ConcurrencyController(512, 640, 64) for _ in channels]

    async def look(total):
        for channel in channels:
            channel.handle.value = EngineStats(0.3, 5, 1, total, 640, 64)
        seen = [await channel.stats() for channel in channels]
        assert all(s.num_running == 5 and s.kv_cache_usage_frac == 0.3 for s in seen)
        items = [dict(c.observe(s, 0)) for c, s in zip(controllers, seen, strict=True)]
        return sum(i["rollout/vllm_preemption_count"] for i in items)

    async def main():
        return [await look(total) for total in (0, 256, 256, 768)]

    assert asyncio.run(main()) == [0.0, 256.0, 0.0, 512.0]  # the engine's own increases, not 4 x
