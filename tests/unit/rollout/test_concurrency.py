"""The adaptive concurrency cap (docs/algorithms.md §2.3.2): initial value, +25 % / -30 % rules, clamps, gauges."""

import pytest

from rlasync.engine.base import EngineStats
from rlasync.rollout.concurrency import ConcurrencyController


def stats(kv=0.5, running=0, waiting=0, preemptions=0, capacity=64 * 10, max_model_len=64):
    return EngineStats(kv, running, waiting, preemptions, capacity, max_model_len)


def gauges(items):
    return dict(items)


@pytest.mark.parametrize(
    ("max_concurrent", "capacity", "max_model_len", "expected"),
    [(512, 640, 64, 10), (4, 640, 64, 4), (512, 10, 64, 1), (512, 0, 64, 512), (512, None, None, 512)],
)
def test_initial_cap_is_what_fits_in_the_kv_cache_clamped(max_concurrent, capacity, max_model_len, expected):
    assert ConcurrencyController(max_concurrent, capacity, max_model_len).cap == expected


def test_initial_cap_from_several_engines_sums_their_capacity():
    controller = ConcurrencyController.from_stats(512, [stats(capacity=640), stats(capacity=320)])
    assert controller.cap == 15


def test_increase_waits_for_a_caps_worth_of_completions_since_the_last_increase():
    controller = ConcurrencyController(512, 640, 64)  # cap 10
    controller.observe(stats(kv=0.1), completed_rollouts=9)
    assert controller.cap == 10
    controller.observe(stats(kv=0.1), completed_rollouts=10)
    assert controller.cap == 12  # floor(1.25 * 10)
    controller.observe(stats(kv=0.1), completed_rollouts=21)
    assert controller.cap == 12  # only 11 since the last increase
    controller.observe(stats(kv=0.1), completed_rollouts=22)
    assert controller.cap == 15


def test_small_caps_grow_by_at_least_one_and_never_past_the_maximum():
    controller = ConcurrencyController(6, 128, 64)  # cap 2
    controller.observe(stats(kv=0.0), completed_rollouts=2)
    assert controller.cap == 3  # floor(2.5) = 2, so + 1
    for completed in (10, 20, 30, 40):
        controller.observe(stats(kv=0.0), completed_rollouts=completed)
    assert controller.cap == 6


@pytest.mark.parametrize(("kv", "waiting"), [(0.6, 0), (0.7, 0), (0.8, 0), (0.1, 1)])
def test_no_increase_at_moderate_load_or_with_waiting_requests(kv, waiting):
    controller = ConcurrencyController(512, 640, 64)
    controller.observe(stats(kv=kv, waiting=waiting), completed_rollouts=1000)
    assert controller.cap == 10


def test_high_kv_usage_cuts_the_cap_by_30_percent_down_to_one():
    controller = ConcurrencyController(512, 640, 64)
    controller.observe(stats(kv=0.81), completed_rollouts=0)
    assert controller.cap == 7
    for _ in range(10):
        controller.observe(stats(kv=0.95), completed_rollouts=0)
    assert controller.cap == 1


def test_kv_usage_is_the_busiest_engine_and_counts_are_summed():
    controller = ConcurrencyController(512, 640, 64)
    items = gauges(
        controller.observe(
            [stats(kv=0.2, running=3, waiting=1, preemptions=5), stats(kv=0.9, running=4, waiting=2, preemptions=1)],
            completed_rollouts=0,
        )
    )
    assert items == {
        "rollout/concurrency_cap": 7.0,  # the 0.9 engine decides
        "rollout/vllm_kv_cache_usage_frac": 0.9,
        "rollout/vllm_running_requests": 7.0,
        "rollout/vllm_queued_requests": 3.0,
        "rollout/vllm_preemption_count": 0.0,  # the first observation sets the baseline
    }


def test_preemptions_are_reported_as_increases_since_the_previous_observation():
    controller = ConcurrencyController(512, 640, 64)
    deltas = [
        gauges(controller.observe(stats(preemptions=total), 0))["rollout/vllm_preemption_count"]
        for total in (4, 4, 10, 3)
    ]
    # the first look sets the baseline (a restarted rollout actor does not report the engines' history); a counter
    # that went down (engine restart) restarts it
    assert deltas == [0.0, 0.0, 6.0, 0.0]


def test_no_stats_keeps_the_cap():
    controller = ConcurrencyController(512, 640, 64)
    assert gauges(controller.observe([], 100)) == {"rollout/concurrency_cap": 10.0}


def test_the_eager_step_share_is_reported_over_the_steps_since_the_previous_observation():
    """`rollout/engine_eager_step_frac`: summed over the engines that count eager steps, over the steps since the
    previous look; nothing at the first look, when no step ran, after a restart, or from engines that do not count."""

    def counted(steps, eager):
        return EngineStats(0.5, 0, 0, 0, 640, 64, extra={"num_steps": float(steps), "num_eager_steps": float(eager)})

    controller = ConcurrencyController(512, 640, 64)
    observed = [
        gauges(controller.observe(looks, 0)).get("rollout/engine_eager_step_frac")
        for looks in (
            [counted(10, 2), counted(0, 0)],  # the first look: the baseline
            [counted(40, 2), counted(10, 10)],  # 40 steps since, 10 of them eager
            [counted(40, 2), counted(10, 10)],  # no step since
            [counted(5, 1), counted(10, 10)],  # an engine restarted: its counters went back
            [counted(9, 1), counted(12, 10)],  # 6 steps, none eager
        )
    ]
    assert observed == [None, 0.25, None, None, 0.0]
    plain = ConcurrencyController(512, 640, 64)
    for _ in range(3):  # vLLM, or the built-in engine without CUDA graphs: no such counts, no gauge
        assert "rollout/engine_eager_step_frac" not in gauges(plain.observe([stats()], 0))


def test_the_fused_layers_share_counts_the_engines_that_report_it():
    def engine(fused=None):
        return EngineStats(0.5, 0, 0, 0, 640, 64, extra={} if fused is None else {"fused_layers": float(fused)})

    controller = ConcurrencyController(512, 640, 64)
    assert gauges(controller.observe([engine(True), engine(False)], 0))["rollout/engine_fused_layers_frac"] == 0.5
    assert gauges(controller.observe([engine(True), engine()], 0))["rollout/engine_fused_layers_frac"] == 1.0
    assert "rollout/engine_fused_layers_frac" not in gauges(controller.observe([engine()], 0))  # vLLM: no gauge


def test_the_longest_launch_is_the_largest_any_engine_reports():
    def engine(launch_max_s=None):
        extra = {} if launch_max_s is None else {"launch_max_s": launch_max_s}
        return EngineStats(0.5, 0, 0, 0, 640, 64, extra=extra)

    controller = ConcurrencyController(512, 640, 64)
    assert gauges(controller.observe([engine(0.02), engine(0.31), engine()], 0))["rollout/engine_launch_max_s"] == 0.31
    assert "rollout/engine_launch_max_s" not in gauges(controller.observe([engine()], 0))  # vLLM: no gauge
