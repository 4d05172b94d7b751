"""Elastic pools, the Ray side: `RayPools` resizes the generation and rollout pools of a running `Cluster` (the
core's `rlasync.driver.elastic.Resizable`; the StepLoop's elastic hook calls it between two steps, so it never
overlaps a weight sync). docs/design.md §4.

    add_engines(n)      spawn GenerationActors, wait until built -> join the weight transport (a broadcast group:
                        every member re-joins a new group; IPC: only the new ones) -> the current weights as a new
                        policy version (the new engines serve nothing before: their first-sync gate) -> every rollout
                        actor's EnginePool takes them (`set_engines`)
    remove_engines(n)   the rollout actors stop sending to them -> their requests in flight finish (bounded by
                        `Timeouts.drain`; what is left fails when they are killed and is retried on another engine) ->
                        they leave the transport (a broadcast group is rebuilt without them) -> killed
    add_rollouts(n)     spawn rollout actors over the current engines, started
    remove_rollouts(n)  the loop stops (its groups in flight are cancelled: their leases go back to the queue), its
                        metrics are drained, every lease the queue still holds under its owner name is released
                        (`release_owner`), then it is killed, and released again after LEASE_POLL_S (a lease it
                        asked for before it stopped may be granted that late): every prompt is consumed exactly once

A pool never goes below one actor. An actor that cannot start within `collective_timeout_s` (no node has room and
the cluster does not grow) is killed again with a warning; the run goes on at the old size. Each change is
appended to the run state's `elastic_events` (what, which actor, the policy version; for a removed engine the
requests it answered and the version it held).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from actors.fanout import actor_id, call_all, in_thread, remote_all, wait_until_dead
from actors.loop_host import LEASE_POLL_S
from rlasync.driver.elastic import Sizes

logger = logging.getLogger(__name__)


class RayPools:
    """`Resizable` over a running `Cluster`'s engines (`weights.engines`, the same list as `cluster.engines`) and
    rollout actors (`fleet.handles`, the same list as `cluster.rollouts`). Of the Cluster it uses `spawn_engine`,
    `spawn_rollout`, `handles`, `names` and `timeouts` (the Cluster builds it; this module does not import it)."""

    def __init__(self, cluster: Any, weights: Any, fleet: Any, queue: Any, state: dict[str, Any]) -> None:
        self.cluster, self.weights, self.fleet, self.queue, self.state = cluster, weights, fleet, queue, state
        self.timeouts = cluster.timeouts  # actors/fanout.py Timeouts
        self.answered_for_gone: dict[str, int] = {}  # engine id -> requests it answered rollout actors since removed

    def sizes(self) -> Sizes:
        return Sizes(len(self.weights.engines), len(self.fleet.handles))

    async def resize(self, target: Sizes) -> list[tuple[str, Any]]:
        return await in_thread(self.resize_now, target)

    def resize_now(self, target: Sizes) -> list[tuple[str, Any]]:
        """Adds first, then removes (a pool is never empty); metric items: the rollouts' drained metrics of removed
        rollout actors and `elastic/resize_s`."""
        started, sizes, items = time.perf_counter(), self.sizes(), []
        if target.generation > sizes.generation:
            self.add_engines(target.generation - sizes.generation)
        if target.rollout > sizes.rollout:
            self.add_rollouts(target.rollout - sizes.rollout)
        if target.rollout < sizes.rollout:
            items += self.remove_rollouts(sizes.rollout - target.rollout)
        if target.rollout != sizes.rollout:
            self._place_rollouts()
        if target.generation < sizes.generation:
            self.remove_engines(sizes.generation - target.generation)
        logger.info("elastic: pools resized %s -> %s in %.1f s", sizes, self.sizes(), time.perf_counter() - started)
        return [*items, ("elastic/resize_s", time.perf_counter() - started)]

    # ---- generation actors ----------------------------------------------------------------------------------------

    def add_engines(self, n: int) -> list[Any]:
        new = self._built([self.cluster.spawn_engine() for _ in range(n)])
        if not new:
            return []
        version = self.weights.add_engines(new)
        self._set_engines()
        for engine in new:
            self._event("add_engine", engine, policy_version=version)
        return new

    def remove_engines(self, n: int) -> list[Any]:
        engines = self.weights.engines
        n = min(n, len(engines) - 1)
        if n <= 0:
            return []
        gone, ids = engines[-n:], [actor_id(engine) for engine in engines[-n:]]
        self._set_engines(engines[:-n])  # no new request goes to them
        served = self._drain(ids)
        held = call_all(gone, "weights_version", timeout=self.timeouts.call)
        self.weights.remove_engines(gone)
        self._set_engines()
        self._kill(gone)
        for engine, key, version in zip(gone, ids, held, strict=True):
            self._event(
                "remove_engine",
                engine,
                policy_version=self.weights.version,
                requests=served.get(key, 0) + self.answered_for_gone.pop(key, 0),
                weights_version=version,
            )
        return gone

    def _set_engines(self, engines: list[Any] | None = None) -> None:
        """Every rollout actor's EnginePool: exactly `engines` (default: the transport's)."""
        engines = list(self.weights.engines if engines is None else engines)
        self.fleet.engines = list(self.weights.engines)
        labels = [self.cluster.names.get(actor_id(engine), "generation actor") for engine in engines]
        call_all(self.fleet.handles, "set_engines", engines, labels, timeout=self.timeouts.call)

    def _drain(self, ids: list[str]) -> dict[str, int]:
        """Wait (at most `timeouts.drain`) until no rollout actor has a request in flight on the engines `ids`; the
        requests each engine answered, summed over the rollout actors."""
        deadline = time.monotonic() + self.timeouts.drain
        while True:
            reports = call_all(self.fleet.handles, "engine_report", ids, timeout=self.timeouts.call)
            inflight = sum(pair[1] for report in reports for pair in report.values())
            if inflight == 0 or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if inflight:
            logger.warning(
                "elastic: %d requests still in flight on the leaving engines after %.0f s: they are retried "
                "on the others",
                inflight,
                self.timeouts.drain,
            )
        return {key: sum(report.get(key, (0, 0))[0] for report in reports) for key in ids}

    # ---- rollout actors -------------------------------------------------------------------------------------------

    def add_rollouts(self, n: int) -> list[Any]:
        new = self._built([self.cluster.spawn_rollout(list(self.weights.engines)) for _ in range(n)])
        call_all(new, "start", timeout=self.timeouts.call)
        self.fleet.handles.extend(new)
        for rollout in new:
            self._event("add_rollout", rollout, policy_version=self.weights.version)
        return new

    def _place_rollouts(self) -> None:
        """Each rollout actor as member i of the resized pool (`EnginePool.place`: its home engines)."""
        if self.cluster.config.cluster.engine_placement != "home":
            return
        handles = self.fleet.handles
        count = len(handles)
        call_all(handles, "place_engines", each=[(i, count) for i in range(count)], timeout=self.timeouts.call)

    def remove_rollouts(self, n: int) -> list[tuple[str, Any]]:
        handles = self.fleet.handles
        n = min(n, len(handles) - 1)
        if n <= 0:
            return []
        gone = handles[-n:]
        owners = call_all(gone, "owner", timeout=self.timeouts.call)
        try:
            call_all(gone, "stop", timeout=self.timeouts.stop)  # leases in flight released
        except Exception as exc:  # a hung loop: its leases are released below anyway
            logger.warning("elastic: stopping the leaving rollout actors: %s", exc)
        drained = call_all(gone, "drain_metrics", timeout=self.timeouts.call)
        ids = [actor_id(engine) for engine in self.weights.engines]  # what each engine answered the leaving actors
        for report in call_all(gone, "engine_report", ids, timeout=self.timeouts.call):
            for key, (answered, _) in report.items():
                self.answered_for_gone[key] = self.answered_for_gone.get(key, 0) + answered
        released = self._release(owners)
        del handles[-n:]
        self._kill(gone)
        # a lease asked for before the stop is answered by the queue up to LEASE_POLL_S later: released too
        time.sleep(LEASE_POLL_S + 1.0)
        late = self._release(owners)
        released = [a + b for a, b in zip(released, late, strict=True)]
        for rollout, count in zip(gone, released, strict=True):
            self._event("remove_rollout", rollout, policy_version=self.weights.version, released_leases=count)
        return [item for items in drained for item in items]

    def _release(self, owners: list[str]) -> list[int]:
        """The queue releases every lease it holds under each owner name; the counts, per owner."""
        return call_all(
            [self.queue] * len(owners), "release_owner", each=[(owner,) for owner in owners], timeout=self.timeouts.call
        )

    # ---- shared ---------------------------------------------------------------------------------------------------

    def _built(self, handles: list[Any]) -> list[Any]:
        """The actors among `handles` that finished their constructor within the timeout; the others are killed
        (e.g. no node has room for them and the cluster does not grow)."""
        pings = remote_all(handles, "__ray_ready__")
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=self.timeouts.call)
        built, failed = [], []
        for handle, ping in zip(handles, pings, strict=True):
            try:
                if ping not in ready:
                    raise TimeoutError(
                        f"not started within cluster.collective_timeout_s={self.timeouts.call:.0f} s (no room on any node?)"
                    )
                ray.get(ping, timeout=0)
                built.append(handle)
            except Exception as exc:
                logger.warning("elastic: %s could not join: %s", self._label(handle), exc)
                failed.append(handle)
        self._kill(failed)
        return built

    def _kill(self, handles: list[Any]) -> None:
        for handle in handles:
            ray.kill(handle, no_restart=True)
        ids = {actor_id(handle) for handle in handles}
        self.cluster.handles[:] = [h for h in self.cluster.handles if actor_id(h) not in ids]
        wait_until_dead(handles, self.timeouts.death, names=self.cluster.names)

    def _label(self, handle: Any) -> str:
        return self.cluster.names.get(actor_id(handle), actor_id(handle))

    def _event(self, action: str, handle: Any, **details: Any) -> None:
        event = {"action": action, "actor": self._label(handle), "step": self.state.get("global_step"), **details}
        self.state.setdefault("elastic_events", []).append(event)
        logger.info("elastic: %s", event)


__all__ = ["RayPools"]
