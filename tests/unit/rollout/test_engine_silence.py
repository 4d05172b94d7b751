"""Blame for a frozen engine (issue 34): the pool records when each engine last answered, a stats call that never
returns does not freeze the loop, and the driver's pure helpers name the silent engine with when it last answered."""

import asyncio

from rlasync.driver.watchdog import engine_silence, silent_engines
from rlasync.engine.base import EngineStats, SamplingParams
from rlasync.records import TurnRecord
from rlasync.rollout.engine_pool import EnginePool


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Engine:
    def __init__(self, name, frozen=False):
        self.name, self.frozen = name, frozen

    async def generate(self, prompt_ids, sampling):
        if self.frozen:
            await asyncio.Event().wait()
        return TurnRecord(list(prompt_ids), [7], [-0.1])

    async def stats(self):
        if self.frozen:
            await asyncio.Event().wait()
        return EngineStats(
            kv_cache_usage_frac=0.0,
            num_running=0,
            num_waiting=0,
            num_preemptions=0,
            kv_capacity_tokens=256,
            max_model_len=64,
        )


def test_the_report_says_when_each_engine_last_answered_and_how_many_requests_wait_on_it():
    clock = Clock()
    alive, frozen = Engine("generation actor 0"), Engine("generation actor 1", frozen=True)
    pool = EnginePool([alive, frozen], max_concurrent=4, emit=lambda items: None, clock=clock)

    async def run():
        await pool._on_engine([1], SamplingParams(), None)  # the least loaded: engine 0 answers
        clock.now += 30.0
        stuck = asyncio.ensure_future(pool._on_engine([1], SamplingParams(), None))  # engine 1 (less loaded now)
        await asyncio.sleep(0)
        clock.now += 12.0
        report = pool.answer_report()
        stuck.cancel()
        return report

    report = asyncio.run(run())
    assert report == [
        {"name": "generation actor 0", "inflight": 0, "answered_age_s": 42.0, "joined_age_s": 42.0},
        {"name": "generation actor 1", "inflight": 1, "answered_age_s": None, "joined_age_s": 42.0},
    ]


def test_a_stats_call_that_never_returns_is_given_up_and_the_loop_goes_on(caplog):
    pool = EnginePool(
        [Engine("generation actor 0", frozen=True)],
        max_concurrent=4,
        emit=lambda items: None,
        stats_interval_s=0.0,
        stats_timeout_s=0.05,
    )

    async def observe():
        await asyncio.wait_for(pool.observe(0), 5.0)  # would hang forever without the stats timeout

    asyncio.run(observe())
    assert pool.cap is None  # no stats: the cap stays
    assert "generation actor 0 did not answer a stats call within 0.05 s" in caplog.text
    assert pool.answer_report()[0]["answered_age_s"] is None


def test_an_answered_stats_call_counts_as_an_answer():
    clock = Clock()
    pool = EnginePool([Engine("e")], max_concurrent=4, emit=lambda items: None, stats_interval_s=0.0, clock=clock)
    asyncio.run(pool.observe(0))
    clock.now += 3.0
    assert pool.answer_report()[0]["answered_age_s"] == 3.0 and pool.cap is not None


def health(*engines):
    return {"engines": [dict(zip(("name", "inflight", "answered_age_s", "joined_age_s"), e)) for e in engines]}


def test_an_engine_is_silent_only_when_no_rollout_actor_heard_from_it_within_the_bound_and_requests_wait():
    healths = [
        ("rollout actor 0", health(("generation actor 0", 2, 50.0, 60.0), ("generation actor 1", 1, 50.0, 60.0))),
        ("rollout actor 1", health(("generation actor 0", 1, 9.0, 60.0), ("generation actor 1", 0, None, 70.0))),
        ("rollout actor 2", health(("generation actor 2", 0, None, 90.0))),
    ]
    seen = engine_silence(healths)
    assert seen["generation actor 0"] == {"answered_age_s": 9.0, "silent_s": 9.0, "inflight": 3}  # the newest answer
    assert seen["generation actor 1"] == {"answered_age_s": 50.0, "silent_s": 50.0, "inflight": 1}
    assert seen["generation actor 2"] == {"answered_age_s": None, "silent_s": 90.0, "inflight": 0}
    # engine 0 answered actor 1 recently; engine 2 has nothing to answer; engine 1 is silent past the bound
    assert silent_engines(healths, bound_s=20.0) == ["generation actor 1"]
    assert silent_engines(healths, bound_s=60.0) == []
    never = [("rollout actor 0", health(("generation actor 3", 4, None, 31.0)))]
    assert silent_engines(never, bound_s=30.0) == ["generation actor 3"]  # never answered since it joined


def test_the_frozen_engine_error_says_when_it_last_answered(tmp_path):
    from actors.cluster_faults import answered_text, frozen_error

    at = {"generation actor 0": 1_000_000.0, "generation actor 1": None}
    assert answered_text("generation actor 0", at, now=1_000_042.0) == "; it last answered 42 s ago (13:46:40 UTC)"
    assert answered_text("generation actor 1", at) == "; no rollout actor has had an answer from it"
    assert answered_text("generation actor 2", at) == answered_text("generation actor 0", None) == ""  # not known
    message = str(
        frozen_error("generation actor 0", "rollout actor 0", tmp_path, 10.0, answered_text("x", {"x": None}))
    )
    assert message.startswith("generation actor 0 made no progress: it did not answer a stats call within 10 s")
    assert "no rollout actor has had an answer from it; no complete checkpoint in" in message
