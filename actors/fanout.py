"""Ray calls to a group of actors, written once: the driver's fan-outs and their deadlines.

    actor_id(handle)           a handle's id (hex): the one reader of Ray's private `ActorHandle._actor_id`
    wait_until_dead(handles)   after `ray.kill`: return once every actor is reported dead (bounded, warns otherwise)

Used by the Cluster (`actors/cluster.py`) and the modules it delegates to (`cluster_elastic.py`,
`cluster_weights.py`, `cluster_faults.py`); it imports none of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import ray

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 20.0  # a rollout loop's polite stop
DEATH_TIMEOUT_S = 30.0  # ray.kill is asynchronous: how long the driver waits until a killed actor is reported dead


def actor_id(handle: Any, default: str | None = None) -> str:
    """The hex id of a Ray actor handle (of an `EngineChannel`: of the handle it wraps). The one place that reads
    Ray's private `ActorHandle._actor_id` (a handle has no public accessor for it); `default` is returned for an
    object without one (a stand-in in a test) instead of raising AttributeError."""
    handle = getattr(handle, "handle", handle)
    try:
        return handle._actor_id.hex()
    except AttributeError:
        if default is None:
            raise
        return default


def wait_until_dead(
    handles: Sequence[Any], timeout_s: float = DEATH_TIMEOUT_S, names: dict[str, str] | None = None
) -> None:
    """Return once every killed actor is reported dead (ray.kill is asynchronous), or warn after `timeout_s`. A
    ping (the built-in `__ray_ready__`) on a dead actor fails with `RayActorError`; one that still answers (the
    kill has not landed yet) is asked again. This works on a Ray Client (`ray://`) driver too (no state API)."""
    deadline, alive = time.monotonic() + timeout_s, list(handles)
    while alive:
        pings = {handle.__ray_ready__.remote(): handle for handle in alive}
        done, pending = ray.wait(list(pings), num_returns=len(pings), timeout=max(deadline - time.monotonic(), 0.0))
        alive = [pings[ref] for ref in pending]
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # RayActorError: dead; any other failure: not answering, treated as gone
                continue
            alive.append(pings[ref])
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if alive:
        ids = [actor_id(h) for h in alive]
        logger.warning(
            "%d actors still alive %.0f s after ray.kill: %s",
            len(alive),
            timeout_s,
            [(names or {}).get(i, i) for i in ids],
        )


__all__ = ["DEATH_TIMEOUT_S", "STOP_TIMEOUT_S", "actor_id", "wait_until_dead"]
