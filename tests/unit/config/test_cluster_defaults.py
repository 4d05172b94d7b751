"""cluster.num_rollout_actors left unset: 1 with CPU engines, 4 per generation actor with GPU engines."""

import pytest

from rlasync.config.base import ClusterConfig


def test_rollout_actors_follow_the_engines_unless_set():
    assert ClusterConfig().num_rollout_actors == 1
    assert ClusterConfig(generation_num_gpus=1).num_rollout_actors == 4
    assert ClusterConfig(generation_num_gpus=0.5, num_generation_actors=2).num_rollout_actors == 8
    assert ClusterConfig(generation_num_gpus=1, num_rollout_actors=2).num_rollout_actors == 2  # set: kept
    with pytest.raises(ValueError, match="cluster.num_rollout_actors"):
        ClusterConfig(num_rollout_actors=0)


def test_the_generation_stall_watchdog_is_off_unless_given_seconds_above_zero():
    from rlasync.config.load import load_config

    assert ClusterConfig().generation_stall_s is None
    assert load_config(overrides=["cluster.generation_stall_s=0.1"]).cluster.generation_stall_s == 0.1
    for bad in (0, -1.0, True):
        with pytest.raises(ValueError, match=r"cluster.generation_stall_s=.*must be > 0 seconds"):
            ClusterConfig(generation_stall_s=bad)


def test_the_gil_switch_interval_is_pythons_unless_given_seconds_in_range():
    from rlasync.config.load import load_config

    assert ClusterConfig().gil_switch_interval_s is None
    config = load_config(overrides=["cluster.gil_switch_interval_s=0.0005"])
    assert config.cluster.gil_switch_interval_s == 0.0005
    for bad in (0, -0.001, 0.5, True):
        with pytest.raises(ValueError, match=r"cluster.gil_switch_interval_s=.*must be in \(0, 0.1\] seconds"):
            ClusterConfig(gil_switch_interval_s=bad)


def test_copy_events_are_on_unless_turned_off_and_reach_the_transport_plan():
    from rlasync.config.load import load_config
    from rlasync.weights.transport import choose_transport

    assert ClusterConfig().weight_sync_copy_events is True
    off = load_config(overrides=["cluster.weight_sync_copy_events=false"]).cluster
    assert off.weight_sync_copy_events is False
    for bad in ("no", 0, None):
        with pytest.raises(ValueError, match=r"cluster.weight_sync_copy_events=.*must be true or false"):
            ClusterConfig(weight_sync_copy_events=bad)
    where = {"device": "cpu", "node": "n0", "gpu": None}
    for flag in (True, False):
        plan, _ = choose_transport(where, [where], "ipc", host="h", port=1, timeout_s=1.0, copy_events=flag)
        assert plan.copy_events is flag
