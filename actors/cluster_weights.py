"""The Cluster's weight sync: the group of learner rank 0 and every engine, and one sync as the step loop's
`WeightTransport` (`sync(version) -> (version + 1, timings)`). Every Ray call of a weight sync is here.

    connect_weights   device identities -> the transport plan (rlasync.weights.transport.choose_transport: NCCL
                      when each holds its own GPU, gloo, or CUDA IPC) -> opened on every member at once
    RayWeightSync     prepare -> (learners send || engines receive, pause, load, resume) -> finish; then the queue
                      publishes version + 1. The driver never knows which transport it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import ray

from actors.cluster_faults import MAX_RESTARTS, FrozenActorError, died_error, probe_engines, resume_hint
from actors.fanout import Timeouts, actor_id, call_all, get_all, in_thread, remote_all
from rlasync.weights.transport import TransportPlan, WeightTransportNotOpen, choose_transport

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """Log `message` as a warning the first time this process sees it."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def connect_weights(
    learners: list[Any], engines: list[Any], cluster: Any, *, only: Sequence[int] | None = None
) -> TransportPlan:
    """Choose the weight transport once from the layout (device identities of learner rank 0 and every engine) and
    open it on every learner rank and every engine at once (NCCL and gloo rendezvous need every member). `only`
    (engine indices; a restart): over IPC only those engines open a receiver (there is no group); a broadcast
    group is always re-opened on every member, learner rank 0 included (`TransportTraits.process_group`)."""
    timeout, timeouts = cluster.collective_timeout_s, Timeouts.from_cluster(cluster)
    host, port = ray.get(learners[0].address.remote(), timeout=timeout)
    infos = ray.get([learners[0].weight_endpoint.remote()] + remote_all(engines, "weight_endpoint"), timeout=timeout)
    plan, why_not_nccl = choose_transport(
        infos[0],
        infos[1:],
        cluster.weight_sync_backend,
        host=host,
        port=port,
        timeout_s=timeout,
        bucket_bytes=max(1, int(cluster.weight_sync_bucket_mb * (1 << 20))),
        staging_bytes=int(cluster.weight_sync_staging_mb * (1 << 20)),
        copy_events=cluster.weight_sync_copy_events,
    )
    if why_not_nccl:
        _warn_once(f"weight sync: {why_not_nccl}")
    manifest = ray.get(learners[0].weight_manifest.remote(), timeout=timeout)
    grouped = plan.kind.traits.process_group is not None  # every member re-opens, or only the engines `only`
    opened = range(len(engines)) if only is None or grouped else sorted(set(only))
    senders = learners if len(opened) == len(engines) or grouped else []
    receivers = [engines[i] for i in opened]
    ray.get(
        remote_all(senders, "open_weight_transport", plan)
        + remote_all(receivers, "open_weight_transport", plan, each=[(i + 1, manifest) for i in opened]),
        timeout=timeouts.open_transport,
    )
    logger.info(
        "weight-sync transport: %d engines over %s%s",
        len(engines),
        plan.kind,
        "" if only is None else f" (re-opened for engine(s) {sorted(set(only))})",
    )
    return plan


class EngineRestarted(Exception):
    """A weight sync failed because generation engine(s) `indices` died (Ray restarts them)."""

    def __init__(self, indices: Sequence[int], cause: BaseException) -> None:
        lines = [line for line in str(cause).splitlines() if line.strip()]
        first = lines[-1] if lines else type(cause).__name__  # a remote error's last line is its own message
        super().__init__(f"generation engine(s) {list(indices)} died during the weight sync ({first[:300]})")
        self.indices, self.cause = list(indices), cause


