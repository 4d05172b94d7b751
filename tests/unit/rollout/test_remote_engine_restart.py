"""A dead or restarting GenerationActor's failed call is a retryable EngineError for the EnginePool (the core never
sees a Ray error), and the retry lands on another engine or the restarted one."""

import asyncio
import collections

import pytest

ray_exceptions = pytest.importorskip("ray.exceptions")


class _Method:
    def __init__(self, outcomes):
        self.outcomes = outcomes

    def remote(self, *args):
        outcome = self.outcomes.popleft()

        async def call():
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        return call()


class _ActorId:
    def hex(self):
        return "ab" * 14


class FakeHandle:
    def __init__(self, *outcomes):
        self.generate = _Method(collections.deque(outcomes))
        self.stats = _Method(collections.deque(outcomes))
        self._actor_id = _ActorId()


def _pool(engines, slept):
    from rlasync.rollout.engine_pool import EnginePool

    async def sleep(seconds):
        slept.append(seconds)

    return EnginePool(engines, max_concurrent=4, emit=lambda items: None, stats_interval_s=None, sleep=sleep)


def test_an_engine_death_is_retried_on_the_restarted_engine():
    from actors.restart import RemoteEngine

    died = ray_exceptions.ActorUnavailableError("The actor is restarting", b"\x00" * 16)
    handle = FakeHandle(died, "tokens")
    slept = []
    pool = _pool([RemoteEngine(handle)], slept)
    assert asyncio.run(pool.retrying("generation", lambda: pool.engines[0].generate([1, 2], None))) == "tokens"
    assert slept == [1.0] and pool.counters["generation_retries"] == 1


def test_the_engine_error_names_the_dead_actor_and_keeps_the_cause():
    from actors.restart import RemoteEngine
    from rlasync.engine.base import EngineError

    dead = ray_exceptions.ActorDiedError()
    with pytest.raises(EngineError, match="generation actor abab.* failed: ActorDiedError") as info:
        asyncio.run(RemoteEngine(FakeHandle(dead)).generate([1], None))
    assert isinstance(info.value.__cause__, ray_exceptions.ActorDiedError)


def test_a_task_error_of_the_engine_itself_is_not_translated():
    from actors.restart import RemoteEngine

    with pytest.raises(ValueError, match="bad sampling"):
        asyncio.run(RemoteEngine(FakeHandle(ValueError("bad sampling"))).generate([1], None))
