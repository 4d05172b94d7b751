"""What a run's actors ask of the Ray cluster, and the check that it can give it (before any actor starts)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

ActorRequests = dict[str, tuple[int, float, float]]
"""Per actor role: (count, CPUs each, GPUs each)."""

SETTINGS = {
    ("teacher", "GPU"): "generation_num_gpus",  # a local teacher runs the generation engine's kind on its GPUs
    ("teacher client", "CPU"): "teacher_num_cpus",
    ("teacher client", "GPU"): "generation_num_gpus",
}
"""The `cluster.*` field of a role's CPUs / GPUs where it is not `<role>_num_cpus` / `<role>_num_gpus`."""


def setting(role: str, kind: str) -> str:
    """The `cluster` field that sets `kind` ("CPU" / "GPU") for each actor of `role`."""
    return SETTINGS.get((role, kind), f"{role}_num_{kind.lower()}s")


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
    parts = []
    for kind, (wanted, have) in short.items():
        roles = ", ".join(
            f"{count} {role} x {each[0 if kind == 'CPU' else 1]:g} (cluster.{setting(role, kind)})"
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


def check_custom_resources(
    custom: Mapping[str, Mapping[str, float]],
    counts: Mapping[str, int],
    nodes: Sequence[Mapping[str, float]],
    autoscaling: bool,
) -> None:
    """`cluster.resources` against the cluster's live nodes (each node's resources): every custom resource a role
    asks for must be on a node with at least one actor's amount, and the nodes together must hold `count` actors'
    worth (`counts`: actors per role; a role not in it counts 1). Short: a `ValueError` naming the role, the
    resource and the nodes that have it, or on an autoscaling cluster a warning (the pending actors are what makes
    it add a node of the group that has the resource)."""
    problems = []
    for role, wanted in custom.items():
        count = counts.get(role, 1)
        if not count:
            continue
        for name, amount in wanted.items():
            held = [float(node.get(name, 0.0)) for node in nodes]
            if amount > 0 and max(held, default=0.0) + 1e-9 < amount:
                problems.append(
                    f"cluster.resources.{role}.{name}={amount:g}: no node has {amount:g} {name!r} "
                    f"(nodes with it: {sum(h > 0 for h in held)}); start nodes with --resources='{{\"{name}\": N}}'"
                )
            elif count * amount > sum(held) + 1e-9:
                problems.append(
                    f"cluster.resources.{role}.{name}: {count} {role} actors x {amount:g} need {count * amount:g} "
                    f"{name!r} but the nodes have {sum(held):g} in all"
                )
    if not problems:
        return
    message = "; ".join(problems)
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
    fields = ", ".join(dict.fromkeys(f"cluster.{setting(role, 'GPU')}={share:g}" for role, _ in users))
    return f"; on {gpus:g} GPU(s) this layout fits: {fields}"


__all__ = [
    "ActorRequests",
    "actor_requests",
    "check_custom_resources",
    "check_resources",
    "first_fit",
    "gpu_layout_hint",
    "setting",
]