def _settle(refs: list[Any], timeout: float) -> list[Any]:
    """Each call's result or exception, waiting at most `timeout` for all of them (unfinished ones: None)."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
    out: list[Any] = []
    for ref in refs:
        if ref not in ready:
            out.append(None)
            continue
        try:
            out.append(ray.get(ref, timeout=0))
        except Exception as exc:
            out.append(exc)
    return out


def _gone_or_fresh(result: Any) -> bool:
    """A sync call's outcome that means its engine died: Ray's actor error, or a restarted one's
    `WeightTransportNotOpen` (raised in the actor: Ray's error is an instance of it too)."""
    return isinstance(result, ray.exceptions.RayActorError | WeightTransportNotOpen)


class RayWeightSync:
    """One sync, whatever the transport: every learner rank prepares (rank 0's ticket: e.g. CUDA-IPC handles, or
    None for a broadcast), then the learners send while each engine receives, pauses (its step in flight finishes
    meanwhile), loads and resumes (`GenerationActor.sync_weights`), then the learners finish (e.g. release shared
    buckets); then the queue publishes version + 1. The timings are the sync's phases (docs/algorithms.md §6.1 names):
    `perf/weight_sync_s` (total, including the version bump), `perf/weight_sync_barrier_s` (until every learner
    rank had prepared its send: the ranks' barrier), and over the engines the slowest
    `perf/weight_sync_pause_s` (until paused, overlapping the transfer), `perf/weight_sync_transfer_s` (paused until
    loaded: what of the transfer did not overlap, and the copies) and `perf/weight_sync_resume_s`; also
    `perf/weight_sync_dispatch_s` (until the slowest engine's call started), `perf/weight_sync_send_s` (rank 0's
    send, waiting for the receivers included), `perf/generation_loop_lag_max_s` (the worst event-loop lag of a
    GenerationActor since the previous sync) and `perf/generation_cpu_frac` (the busiest GenerationActor process's
    CPU seconds per second since then: near 1.0, bound by its GIL). The parts that sum to the total: barrier (of
    which `_pack_s`, rank 0 filling its IPC buckets) + the slowest engine's pause + transfer + resume (+ `_stage_s`,
    mapping handles before pausing) + `_calls_s` (the driver's Ray round trips around them) + `_finish_s` (finish and
    the version bump, together). Over IPC every engine `begin_sync`s first: it pauses while the learners pack.

    Restarted engines (docs/design.md §4): the driver holds one `watch()` call per engine, which never returns, so
    its failure says the engine died (a frozen engine's does not fail). A sync that fails because an engine died
    waits (bounded) until every call of it has ended, waits for Ray to restart the engine, re-opens the transport
    (`connect_weights`: every member of a broadcast group) and runs again, at most MAX_RESTARTS times. Between
    syncs `heal()` (the fleet calls it at each step and health check) does the same for an engine that died,
    publishing a new version; the next `sync(version)` continues from the newest published one. An engine whose restarts are used up
    stops the run (`died_error`). `restarts` counts the engines brought back (`faults/generation_restarts`)."""

    def __init__(
        self,
        learners: list[Any],
        engines: list[Any],
        queue: Any,
        timeouts: Timeouts,
        *,
        cluster: Any = None,
        names: dict[str, str] | None = None,
        output_dir: str = ".",
        hang_s: float | None = None,
        answered_at: dict[str, float | None] | None = None,
    ) -> None:
        self.learners, self.engines, self.queue, self.timeouts = learners, engines, queue, timeouts
        self.cluster, self.names, self.output_dir = cluster, names or {}, output_dir
        self.hang_s = hang_s  # a sync still loading after this probes its engines: a frozen one stops the run
        self.answered_at = answered_at if answered_at is not None else {}  # engine name -> its last answer (wall)
        self.version = -1  # the newest version this transport published
        self.restarts = 0
        self._watches: dict[int, Any] = {}  # engine index -> its `watch()` call, which fails when the engine dies
        self._arm(range(len(engines)))

    def _name(self, index: int) -> str:
        return self.names.get(actor_id(self.engines[index]), f"generation actor {index}")

    async def sync(self, version: int) -> tuple[int, dict[str, float]]:
        return await in_thread(self.sync_now, version)

    async def heal(self) -> int:
        return await in_thread(self.heal_now)

    def sync_now(self, version: int) -> tuple[int, dict[str, float]]:
        """One sync, blocking (the cold sync runs it before the step loop starts); engines that die during it are
        waited for, re-connected and synced again."""
        version = max(version, self.version)  # heal() may have published a newer version since the caller's
        for attempt in range(MAX_RESTARTS + 1):
            try:
                version, timings = self._sync_once(version)
            except EngineRestarted as restarted:
                if attempt == MAX_RESTARTS:
                    raise RuntimeError(
                        f"the weight sync failed {attempt + 1} times: {restarted}; {resume_hint(self.output_dir)}"
                    ) from restarted.cause
                logger.warning("%s; waiting for the restart, then the weight sync runs again", restarted)
                self._reconnect(restarted.indices)
                continue
            self.version = version
            if self.restarts:
                timings["faults/generation_restarts"] = float(self.restarts)
            return version, timings
        raise AssertionError("unreachable")

    def heal_now(self) -> int:
        """Engines whose watch call failed since the last look (they died; Ray restarts them): wait for them, re-open
        the transport and sync the current weights (a new version); the number brought back. Non-blocking while no
        engine died."""
        fired = self._fired(0.0)
        if fired:
            self._reconnect(fired)
            self.version, _ = self.sync_now(self.version)
        return len(fired)

    def add_engines(self, new: Sequence[Any]) -> int:
        """Elastic pools: `new` GenerationActors join the transport (a broadcast group is re-opened on every member,
        as after a restart; over IPC only they open a receiver), then every engine gets the current weights as a
        new policy version (returned); the new ones serve only after it (their first-sync gate)."""
        first = len(self.engines)
        self.engines.extend(new)
        indices = list(range(first, len(self.engines)))
        self._arm(indices)
        connect_weights(self.learners, self.engines, self._cluster(), only=indices)
        self.version, _ = self.sync_now(self.version)
        return self.version

    def remove_engines(self, gone: Sequence[Any]) -> None:
        """Elastic pools: these engines leave the transport before they are killed (their watch calls are
        dropped first, so their deaths are not restarts); a broadcast group is re-opened without them."""
        ids = {actor_id(engine) for engine in gone}
        kept = [(engine, self._watches[i]) for i, engine in enumerate(self.engines) if actor_id(engine) not in ids]
        if not kept:
            raise ValueError("the weight transport needs at least one generation engine")
        self.engines[:] = [engine for engine, _ in kept]
        self._watches = {i: watch for i, (_, watch) in enumerate(kept)}
        connect_weights(self.learners, self.engines, self._cluster(), only=[])

    def _cluster(self) -> Any:
        if self.cluster is None:
            raise RuntimeError("RayWeightSync needs the cluster settings to re-open the weight transport")
        return self.cluster

    def _arm(self, indices: Sequence[int]) -> None:
        for index in indices:
            self._watches[index] = self.engines[index].watch.remote()

    def _fired(self, timeout: float) -> list[int]:
        """The engines whose watch call ended (it only ends when the actor dies), waiting up to `timeout` for one."""
        refs = list(self._watches.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        return [index for index, ref in self._watches.items() if ref in ready]

    def _wait_restarted(self, index: int) -> int | None:
        """Block until engine `index` answers again (Ray restarts it); its weights_version. Raises `died_error`
        when its restarts are used up, a RuntimeError when it does not come back within `timeouts.restart`."""
        engine, deadline, died = self.engines[index], time.monotonic() + self.timeouts.restart, 0
        while True:
            left = deadline - time.monotonic()
            try:
                return ray.get(engine.weights_version.remote(), timeout=max(left, 1.0))
            except ray.exceptions.ActorUnavailableError:  # "the actor is restarting": asked again
                pass
            except ray.exceptions.RayActorError as exc:  # ActorDiedError: asked again twice, then it is final
                died += 1
                if died >= 3:
                    raise died_error(self._name(index), exc, self.output_dir) from exc
            except ray.exceptions.GetTimeoutError:
                pass
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{self._name(index)} died and did not come back within {self.timeouts.restart:.0f} "
                    f"s; {resume_hint(self.output_dir)}"
                )
            time.sleep(1.0)

    def _reconnect(self, indices: Sequence[int]) -> None:
        """Wait for the engines `indices` to come back, then re-open the transport for them (all members of a group)."""
        restarted = [i for i in sorted(set(indices)) if self._wait_restarted(i) is None]
        self._arm(sorted(set(indices)))
        for index in restarted:
            self.restarts += 1
            logger.warning(
                "%s was restarted: the weight transport is re-opened and the current policy sent before "
                "it serves (generation restarts so far: %d)",
                self._name(index),
                self.restarts,
            )
        connect_weights(self.learners, self.engines, self._cluster(), only=restarted)

    def _sync_once(self, version: int) -> tuple[int, dict[str, float]]:
        started, started_at = time.perf_counter(), time.time()
        remote_all(self.engines, "begin_sync")  # IPC: engines start pausing while the learners pack (their step drains)
        try:
            ticket = call_all(self.learners, "prepare_weights", timeout=self.timeouts.call)[0]
        except Exception:
            remote_all(self.engines, "cancel_sync")
            raise
        barrier_s = time.perf_counter() - started  # until every learner rank was ready to send
        finish, results = True, None
        sends = remote_all(self.learners, "send_weights")
        loads = remote_all(self.engines, "sync_weights", ticket, version + 1)
        try:
            results = self._wait(sends, loads)  # fails at once when an engine died; a frozen one is named
        except Exception as exc:
            finish = False  # a learner still blocked in its send would hold the finish call back: the run stops
            if isinstance(exc, FrozenActorError):
                raise
            dead = self._dead_engines(exc, sends, loads)
            if dead:
                finish = True  # every call of this sync has ended
                raise EngineRestarted(dead, exc) from exc
            if not isinstance(exc, ray.exceptions.RayActorError):  # a frozen (or dead) engine is named instead
                try:
                    probe_engines(
                        self.engines,
                        self.names,
                        "the weight sync",
                        self.output_dir,
                        self.timeouts.probe,
                        self.answered_at,
                    )
                except RuntimeError as named:
                    raise named from exc
            raise
        finally:
            loaded = time.perf_counter()
            finished = remote_all(self.learners, "finish_weights")
            if finish and results is None:  # a failed sync: finish before raising
                ray.get(finished, timeout=self.timeouts.call)
        sent, phases = results[: len(self.learners)], results[len(self.learners) :]
        ray.get(finished + [self.queue.set_policy_version.remote(version + 1)], timeout=self.timeouts.call)  # together
        ended = time.perf_counter()
        timings = sync_timings(ended - started, started_at, sent, phases)
        return version + 1, {
            **timings,
            "perf/weight_sync_barrier_s": barrier_s,
            "perf/weight_sync_pack_s": float(getattr(ticket, "pack_s", 0.0)),
            "perf/weight_sync_calls_s": (loaded - started - barrier_s) - max(p["total_s"] for p in phases),
            "perf/weight_sync_finish_s": ended - loaded,
        }

    def _wait(self, sends: list[Any], loads: list[Any]) -> list[Any]:
        """Every call of one sync (`get_all`: the first failure raises). Past the hang bound (`hang_s`) the engines
        still loading are probed: one that does not answer is frozen (`FrozenActorError`, with when it last
        answered), so the run stops within the bound rather than at the sync's deadline. Records the answers."""
        refs, deadline = sends + loads, self.timeouts.weight_sync
        if self.hang_s is None or self.hang_s >= deadline:
            results = get_all(refs, deadline)
        else:
            try:
                results = get_all(refs, self.hang_s)
            except ray.exceptions.GetTimeoutError:
                waiting = [engine for engine, ref in zip(self.engines, loads) if not ray.wait([ref], timeout=0)[0]]
                probe_engines(
                    waiting, self.names, "the weight sync", self.output_dir, self.timeouts.probe, self.answered_at
                )
                results = get_all(refs, deadline - self.hang_s)
        now = time.time()
        self.answered_at.update({self._name(index): now for index in range(len(self.engines))})
        return results

    def _dead_engines(self, exc: BaseException, sends: list[Any], loads: list[Any]) -> list[int]:
        """After a failed sync: the engines that died (empty: not an engine death, e.g. a frozen engine or a dead
        learner). When there are some, first waits (bounded by the collective timeout) for every call of the
        sync to end: the survivors' collectives fail once their dead peer's connection is gone, or time out."""
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            return []  # something hangs: named by the probe
        learner_ids = {actor_id(learner) for learner in self.learners}
        if isinstance(exc, ray.exceptions.RayActorError) and getattr(exc, "actor_id", None) in learner_ids:
            return []
        early = _settle(loads, 0.0)
        dead = set(self._fired(self.timeouts.death_notice)) | {
            i for i, result in enumerate(early) if _gone_or_fresh(result)
        }
        if not dead:
            return []
        survivors = sends + [ref for i, ref in enumerate(loads) if i not in dead]  # a dead engine's call may wait
        settled = _settle(survivors, self.timeouts.settle)  # for its restart; the others end or time out
        if any(result is None for result in settled):
            return []  # a member is still blocked: the run stops (named by the probe)
        if any(isinstance(r, ray.exceptions.RayActorError) for r in settled[: len(sends)]):
            return []  # a learner died too: stop-and-resume
        return sorted(dead)


def sync_timings(
    total_s: float, started_at: float, sent: list[float], phases: list[dict[str, float]]
) -> dict[str, float]:
    """The `perf/weight_sync_*` metrics of one sync from the learners' send times and the engines' phases."""
    return {
        "perf/weight_sync_s": total_s,
        "perf/weight_sync_pause_s": max(p["pause_s"] for p in phases),
        "perf/weight_sync_transfer_s": max(p["load_s"] for p in phases),
        "perf/weight_sync_resume_s": max(p["resume_s"] for p in phases),
        # how long the slowest engine's call waited to start (a busy actor), and the learners' send
        "perf/weight_sync_dispatch_s": max(max(p.get("started_at", started_at) - started_at, 0.0) for p in phases),
        "perf/generation_loop_lag_max_s": max(p.get("loop_lag_max_s", 0.0) for p in phases),
        "perf/generation_cpu_frac": max(p.get("cpu_frac", 0.0) for p in phases),  # the busiest engine's process
        "perf/generation_gc_max_s": max(p.get("gc_max_s", 0.0) for p in phases),  # one cause of a late loop
        "perf/generation_gc_refreezes": max(p.get("gc_refreezes", 0.0) for p in phases),
        "perf/weight_sync_send_s": max(sent),
        "perf/weight_sync_stage_s": max(p.get("stage_s", 0.0) for p in phases),
        # of the transfer, the engine's own part (vLLM's workers: copies and the wait for them), where it says
        **(
            {"perf/weight_sync_engine_load_s": max(p.get("engine_load_s", 0.0) for p in phases)}
            if any("engine_load_s" in p for p in phases)
            else {}
        ),
    }
