"""What the Cluster does when an actor dies or freezes: which kinds Ray restarts, and the one-line errors for the
ones that cannot be restarted (docs/design.md §4).

    restartable (Ray `max_restarts`, calls retried)   rollout actors (their leases are released and the loop started
                                                      again: actors/restart.py), reward actors, teachers (stateless)
    restartable (Ray `max_restarts`, calls fail)      generation actors: the rollouts' `EnginePool` retries the failed
                                                      requests, the driver re-opens the weight transport and sends the
                                                      restarted engine the current policy before it serves
                                                      (actors/cluster_weights.py `EngineRestarts`)
    stop-and-resume                                   the queue, the learner ranks, and any actor whose restarts are
                                                      used up: the run stops with an error that names the dead actor
                                                      (and its node, when the node was lost) and the checkpoint to
                                                      resume from

A node lost from a multi-node cluster kills every actor on it at once: the restartable ones are restarted by Ray on
a node that has their resources (`cluster.resources` keeps a role on its group of nodes) and handled as above.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import ray

from actors.fanout import Timeouts, actor_id, remote_all
from rlasync.driver.checkpoint import Checkpointer

logger = logging.getLogger(__name__)

NODE_DIED = re.compile(r"its node has died\.\s*Node Id:\s*([0-9a-f]+)")
NODE_IP = re.compile(r"^\s*ip:\s*(\S+)", re.MULTILINE)
NODE_DEATH_WAIT_S = 10.0  # how long a dead actor's error waits for Ray to say whether its node is gone
MAX_RESTARTS = 3  # per actor and run: a crash that repeats (a reward that kills its process) stops the run
RESTARTABLE_KINDS = ("rollout", "reward", "teacher", "generation")
RETRIED_KINDS = ("rollout", "reward", "teacher")  # Ray resends their calls; a generation call fails (retried above it)


def restart_options(kind: str) -> dict[str, Any]:
    """Ray options of an actor of `kind`: restarts (and retried calls) for the restartable kinds, none else."""
    if kind not in RESTARTABLE_KINDS:
        return {}
    return {"max_restarts": MAX_RESTARTS, "max_task_retries": MAX_RESTARTS if kind in RETRIED_KINDS else 0}


def resume_hint(output_dir: str | Path) -> str:
    """Where a stopped run continues from: the newest complete checkpoint under `output_dir`, or from the start."""
    complete = Checkpointer(output_dir).complete_checkpoints()
    if complete:
        return f"resume with --resume (train(resume_from_checkpoint=True)): newest complete checkpoint {complete[-1]}"
    return f"no complete checkpoint in {output_dir} yet: a rerun starts from step 0"


def died_error(
    name: str, cause: BaseException | str, output_dir: str | Path, seen_by: str | None = None
) -> RuntimeError:
    """`"<name> died (<cause, first line>); resume with --resume: newest complete checkpoint <path>"`; `seen_by`:
    the actor whose call found it dead."""
    text = str(cause).strip().splitlines()
    first = text[0] if text else type(cause).__name__
    if isinstance(cause, BaseException):
        first = f"{type(cause).__name__}: {first}"
    where = f"seen by {seen_by}: " if seen_by else ""
    node = lost_node(cause)
    lost = f"its node {node} was lost: " if node else ""
    if not lost and isinstance(cause, ray.exceptions.RayActorError) and cause.actor_id:
        lost = node_of(cause.actor_id)
    return RuntimeError(f"{name} died ({lost}{where}{first[:300]}); {resume_hint(output_dir)}")


def node_of(dead_actor_id: str, wait_s: float = NODE_DEATH_WAIT_S, lost_only: bool = False) -> str:
    """ "its node N (ip) was lost: " when the actor's node is dead, else "on node N (ip): " once Ray marks the actor
    dead (its process died, the node lives on) or after `wait_s` (a call fails on a closed connection before Ray's
    health checks declare a lost node dead); "" when Ray no longer knows the actor. `lost_only`: "" unless the node
    or the actor is declared dead within `wait_s` (an actor that stopped answering may only be slow)."""
    from ray._private.state import actors  # the GCS's actor table (no dashboard needed)

    deadline = time.monotonic() + wait_s
    while True:
        try:
            row = actors(actor_id=dead_actor_id)
            node_id, ip = row["Address"]["NodeID"], row["Address"].get("IPAddress")
        except Exception:
            return ""
        named = node_id + (f" ({ip})" if ip else "")
        if not {node["NodeID"]: node.get("Alive") for node in ray.nodes()}.get(node_id, False):
            return f"its node {named} was lost: "
        if row.get("State") == "DEAD":
            return f"on node {named}: "
        if time.monotonic() >= deadline:
            return "" if lost_only else f"on node {named}: "
        time.sleep(0.5)


def lost_node(cause: BaseException | str) -> str | None:
    """The node id (and address) of a death Ray reports as its node's ("The actor died because its node has died.
    Node Id: ...", "ip: ..."), else None."""
    text = str(cause)
    found = NODE_DIED.search(text)
    if found is None:
        return None
    ip = NODE_IP.search(text)
    return found.group(1) + (f" ({ip.group(1)})" if ip else "")


def dead_actor_name(error: BaseException | str, names: dict[str, str]) -> str | None:
    """The name of the actor whose death `error` reports (a `RayActorError`'s `actor_id`, or an actor id found in
    the text of an error another actor saw), else None."""
    dead_id = getattr(error, "actor_id", None)
    if dead_id and dead_id in names:
        return names[dead_id]
    text = str(error)
    if "ActorDiedError" not in text and "RayActorError" not in text and "actor died" not in text.lower():
        return None
    for candidate, name in names.items():
        if candidate in text:
            return name
    return None


