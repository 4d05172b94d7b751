"""What a run's actors ask of the Ray cluster, and the check that it can give it (before any actor starts)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
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
        "reward": (c.num_reward_actors, c.reward_num_cpus, c.reward_num_gpus),
        "queue": (1, c.queue_num_cpus, 0.0),
    }


def check_resources(
    requests: Mapping[str, tuple[int, float, float]],
    available: Mapping[str, float],
    autoscaling: bool,
    nodes: Sequence[Mapping[str, float]] | None = None,
) -> None:
    """Compare what the actors ask for with what the Ray cluster has, before any actor starts. A cluster that cannot
    grow (a local one this process started, or an existing one without an autoscaler) that falls short, in total
    or because some actor fits on no node (`nodes`: each node's CPU/GPU), is a `ValueError` naming the `cluster.*`
    fields to change and, for GPUs, a layout that fits; on an autoscaling cluster a warning (it may scale up)."""
    need = {
        "CPU": sum(count * cpus for count, cpus, _ in requests.values()),
        "GPU": sum(count * gpus for count, _, gpus in requests.values()),
    }
    short = {
        kind: (need[kind], float(available.get(kind, 0.0)))
        for kind in need
        if need[kind] > available.get(kind, 0.0) + 1e-9
    }
    field = {"CPU": "num_cpus", "GPU": "num_gpus"}
    parts = []
    for kind, (wanted, have) in short.items():
        roles = ", ".join(
            f"{count} {role} x {each[0 if kind == 'CPU' else 1]:g} (cluster.{role}_{field[kind]})"
            for role, (count, *each) in requests.items()
            if count and each[0 if kind == "CPU" else 1]
        )
        parts.append(f"{wanted:g} {kind}s but the Ray cluster has {have:g} ({roles})")
    if parts:
        message = "the actors ask for " + "; ".join(parts) + ": lower those fields or the actor counts"
        if "GPU" in short:
            message += gpu_layout_hint(requests, float(available.get("GPU", 0.0)))
    elif nodes:
        unplaced = first_fit(requests, nodes)
        if unplaced is None:
            return
        message = (
            f"{unplaced} fits on no node of the Ray cluster (nodes have "
            + ", ".join(f"{n.get('CPU', 0):g} CPUs/{n.get('GPU', 0):g} GPUs" for n in nodes)
            + "): an actor's cluster.*_num_cpus / *_num_gpus must fit on one node"
        )
    else:
        return
    if autoscaling:
        logger.warning("%s, unless the cluster scales up", message)
    else:
        raise ValueError(message)


def first_fit(requests: Mapping[str, tuple[int, float, float]], nodes: Sequence[Mapping[str, float]]) -> str | None:
    """Place every actor on a node, largest GPU (then CPU) demand first, on the first node with room (as Ray's
    scheduler would, roughly); the first actor that fits nowhere ("learner 1 (2 GPUs, 1 CPU)"), else None."""
    free = [{"CPU": float(n.get("CPU", 0.0)), "GPU": float(n.get("GPU", 0.0))} for n in nodes]
    actors = [(gpus, cpus, role, i) for role, (count, cpus, gpus) in requests.items() for i in range(count)]
    for gpus, cpus, role, i in sorted(actors, key=lambda a: (-a[0], -a[1])):
        for node in free:
            if node["GPU"] + 1e-9 >= gpus and node["CPU"] + 1e-9 >= cpus:
                node["GPU"] -= gpus
                node["CPU"] -= cpus
                break
        else:
            return f"{role} {i} ({gpus:g} GPUs, {cpus:g} CPUs)"
    return None


def gpu_layout_hint(requests: Mapping[str, tuple[int, float, float]], gpus: float) -> str:
    """A layout that fits the GPU roles into `gpus` GPUs by sharing: each GPU actor an equal fraction."""
    users = [(role, count) for role, (count, _, each) in requests.items() if count and each > 0]
    total = sum(count for _, count in users)
    if not users or gpus <= 0:
        return ""
    share = int(gpus / total * 100) / 100  # rounded down: the sum never exceeds the cluster
    if share <= 0:
        return ""
    fields = ", ".join(f"cluster.{role}_num_gpus={share:g}" for role, _ in users)
    return f"; on {gpus:g} GPU(s) this layout fits: {fields}"


__all__ = ["ActorRequests", "actor_requests", "check_resources", "first_fit", "gpu_layout_hint"]
