"""Ray calls to a group of actors, written once: the driver's fan-outs and their deadlines.

    Timeouts.from_cluster(cluster)   every deadline of a driver call, derived once from cluster.collective_timeout_s
    remote_all(handles, "method")    the same call on every actor at once: its ObjectRefs
    call_all(handles, "method", ..., timeout=)        blocking: every result (ray.get; the first failure raises)
    await call_all_async(handles, "method", ..., timeout=)   from the event loop: waited in a worker thread,
                                     failing as soon as any call failed (`get_all`)
    actor_id(handle)                 a handle's id (hex): the one reader of Ray's private `ActorHandle._actor_id`
    Named(name) / resolve_named(x)   an actor passed to a restartable actor's constructor by its Ray name, looked
                                     up there (a handle or object ref among those arguments makes Ray log an error
                                     at every start: they might be gone when it restarts)
    wait_until_dead(handles)         after `ray.kill`: return once every actor is reported dead (bounded)

A failed call raises the error Ray raises for it (a `RayActorError` carries the dead actor's id, a task error the
actor's own message), so the caller names the actor as before. Used by the Cluster (`actors/cluster.py`) and the
modules it delegates to (`cluster_elastic.py`, `cluster_weights.py`, `cluster_faults.py`); it imports none of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import ray

logger = logging.getLogger(__name__)

# Blocking Ray calls run here, off the step loop's event loop. Not asyncio's default executor: on Ctrl-C,
# asyncio.run would wait for that one (a train_step's ray.get can block for an hour) before the Cluster kills the
# actors, which is what unblocks these threads.
_RAY_CALLS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlasync-ray")


@dataclass(frozen=True)
class Timeouts:
    """Every deadline the driver puts on a call to its actors, in one place (seconds). `collective` is
    `cluster.collective_timeout_s` (T, every collective is bounded by it); the others are derived from it or fixed:

        call            T           an ordinary call: a state change, a handshake, metrics, an elastic step
        build           T + 600     actors made ready: learner setup (model, optimizer, resume), teachers built,
                                    rollout loops started (a model download may take minutes)
        train_step      T + 3600    one training step on every learner rank
        save            T + 600     a checkpoint written by every learner rank
        open_transport  T + 30      the weight transport opened on every member (a rendezvous bounded by T)
        weight_sync     T + 60      learners send while the engines receive and load (collectives bounded by T)
        settle          T + 30      after a failed weight sync: until every call of it has ended or timed out
        take_margin     60          on top of the queue's own wait in `wait_take`
        stop            20          a rollout loop's polite stop (hung ones are killed anyway)
        health          60          a health or state poll
        probe           10          a generation actor that does not answer a stats call within it is frozen
        death           30          after `ray.kill`, until Ray reports the actor dead
        restart         180         a restarted actor builds its model / loop again before it answers
        drain           30          elastic: requests in flight on leaving engines (the rest are retried)
        death_notice    3           after a failed weight sync: how long Ray gets to report a dead engine
    """

    collective: float = 300.0
    stop: float = 20.0
    health: float = 60.0
    probe: float = 10.0
    death: float = 30.0
    restart: float = 180.0
    drain: float = 30.0
    death_notice: float = 3.0
    take_margin: float = 60.0

    @classmethod
    def from_cluster(cls, cluster: Any) -> Timeouts:
        """From the run's `ClusterConfig` (its `collective_timeout_s`)."""
        return cls(collective=float(cluster.collective_timeout_s))

    @property
    def call(self) -> float:
        return self.collective

    @property
    def build(self) -> float:
        return self.collective + 600.0

    @property
    def train_step(self) -> float:
        return self.collective + 3600.0

    @property
    def save(self) -> float:
        return self.collective + 600.0

    @property
    def open_transport(self) -> float:
        return self.collective + 30.0

    @property
    def weight_sync(self) -> float:
        return self.collective + 60.0

    @property
    def settle(self) -> float:
        return self.collective + 30.0


