"""EnginePool with engines joining and leaving (elastic pools): a removed engine gets no new request, its request in
flight finishes and is counted, a new one takes requests, the last engine cannot leave."""

import asyncio

import pytest

from rlasync.engine.base import SamplingParams
from tests.unit.rollout.test_engine_pool import Engine, pool


def test_engines_join_and_leave_while_requests_run():
    async def scenario():
        a, b = Engine("a"), Engine("b")
        a.gate = asyncio.Event()
        p, _, _ = pool([a])
        slow = asyncio.ensure_future(p.generate([1], SamplingParams(seed=1)))
        await asyncio.sleep(0)
        assert p.inflight_on(a) == 1 and p.load == [1]
        p.add_engines([b])
        p.add_engines([b])  # already there: no duplicate
        assert p.engines == [a, b] and p.load == [1, 0]
        await p.generate([2], SamplingParams(seed=2))  # least loaded: b
        assert b.requests == [2] and p.served(b) == 1
        p.remove_engines([a])
        assert p.engines == [b] and p.oldest_request()["engine"] == -1  # a's request runs on, a has left
        for seed in (3, 4, 5):
            await p.generate([3], SamplingParams(seed=seed))
        assert a.requests == [1] and b.requests == [2, 3, 4, 5]  # nothing new went to a
        a.gate.set()
        await slow
        assert p.inflight_on(a) == 0 and p.served(a) == 1 and p.served(b) == 4
        with pytest.raises(ValueError, match="at least one engine"):
            p.remove_engines([b])

    asyncio.run(scenario())
