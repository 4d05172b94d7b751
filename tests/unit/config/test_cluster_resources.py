"""cluster.resources: custom Ray resources per actor role (which group of nodes a role runs on), checked once."""

import pytest

from rlasync.config import AsyncGRPOConfig
from rlasync.config.base import ClusterConfig


def test_resources_per_role_are_kept_as_floats_and_read_per_role():
    cluster = ClusterConfig(resources={"learner": {"learner_node": 1}, "generation": {"generation_node": 0.5}})
    assert cluster.role_resources("learner") == {"learner_node": 1.0}
    assert cluster.role_resources("generation") == {"generation_node": 0.5}
    assert cluster.role_resources("rollout") == {}
    assert ClusterConfig().role_resources("learner") == {}


def test_resources_from_a_json_string_as_the_cli_sets_them():
    config = AsyncGRPOConfig(output_dir="unused", max_steps=1, cluster={"resources": '{"queue": {"head_node": 1}}'})
    assert config.cluster.role_resources("queue") == {"head_node": 1.0}
    assert config.to_dict()["cluster"]["resources"] == {"queue": {"head_node": 1.0}}


@pytest.mark.parametrize(
    "resources, match",
    [
        ({"learners": {"x": 1}}, r"cluster\.resources\.learners: unknown role; the roles are learner, generation"),
        ({"learner": 1}, r"cluster\.resources\.learner=1: must be a dict"),
        ({"learner": {"GPU": 1}}, r"cluster\.resources\.learner\.GPU: CPUs and GPUs are cluster\.learner_num_gpus"),
        ({"rollout": {"node": -1}}, r"cluster\.resources\.rollout\.node=-1: must be a number >= 0"),
        ({"rollout": {"node": True}}, r"cluster\.resources\.rollout\.node=True: must be a number"),
        ([1], r"cluster\.resources=\[1\]: must be a dict"),
        ("{not json", r"cluster\.resources: .* is not valid JSON"),
    ],
)
def test_bad_resources_name_the_field_and_the_fix(resources, match):
    with pytest.raises(ValueError, match=match):
        ClusterConfig(resources=resources)
