"""The elastic pools' pure side: the policy's decisions, user resize requests, the StepLoop hook's controller, the
config bounds (rlasync.driver.elastic, ClusterConfig)."""

import asyncio
import threading

import pytest

from rlasync.config.base import ClusterConfig
from rlasync.driver.elastic import (
    ElasticBounds,
    ElasticController,
    ElasticPolicy,
    ElasticPolicySettings,
    ResizeRequests,
    Sizes,
)

BOUNDS = ElasticBounds(generation=(1, 3), rollout=(1, 2))


def window(wait, step_s=1.0, kv=0.0, queued=0.0):
    return {
        "perf/rollout_wait_s": wait,
        "perf/step_s": step_s,
        "rollout/vllm_kv_cache_usage_frac": kv,
        "rollout/vllm_queued_requests": queued,
    }


def policy(interval=5):
    return ElasticPolicy(BOUNDS, ElasticPolicySettings(interval_steps=interval))


@pytest.mark.parametrize(
    "metrics, sizes, expected",
    [
        (window(0.8, kv=0.95), Sizes(1, 1), Sizes(2, 1)),  # waiting, engines saturated: one more engine
        (window(0.8, queued=3), Sizes(1, 1), Sizes(2, 1)),  # queued requests are saturation too
        (window(0.8, kv=0.2), Sizes(1, 1), Sizes(1, 2)),  # waiting, engines with room: one more rollout actor
        (window(0.8, kv=0.2), Sizes(1, 2), Sizes(2, 2)),  # rollout pool full: an engine instead
        (window(0.8, kv=0.95), Sizes(3, 1), Sizes(3, 2)),  # engine pool full: a rollout actor instead
        (window(0.8, kv=0.95), Sizes(3, 2), None),  # both full
        (window(0.0), Sizes(2, 2), Sizes(1, 2)),  # the learner is the bottleneck: an engine less first
        (window(0.0, kv=0.95), Sizes(2, 2), Sizes(2, 1)),  # saturated engines stay: a rollout actor less
        (window(0.0), Sizes(1, 1), None),  # at the minimum
        (window(0.2), Sizes(2, 2), None),  # in the dead band
    ],
)
def test_the_policy_adds_where_the_bottleneck_is_and_removes_down_to_the_minimum(metrics, sizes, expected):
    assert policy().decide(5, metrics, sizes) == expected


def test_the_policy_decides_only_every_interval_and_keeps_quiet_after_a_change():
    p = policy(interval=5)
    busy = window(0.9, kv=0.9)
    assert [p.decide(step, busy, Sizes(1, 1)) for step in (1, 2, 3, 4)] == [None] * 4
    assert p.decide(5, busy, Sizes(1, 1)) == Sizes(2, 1)
    assert p.decide(10, busy, Sizes(2, 1)) is None  # the window at step 10 still holds steps of the old size
    assert p.decide(15, busy, Sizes(2, 1)) == Sizes(3, 1)


@pytest.mark.parametrize("metrics", [{}, {"perf/rollout_wait_s": 3.0}, window(3.0, step_s=0.0)])
def test_the_policy_needs_a_measured_step(metrics):
    assert policy().decide(5, metrics, Sizes(1, 1)) is None


class FakePools:
    def __init__(self, sizes):
        self.current, self.calls = sizes, []

    def sizes(self):
        return self.current

    async def resize(self, target):
        self.calls.append(target)
        self.current = target
        return [("elastic/resize_s", 0.5)]


def test_a_resize_request_from_another_thread_is_applied_after_the_next_step_and_the_newest_wins():
    pools, requests = FakePools(Sizes(1, 1)), ResizeRequests(BOUNDS)
    controller = ElasticController(pools, requests, policy=None)
    worker = threading.Thread(
        target=lambda: (requests.request(generation=3), requests.request(generation=2, rollout=2))
    )
    worker.start()
    worker.join()
    items = asyncio.run(controller.after_step(1, {}))
    assert pools.calls == [Sizes(2, 2)]
    assert dict(items) == {"elastic/resize_s": 0.5, "elastic/generation_actors": 2.0, "elastic/rollout_actors": 2.0}
    assert dict(asyncio.run(controller.after_step(2, {}))) == {
        "elastic/generation_actors": 2.0,
        "elastic/rollout_actors": 2.0,
    }
    assert pools.calls == [Sizes(2, 2)]  # nothing asked: nothing done


def test_the_controller_runs_the_policy_when_there_is_no_request():
    pools = FakePools(Sizes(1, 1))
    controller = ElasticController(pools, ResizeRequests(BOUNDS), policy=policy(interval=1))
    asyncio.run(controller.after_step(1, window(0.9, kv=0.9)))
    assert pools.calls == [Sizes(2, 1)]


@pytest.mark.parametrize(
    "kwargs, field",
    [({"generation": 4}, "generation"), ({"rollout": 0}, "rollout"), ({"generation": 1.5}, "generation")],
)
def test_a_request_out_of_bounds_names_the_fields(kwargs, field):
    with pytest.raises(ValueError, match=f"cluster.min_{field}_actors / cluster.max_{field}_actors"):
        ResizeRequests(BOUNDS).request(**kwargs)
    with pytest.raises(ValueError, match="generation=N"):
        ResizeRequests(BOUNDS).request()


def test_cluster_bounds_default_to_the_starting_size_and_are_checked():
    assert ElasticBounds.from_cluster(ClusterConfig(num_generation_actors=2)) == ElasticBounds((1, 2), (1, 1))
    assert ClusterConfig(elastic=True, max_generation_actors=3).pool_bounds("generation") == (1, 3)
    with pytest.raises(ValueError, match="neither pool can change size"):
        ClusterConfig(elastic=True)
    with pytest.raises(ValueError, match=r"cluster.max_rollout_actors=1 < cluster.num_rollout_actors=2"):
        ClusterConfig(num_rollout_actors=2, max_rollout_actors=1)
    with pytest.raises(ValueError, match=r"cluster.min_generation_actors=3 > cluster.num_generation_actors=1"):
        ClusterConfig(min_generation_actors=3)
    with pytest.raises(ValueError, match="cluster.elastic_interval_steps=0"):
        ClusterConfig(elastic_interval_steps=0)
    with pytest.raises(ValueError, match="cluster.elastic='yes'"):
        ClusterConfig(elastic="yes")


def test_the_step_loop_calls_the_hook_after_every_step_and_logs_the_pool_sizes(tmp_path):
    from tests.unit.driver.test_step_loop import make_loop, run

    loop, _, sink = make_loop(tmp_path, horizon=3)
    pools, requests = FakePools(Sizes(1, 1)), ResizeRequests(BOUNDS)
    seen = []

    class Hook(ElasticController):
        async def after_step(self, step, metrics):
            seen.append((step, "perf/rollout_wait_s" in metrics))
            items = await super().after_step(step, metrics)
            if step == 1:  # as a callback or another thread would, between two steps
                self.requests.request(generation=3)
            return items

    loop.elastic = Hook(pools, requests)
    run(loop)
    assert seen == [(1, True), (2, True), (3, True)] and pools.calls == [Sizes(3, 1)]  # asked at 1, applied at 2
    records = {step: record for step, record in sink.records}
    assert records[1]["elastic/generation_actors"] == 1.0 and records[2]["elastic/generation_actors"] == 3.0
    assert records[2]["elastic/resize_s"] == 0.5 and "elastic/resize_s" not in records[3]