def answered_text(name: str, answered_at: dict[str, float | None] | None, now: float | None = None) -> str:
    """When `name` last answered, from `answered_at` (engine name -> wall-clock time, None: reported, never
    answered): "; it last answered 42 s ago (22:41:07 UTC)", "; no rollout actor has had an answer from it", or ""
    (not known)."""
    if not answered_at or name not in answered_at:
        return ""
    at = answered_at[name]
    if at is None:
        return "; no rollout actor has had an answer from it"
    now = time.time() if now is None else now
    wall = datetime.fromtimestamp(at, tz=UTC).strftime("%H:%M:%S UTC")
    return f"; it last answered {max(now - at, 0.0):.0f} s ago ({wall})"


class FrozenActorError(RuntimeError):
    """An actor did not answer a probe: frozen (SIGSTOPped) or its event loop blocked; the message names it."""


def frozen_error(
    name: str, seen_by: str, output_dir: str | Path, probe_s: float = Timeouts.probe, answered: str = ""
) -> FrozenActorError:
    """`answered`: when it last answered (`answered_text`), or ""."""
    return FrozenActorError(
        f"{name} made no progress: it did not answer a stats call within {probe_s:.0f} s while {seen_by} "
        f"waited for it (frozen, e.g. SIGSTOPped, or its event loop is blocked){answered}; {resume_hint(output_dir)}"
    )


def probe_engines(
    engines: list[Any],
    names: dict[str, str],
    seen_by: str,
    output_dir: str | Path,
    probe_s: float = Timeouts.probe,
    answered_at: dict[str, float | None] | None = None,
) -> None:
    """Raise naming the first generation actor that does not answer a stats call within `probe_s` (frozen) or is
    dead; return when every one answers. Blocking: the engines are asked at once. `answered_at`: per name, when it
    last answered (wall clock; `RayFleet.answered_at`), said in the error."""
    if not engines:
        return
    refs = remote_all(engines, "stats")
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=probe_s)
    for ref, engine in zip(refs, engines, strict=True):
        name = names.get(actor_id(engine), "a generation actor")
        if ref in pending:
            raise frozen_error(name, seen_by, output_dir, probe_s, answered_text(name, answered_at))
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as exc:
            raise died_error(name, exc, output_dir, seen_by=seen_by) from exc


def blame(
    error: ray.exceptions.RayActorError,
    names: dict[str, str],
    engines: list[Any],
    output_dir: str | Path,
    probe_s: float = Timeouts.probe,
    answered_at: dict[str, float | None] | None = None,
) -> RuntimeError:
    """The error that stops a run on `error` (an actor's call failed): a frozen or dead generation actor first (a
    frozen engine makes the actors waiting on it fail in turn, e.g. a lost connection: the engine is the cause),
    else the actor `error` names: "<name> died (...)", or for `ActorUnavailableError` "<name> stopped answering"."""
    name = dead_actor_name(error, names) or f"an actor ({error.actor_id})"
    try:
        probe_engines(engines, names, f"the driver (after {name} failed)", output_dir, probe_s, answered_at)
    except RuntimeError as named:
        return named
    if isinstance(error, ray.exceptions.ActorUnavailableError):
        # A lost node first shows as a closed connection; Ray's health checks declare it dead seconds later.
        if error.actor_id and node_of(error.actor_id, lost_only=True):
            return died_error(name, error, output_dir)
        first = (str(error).strip().splitlines() or [""])[0]
        return RuntimeError(
            f"{name} stopped answering (ActorUnavailableError: {first[:300]}): frozen, overloaded or unreachable; "
            f"{resume_hint(output_dir)}"
        )
    return died_error(name, error, output_dir)


class RestartWatch:
    """Restarts Ray makes without the driver's help (reward actors and teachers: stateless, their calls resent),
    reported like the others: a warning per restart and `faults/<kind>_restarts` (the count so far) in the next
    step's metrics. Each actor answers `incarnation()` with a token its constructor drew; a new token is a restart.
    `check()` never blocks: one call per actor stays in flight and is read when it has answered (a restarting
    actor's waits for the restart)."""

    def __init__(self, kind: str, handles: list[Any], names: dict[str, str], timeout_s: float) -> None:
        self.kind, self.handles, self.names = kind, list(handles), names
        self.tokens: list[str | None] = list(ray.get(remote_all(self.handles, "incarnation"), timeout=timeout_s))
        self.pending: dict[int, Any] = {}
        self.restarts = 0

    def check(self) -> list[tuple[str, float]]:
        """Read the answered calls (a changed token: warned and counted), send the next ones; the metric items."""
        for index, handle in enumerate(self.handles):
            ref = self.pending.get(index)
            if ref is not None:
                if not ray.wait([ref], timeout=0)[0]:
                    continue
                try:
                    token = ray.get(ref, timeout=0)
                except Exception:  # dead for good (its callers report it) or a failed call: asked again
                    token = None
                if token is not None and token != self.tokens[index]:
                    self.tokens[index] = token
                    self.restarts += 1
                    logger.warning(
                        "%s was restarted after it died: Ray resent its calls (%s restarts so far: %d)",
                        self.names.get(actor_id(handle), f"{self.kind} actor {index}"),
                        self.kind,
                        self.restarts,
                    )
            self.pending[index] = handle.incarnation.remote()
        return [(f"faults/{self.kind}_restarts", float(self.restarts))] if self.restarts else []


__all__ = [
    "MAX_RESTARTS",
    "FrozenActorError",
    "RestartWatch",
    "answered_text",
    "blame",
    "dead_actor_name",
    "died_error",
    "frozen_error",
    "lost_node",
    "node_of",
    "probe_engines",
    "restart_options",
    "resume_hint",
]