def remote_all(
    handles: Sequence[Any], method: str, *args: Any, each: Sequence[Sequence[Any]] | None = None, **kwargs: Any
) -> list[Any]:
    """`handle.<method>.remote(*args, **kwargs)` on every handle at once, in order: the ObjectRefs. `each`: one
    tuple of positional arguments per handle, appended after `args` (e.g. each engine's rank)."""
    if each is not None and len(each) != len(handles):
        raise ValueError(f"remote_all({method!r}): {len(each)} argument tuples for {len(handles)} actors")
    extra = each if each is not None else [()] * len(handles)
    return [getattr(handle, method).remote(*args, *more, **kwargs) for handle, more in zip(handles, extra)]


def call_all(
    handles: Sequence[Any],
    method: str,
    *args: Any,
    timeout: float,
    each: Sequence[Sequence[Any]] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Blocking: `remote_all`, then every result within `timeout` (`ray.get`: a failed call raises its error)."""
    return ray.get(remote_all(handles, method, *args, each=each, **kwargs), timeout=timeout)


async def call_all_async(handles: Sequence[Any], method: str, *args: Any, timeout: float, **kwargs: Any) -> list[Any]:
    """From the event loop: the calls are made here and waited for in a worker thread (`get_all`: fails as soon as
    any call failed, so a dead learner rank does not leave the driver waiting for the ranks blocked with it)."""
    return await in_thread(get_all, remote_all(handles, method, *args, **kwargs), timeout)


async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` (a blocking Ray call) awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_RAY_CALLS, partial(fn, *args, **kwargs))


def get_all(refs: Any, timeout: float) -> Any:
    """`ray.get`, but a list fails as soon as any of its calls failed (a dead learner rank must not leave the driver
    waiting for the ranks blocked in a collective with it)."""
    if not isinstance(refs, list) or len(refs) < 2:
        return ray.get(refs, timeout=timeout)
    loop_deadline, pending = time.monotonic() + timeout, list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(loop_deadline - time.monotonic(), 0.0))
        if not done:
            raise ray.exceptions.GetTimeoutError(
                f"{len(pending)} of {len(refs)} calls unfinished after {timeout:.0f} s"
            )
        ray.get(done)  # raises its failure now
    return ray.get(refs)


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
    handles: Sequence[Any], timeout_s: float = Timeouts.death, names: dict[str, str] | None = None
) -> None:
    """Return once every killed actor is reported dead (ray.kill is asynchronous), or warn after `timeout_s`. A
    ping (the built-in `__ray_ready__`) on a dead actor fails with `RayActorError`; one that still answers (the
    kill has not landed yet) is asked again. This works on a Ray Client (`ray://`) driver too (no state API)."""
    deadline, alive = time.monotonic() + timeout_s, list(handles)
    while alive:
        # no retries: a retried ping of a killed restartable actor makes the raylet print "Task ...__ray_ready__
        # failed ... killed by ray.kill", which reads as an error on a clean shutdown
        pings = {handle.__ray_ready__.options(max_task_retries=0).remote(): handle for handle in alive}
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


__all__ = [
    "Timeouts",
    "actor_id",
    "call_all",
    "call_all_async",
    "get_all",
    "in_thread",
    "remote_all",
    "wait_until_dead",
]


@dataclass(frozen=True)
class Named:
    """An actor given by its Ray name (the Cluster names the actors other actors' constructors refer to)."""

    name: str


def resolve_named(value: Any) -> Any:
    """`value` with every `Named` in it (itself, a list's items, a dict's values) replaced by the actor's handle; a
    list skips names that no longer resolve (an engine removed since this actor was first made: a restart), with a
    warning, and fails only when none does."""
    if isinstance(value, Named):
        return ray.get_actor(value.name)
    if isinstance(value, list):
        found = []
        for item in value:
            try:
                found.append(resolve_named(item))
            except ValueError as exc:  # ray.get_actor: no such (live) actor
                logger.warning("%s is gone (%s): left out", item, exc)
        if value and not found:
            raise ValueError(f"none of the actors {value} could be found (all gone)")
        return found
    if isinstance(value, dict):
        return {key: resolve_named(item) for key, item in value.items()}
    return value
