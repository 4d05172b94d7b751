"""What a run's actors ask of the Ray cluster, and the check that it can give it (before any actor starts)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

ActorRequests = dict[str, tuple[int, float, float]]
"""Per actor role: (count, CPUs each, GPUs each)."""


def actor_requests(cluster: Any) -> ActorRequests:
    """GRPO's roles, as the Cluster spawns them, from the config's `cluster` section."""
    c = cluster
    return {
        "generation": (c.num_generation_actors, c.generation_num_cpus, c.generation_num_gpus),
        "learner": (c.num_learners, c.learner_num_cpus, c.learner_num_gpus),
        "rollout": (c.num_rollout_actors, c.rollout_num_cpus, 0.0),
        "reward": (c.num_reward_actors, c.reward_num_cpus, 0.0),
        "queue": (1, c.queue_num_cpus, 0.0),
    }


def check_resources(requests: Mapping[str, tuple[int, float, float]], available: Mapping[str, float],
                    autoscaling: bool) -> None:  # fmt: skip
    """Compare what the actors ask for with what the Ray cluster has. On a local cluster this process started (it
    cannot grow) a shortfall is a `ValueError` naming the `cluster.*` fields to lower; on an existing cluster (it may
    autoscale) a warning: otherwise actors would wait for resources that never come."""
    need = {
        "CPU": sum(count * cpus for count, cpus, _ in requests.values()),
        "GPU": sum(count * gpus for count, _, gpus in requests.values()),
    }
    short = {kind: (need[kind], float(available.get(kind, 0.0))) for kind in need if need[kind] > available.get(kind, 0.0) + 1e-9}
    if not short:
        return
    field = {"CPU": "num_cpus", "GPU": "num_gpus"}
    parts = []
    for kind, (wanted, have) in short.items():
        roles = ", ".join(
            f"{count} {role} x {each[0 if kind == 'CPU' else 1]:g} (cluster.{role}_{field[kind]})"
            for role, (count, *each) in requests.items()
            if count and each[0 if kind == "CPU" else 1]
        )
        parts.append(f"{wanted:g} {kind}s but the Ray cluster has {have:g} ({roles})")
    message = "the actors ask for " + "; ".join(parts) + ": lower those fields or the actor counts"
    if autoscaling:
        logger.warning("%s, unless the cluster scales up", message)
    else:
        raise ValueError(message)


__all__ = ["ActorRequests", "actor_requests", "check_resources"]
