"""EnginePool's home engines (`place`): rollout actor m of N sends to engine m mod E when E divides N, to engines
m, m + N, ... when N divides E, else to every engine; a home engine whose request failed is passed over for a while;
the engines changing recomputes the home. `cluster.engine_placement` is checked."""

import asyncio

import pytest

from rlasync.config.base import ClusterConfig
from rlasync.engine.base import SamplingParams
from rlasync.rollout import engine_pool
from rlasync.rollout.engine_pool import home_engines
from tests.unit.rollout.test_engine_pool import Engine, pool
from tests.unit.rollout.test_engine_silence import Clock


@pytest.mark.parametrize(
    ("engines", "member", "members", "want"),
    [
        (4, 5, 8, [1]),  # two rollout actors an engine
        (4, 3, 4, [3]),
        (4, 1, 2, [1, 3]),  # two engines a rollout actor
        (6, 2, 3, [2, 5]),
        (4, 0, 1, [0, 1, 2, 3]),  # one rollout actor: every engine
        (4, 2, 6, [0, 1, 2, 3]),  # neither divides the other: every engine
        (3, 1, 2, [0, 1, 2]),
    ],
)
def test_home_engines_split_the_engines_evenly_or_not_at_all(engines, member, members, want):
    names = list(range(engines))
    assert home_engines(names, (member, members)) == want
    assert home_engines(names, None) == names
    # every engine is some member's home exactly as often as every other (the split is even)
    if want != names:
        counts = [0] * engines
        for m in range(members):
            for engine in home_engines(names, (m, members)):
                counts[engine] += 1
        assert len(set(counts)) == 1


def run_groups(p, groups, size=4, first_seed=0):
    async def scenario():
        await asyncio.gather(
            *(
                p.generate([1], SamplingParams(seed=first_seed + 10 * g + i), affinity=("g", first_seed, g))
                for g in range(groups)
                for i in range(size)
            )
        )

    asyncio.run(scenario())


def test_a_placed_pool_sends_only_to_its_home_engines():
    engines = [Engine(name) for name in "abcd"]
    p, _, _ = pool(engines)
    p.place(5, 8)  # rollout actor 5 of 8: engine 1
    run_groups(p, 6)
    assert [len(e.requests) for e in engines] == [0, 24, 0, 0]
    p.place(1, 2)  # rollout actor 1 of 2: engines 1 and 3, by load
    for engine in engines:
        engine.requests.clear()
    run_groups(p, 6, first_seed=100)  # new groups (a remembered group stays where it went)
    assert [len(e.requests) for e in engines] == [0, 12, 0, 12]
    p.place(None)  # every engine
    for engine in engines:
        engine.requests.clear()
    run_groups(p, 8, first_seed=200)
    assert all(len(e.requests) == 8 for e in engines)
    with pytest.raises(ValueError, match="member must be in"):
        p.place(8, 8)


def test_a_failing_home_engine_is_passed_over_until_its_cooldown_ends():
    clock = Clock()
    engines = [Engine("a"), Engine("b", fail=1), Engine("c")]
    p, _, slept = pool(engines, clock=clock)
    p.place(1, 3)  # home: b
    asyncio.run(p.generate([1], SamplingParams(seed=1), affinity="g0"))  # fails on b, retried elsewhere
    assert engines[1].requests == [1] and len(slept) == 1
    assert engines[0].requests + engines[2].requests == [1]
    run_groups(p, 2, first_seed=100)  # b is cooling down: new groups go to a and c
    assert engines[1].requests == [1]
    clock.now += engine_pool.FAILED_ENGINE_COOLDOWN_S
    run_groups(p, 2, first_seed=200)  # b is home again
    assert len(engines[1].requests) == 1 + 8


def test_the_home_follows_the_engines_when_they_change():
    engines = [Engine(name) for name in "abcd"]
    p, _, _ = pool(engines)
    p.place(1, 4)  # home: b
    assert p.home == [engines[1]]
    p.remove_engines([engines[3]])  # three engines for four rollout actors: uneven, so every engine
    assert p.home == engines[:3]
    p.add_engines([engines[3]])
    assert p.home == [engines[1]]
    p.remove_engines([engines[1]])  # the home engine left (and the split is uneven): every remaining engine
    run_groups(p, 3)
    assert engines[1].requests == [] and all(len(engines[i].requests) == 4 for i in (0, 2, 3))


def test_engine_placement_is_checked():
    assert ClusterConfig().engine_placement == "home"
    assert ClusterConfig(engine_placement="any").engine_placement == "any"
    with pytest.raises(ValueError, match=r"cluster\.engine_placement='least_loaded'.*\"home\" or \"any\""):
        ClusterConfig(engine_placement="least_loaded")
