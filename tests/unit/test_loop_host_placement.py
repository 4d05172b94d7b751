"""`actors.loop_host.LoopHost.place_engines`: a rollout actor places its loop's engine pool as member i of N (its home
engines); a member outside the pool (an actor added or restarted beyond the configured count) sends to every engine.
No Ray: the method only reaches the loop's pool."""

from types import SimpleNamespace

from actors.loop_host import LoopHost
from rlasync.rollout.engine_pool import EnginePool


def host_with(engines):
    pool = EnginePool(engines, max_concurrent=8, emit=lambda items: None, stats_interval_s=None)
    return SimpleNamespace(loop=SimpleNamespace(engine_pool=pool)), pool


def test_a_rollout_actor_places_its_pool_and_one_beyond_the_count_uses_every_engine():
    engines = ["e0", "e1", "e2", "e3"]
    host, pool = host_with(engines)
    LoopHost.place_engines(host, 6, 8)
    assert pool.home == ["e2"]
    LoopHost.place_engines(host, 9, 8)
    assert pool.home == engines
    LoopHost.place_engines(host, 1, 2)
    assert pool.home == ["e1", "e3"]
    LoopHost.place_engines(host, None)
    assert pool.home == engines
    LoopHost.place_engines(SimpleNamespace(loop=SimpleNamespace()), 0, 2)  # a loop without an engine pool: nothing
