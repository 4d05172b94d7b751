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
