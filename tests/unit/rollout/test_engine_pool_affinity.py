"""EnginePool's affinity: requests sharing a key (a GRPO group) go to the engine the key's first request went to,
chosen least-loaded; a failed request, an engine leaving the pool and the memory bound make the key choose again."""

import asyncio

from rlasync.engine.base import SamplingParams
from rlasync.rollout import engine_pool
from tests.unit.rollout.test_engine_pool import Engine, load_while_held, pool


async def settle():
    for _ in range(10):
        await asyncio.sleep(0)


def where(engines):
    """seed -> the name of the engine that received the request with that seed."""
    return {seed: engine.name for engine in engines for seed in engine.requests}


def test_a_groups_requests_go_to_one_engine_and_groups_spread_by_load():
    engines = [Engine("a"), Engine("b"), Engine("c")]
    load = load_while_held(
        engines,
        lambda p: [
            p.generate([1], SamplingParams(seed=10 * group + i), affinity=("g", group))
            for group in range(3)
            for i in range(4)
        ],
    )
    assert load == [4, 4, 4]  # one group an engine (least loaded at each group's first request)
    placed = where(engines)
    for group in range(3):
        assert len({placed[10 * group + i] for i in range(4)}) == 1
    # without a key the same requests spread (round robin on ties): the behaviour affinity replaces
    spread = [Engine("a"), Engine("b"), Engine("c")]
    p, _, _ = pool(spread)

    async def unkeyed():
        await asyncio.gather(*(p.generate([1], SamplingParams(seed=i)) for i in range(4)))

    asyncio.run(unkeyed())
    assert len({engine for engine in where(spread).values()}) == 3


def test_a_later_turn_follows_its_key_even_to_the_busier_engine():
    a, b = Engine("a"), Engine("b")

    async def scenario():
        a.gate = asyncio.Event()
        p, _, _ = pool([a, b])
        first = asyncio.ensure_future(p.generate([1], SamplingParams(seed=1), affinity=7))  # a (ties: round robin)
        await settle()
        await p.generate([1], SamplingParams(seed=2))  # unkeyed: b, the least loaded
        a.gate.set()
        await first
        a.gate = asyncio.Event()
        busy = asyncio.ensure_future(p.generate([1], SamplingParams(seed=3)))  # unkeyed: a
        await settle()
        a.gate.set()
        await p.generate([1, 2], SamplingParams(seed=4), affinity=7)  # key 7: a, though a is busier than b
        await busy

    asyncio.run(scenario())
    assert where([a, b]) == {1: "a", 2: "b", 3: "a", 4: "a"}


def test_a_failed_request_forgets_its_key_and_the_retry_chooses_again():
    a, b = Engine("a", fail=1), Engine("b")

    async def scenario():
        p, _, slept = pool([a, b])
        turn = await p.generate([1], SamplingParams(seed=2), affinity="k")  # a (ties: round robin): fails, retried
        await p.generate([1], SamplingParams(seed=3), affinity="k")
        return turn, slept

    turn, slept = asyncio.run(scenario())
    assert turn.output_ids == [7] and slept == [1.0]
    assert a.requests == [2] and b.requests == [2, 3]  # the retry chose b, and the key's next request followed it


def test_a_removed_engine_loses_its_keys_and_old_keys_are_forgotten():
    a, b = Engine("a"), Engine("b")

    async def scenario():
        p, _, _ = pool([a, b])
        await p.generate([1], SamplingParams(seed=1), affinity="x")  # a
        p.remove_engines([a])
        await p.generate([1], SamplingParams(seed=2), affinity="x")  # a left: b
        p.add_engines([a])
        await p.generate([1], SamplingParams(seed=3), affinity="x")  # stays on b
        return p

    p = asyncio.run(scenario())
    assert where([a, b]) == {1: "a", 2: "b", 3: "b"}
    old, engine_pool.AFFINITY_MEMORY = engine_pool.AFFINITY_MEMORY, 2
    try:

        async def memory():
            for key in range(5):
                await p.generate([1], SamplingParams(seed=100 + key), affinity=("m", key))

        asyncio.run(memory())
        assert list(p._affinity) == [("m", 3), ("m", 4)]  # the two most recent keys: "x" and the older ones gone
    finally:
        engine_pool.AFFINITY_MEMORY = old
