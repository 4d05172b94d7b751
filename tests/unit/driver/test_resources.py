"""check_resources: what the actors ask for against what the Ray cluster has."""

import pytest

from rlasync.config import AsyncGRPOConfig
from rlasync.driver import actor_requests, check_resources


def test_resources_the_actors_cannot_get_are_an_error_on_a_local_cluster_and_a_warning_elsewhere(caplog):
    requests = {
        "generation": (1, 0.5, 1.0),
        "learner": (2, 0.5, 1.0),
        "rollout": (1, 0.25, 0.0),
        "queue": (1, 0.1, 0.0),
    }
    check_resources(requests, {"CPU": 2.0, "GPU": 3.0}, autoscaling=False)  # 1.85 CPUs, 3 GPUs: fits
    with pytest.raises(ValueError, match=r"3 GPUs but the Ray cluster has 1 .*cluster\.learner_num_gpus"):
        check_resources(requests, {"CPU": 2.0, "GPU": 1.0}, autoscaling=False)
    with caplog.at_level("WARNING"):
        check_resources(requests, {"CPU": 1.0}, autoscaling=True)
    assert "1.85 CPUs but the Ray cluster has 1" in caplog.text and "unless the cluster scales up" in caplog.text


def test_actor_requests_follow_the_cluster_section():
    config = AsyncGRPOConfig(output_dir="unused", max_steps=1)
    config.cluster.num_learners = 2
    requests = actor_requests(config.cluster)
    assert requests["learner"] == (2, config.cluster.learner_num_cpus, config.cluster.learner_num_gpus)
    assert set(requests) == {"generation", "learner", "rollout", "reward", "queue"}


def test_an_actor_that_fits_on_no_node_is_refused_though_the_total_fits():
    requests = {"learner": (1, 1.0, 2.0), "generation": (1, 1.0, 1.0)}  # 3 GPUs in all, one actor needs 2 at once
    nodes = [{"CPU": 8.0, "GPU": 1.0}] * 3
    with pytest.raises(ValueError, match=r"learner 0 \(2 GPUs, 1 CPUs\) fits on no node"):
        check_resources(requests, {"CPU": 24.0, "GPU": 3.0}, autoscaling=False, nodes=nodes)
    check_resources(
        requests, {"CPU": 24.0, "GPU": 3.0}, autoscaling=False, nodes=[{"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 1}]
    )


def test_too_few_gpus_names_a_shared_layout_that_fits():
    """Distillation on one GPU: learner, student engine and teacher each asking for a whole GPU."""
    requests = {"learner": (1, 1.0, 1.0), "generation": (1, 1.0, 1.0), "teacher": (1, 1.0, 1.0), "queue": (1, 0.1, 0.0)}
    with pytest.raises(ValueError) as info:
        check_resources(requests, {"CPU": 16.0, "GPU": 1.0}, autoscaling=False, nodes=[{"CPU": 16.0, "GPU": 1.0}])
    message = str(info.value)
    assert "3 GPUs but the Ray cluster has 1" in message
    hint = message.split("this layout fits: ")[1]
    # a local teacher's GPUs are set by generation_num_gpus (there is no teacher_num_gpus): named once
    assert hint == "cluster.learner_num_gpus=0.33, cluster.generation_num_gpus=0.33"
    shared = {role: (count, cpus, 0.33 if gpus else 0.0) for role, (count, cpus, gpus) in requests.items()}
    check_resources(shared, {"CPU": 16.0, "GPU": 1.0}, autoscaling=False, nodes=[{"CPU": 16.0, "GPU": 1.0}])  # fits


def test_custom_resources_no_node_has_are_an_error_on_a_local_cluster_and_a_warning_elsewhere(caplog):
    from rlasync.driver.resources import check_custom_resources

    nodes = [{"CPU": 1.0, "head_node": 1.0}, {"CPU": 1.0, "learner_node": 1.0}, {"CPU": 2.0, "generation_node": 1.0}]
    fits = {
        "learner": {"learner_node": 1.0},
        "generation": {"generation_node": 0.5},
        "rollout": {"generation_node": 0.5},
    }
    check_custom_resources(fits, {"learner": 1, "generation": 1, "rollout": 1}, nodes, autoscaling=False)
    with pytest.raises(ValueError, match=r"cluster\.resources\.learner\.gpu_node=1: no node has 1 'gpu_node'"):
        check_custom_resources({"learner": {"gpu_node": 1.0}}, {"learner": 1}, nodes, autoscaling=False)
    with pytest.raises(ValueError, match=r"2 learner actors x 1 need 2 'learner_node' but the nodes have 1 in all"):
        check_custom_resources({"learner": {"learner_node": 1.0}}, {"learner": 2}, nodes, autoscaling=False)
    check_custom_resources({"reward": {"gpu_node": 1.0}}, {"reward": 0}, nodes, autoscaling=False)  # no actor: fine
    with caplog.at_level("WARNING"):
        check_custom_resources({"generation": {"generation_node": 2.0}}, {}, nodes, autoscaling=True)
    assert "no node has 2 'generation_node'" in caplog.text and "unless the cluster scales up" in caplog.text
