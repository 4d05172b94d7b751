"""EnginePool with fake engines: least-loaded choice, retries with backoff (counted), stats feeding the
ConcurrencyController."""

import asyncio
import collections

import pytest

from rlasync.engine.base import EngineError, EngineStats, RequestRejectedError, SamplingParams
from rlasync.records import TurnRecord
from rlasync.rollout.engine_pool import RETRY_METRIC, EnginePool


class Engine:
    def __init__(self, name, fail=0, reject=False, stats=None):
        self.name, self.fail, self.reject, self._stats = name, fail, reject, stats
        self.gate = None
        self.requests = []

    async def generate(self, prompt_ids, sampling):
        self.requests.append(sampling.seed)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise EngineError(f"{self.name} hiccup")
        if self.reject:
            raise RequestRejectedError("too long")
        return TurnRecord(list(prompt_ids), [7], [-0.1])


def pool(engines, **kwargs):
    emitted, slept = [], []

    async def sleep(seconds):
        slept.append(seconds)

    p = EnginePool(engines, max_concurrent=kwargs.pop("max_concurrent", 8), emit=emitted.extend, sleep=sleep, **kwargs)
    return p, emitted, slept


def test_transient_errors_are_retried_with_backoff_counted_and_resent_unchanged():
    engine = Engine("a", fail=3)
    p, emitted, slept = pool([engine])
    turn = asyncio.run(p.generate([1, 2], SamplingParams(seed=5)))
    assert turn.output_ids == [7] and engine.requests == [5, 5, 5, 5]
    assert slept == [1.0, 2.0, 4.0] and emitted == [(RETRY_METRIC, 1.0)] * 3
    assert p.counters["generation_retries"] == 3


def test_the_last_attempt_and_a_rejected_request_propagate():
    p, emitted, _ = pool([Engine("a", fail=10)], max_attempts=2)
    with pytest.raises(EngineError):
        asyncio.run(p.generate([1], SamplingParams()))
    assert len(emitted) == 1
    p, emitted, _ = pool([Engine("a", reject=True)])
    with pytest.raises(RequestRejectedError):
        asyncio.run(p.generate([1], SamplingParams()))
    assert emitted == []


def test_any_call_goes_through_the_same_retry_path_counted_by_its_first_word():
    calls = collections.deque([EngineError("x"), "ok"])

    async def call():
        value = calls.popleft()
        if isinstance(value, Exception):
            raise value
        return value

    p, _, _ = pool([Engine("a")])
    assert asyncio.run(p.retrying("teacher math", call)) == "ok"
    assert p.counters["teacher_retries"] == 1


def load_while_held(engines, requests):
    """The pool's per-engine load once every request of `requests(pool)` (coroutines) was sent while the engines
    held them; then they are answered."""

    async def scenario():
        gate = asyncio.Event()
        for engine in engines:
            engine.gate = gate
        p, _, _ = pool(engines)
        tasks = [asyncio.create_task(request) for request in requests(p)]
        for _ in range(10):
            await asyncio.sleep(0)
        load = p.load
        gate.set()
        await asyncio.gather(*tasks)
        return load

    return asyncio.run(scenario())


def test_requests_go_to_the_least_loaded_engine_round_robin_on_ties():
    engines = [Engine("a"), Engine("b"), Engine("c")]
    load = load_while_held(engines, lambda p: [p.generate([1], SamplingParams(seed=i)) for i in range(7)])
    assert load == [3, 2, 2]


def test_stats_build_the_controller_and_lower_the_cap():
    stats = EngineStats(
        kv_cache_usage_frac=0.5,
        num_running=1,
        num_waiting=0,
        num_preemptions=0,
        kv_capacity_tokens=3 * 64,
        max_model_len=64,
    )

    class WithStats(Engine):
        def stats(self):
            return stats

    p, emitted, _ = pool([WithStats("a")], max_concurrent=8)
    assert p.cap is None
    asyncio.run(p.observe(0))
    assert p.cap == 3 and any(key == "rollout/concurrency_cap" for key, _ in emitted)


def test_engines_without_stats_disable_polling_and_none_never_polls():
    p, emitted, _ = pool([Engine("a")])
    asyncio.run(p.observe(0))
    assert p.stats_interval_s is None and p.cap is None and emitted == []
    quiet, emitted, _ = pool([Engine("a")], stats_interval_s=None)
    asyncio.run(quiet.observe(0))
    assert emitted == []
