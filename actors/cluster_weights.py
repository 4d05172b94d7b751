"""The Cluster's weight sync: the group of learner rank 0 and every engine, and one sync as the step loop's
`WeightTransport` (`sync(version) -> (version + 1, timings)`). Every Ray call of a weight sync is here.

    connect_weights   device identities -> the transport plan (rlasync.weights.transport.choose_transport: NCCL
                      when each holds its own GPU, gloo, or CUDA IPC) -> opened on every member at once
    RayWeightSync     prepare -> (learners send || engines receive, pause, load, resume) -> finish; then the queue
                      publishes version + 1. The driver never knows which transport it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import ray

from actors.cluster_faults import probe_engines
from rlasync.weights.transport import TransportPlan, choose_transport

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()
# Blocking Ray calls run here, off the step loop's event loop. Not asyncio's default executor: on Ctrl-C,
# asyncio.run would wait for that one (a train_step's ray.get can block for an hour) before the Cluster kills the
# actors, which is what unblocks these threads.
_RAY_CALLS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlasync-ray")


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
            raise ray.exceptions.GetTimeoutError(f"{len(pending)} of {len(refs)} calls unfinished after {timeout:.0f} s")
        ray.get(done)  # raises its failure now
    return ray.get(refs)


def _warn_once(message: str) -> None:
    """Log `message` as a warning the first time this process sees it."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def connect_weights(learners: list[Any], engines: list[Any], cluster: Any) -> TransportPlan:
    """Choose the weight transport once from the layout (device identities of learner rank 0 and every engine) and
    open it on every learner rank and every engine at once (NCCL and gloo rendezvous need every member)."""
    timeout = cluster.collective_timeout_s
    host, port = ray.get(learners[0].address.remote(), timeout=timeout)
    infos = ray.get([learners[0].weight_endpoint.remote()] + [e.weight_endpoint.remote() for e in engines],
                    timeout=timeout)  # fmt: skip
    plan, why_not_nccl = choose_transport(
        infos[0], infos[1:], cluster.weight_sync_backend, host=host, port=port, timeout_s=timeout,
        bucket_bytes=max(1, int(cluster.weight_sync_bucket_mb * (1 << 20))),
        staging_bytes=int(cluster.weight_sync_staging_mb * (1 << 20)),
    )  # fmt: skip
    if why_not_nccl:
        _warn_once(f"weight sync: {why_not_nccl}")
    manifest = ray.get(learners[0].weight_manifest.remote(), timeout=timeout)
    ray.get(
        [learner.open_weight_transport.remote(plan) for learner in learners]
        + [engine.open_weight_transport.remote(plan, i + 1, manifest) for i, engine in enumerate(engines)],
        timeout=timeout + 30,
    )
    logger.info("weight-sync transport: %d engines over %s", len(engines), plan.kind)
    return plan


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
    send, waiting for the receivers included) and `perf/generation_loop_lag_max_s` (the worst event-loop lag of a
    GenerationActor since the previous sync)."""

    def __init__(self, learners: list[Any], engines: list[Any], queue: Any, timeout: float, *,
                 names: dict[str, str] | None = None, output_dir: str = ".") -> None:  # fmt: skip
        self.learners, self.engines, self.queue, self.timeout = learners, engines, queue, timeout
        self.names, self.output_dir = names or {}, output_dir

    async def sync(self, version: int) -> tuple[int, dict[str, float]]:
        return await in_thread(self.sync_now, version)

    def sync_now(self, version: int) -> tuple[int, dict[str, float]]:
        """One sync, blocking (the cold sync runs it before the step loop starts)."""
        started, started_at = time.perf_counter(), time.time()
        ticket = ray.get([learner.prepare_weights.remote() for learner in self.learners], timeout=self.timeout)[0]
        barrier_s = time.perf_counter() - started  # until every learner rank was ready to send
        finish = True
        try:
            results = get_all(  # fails at once when an engine died, not after the broadcast's timeout
                [learner.send_weights.remote() for learner in self.learners]
                + [engine.sync_weights.remote(ticket) for engine in self.engines],
                self.timeout + 60,
            )
        except Exception as exc:
            finish = False  # a learner still blocked in its send would hold the finish call back: the run stops
            if not isinstance(exc, ray.exceptions.RayActorError):  # a frozen (or dead) engine is named instead
                try:
                    probe_engines(self.engines, self.names, "the weight sync", self.output_dir)
                except RuntimeError as named:
                    raise named from exc
            raise
        finally:
            finished = [learner.finish_weights.remote() for learner in self.learners]
            if finish:
                ray.get(finished, timeout=self.timeout)
        sent, phases = results[: len(self.learners)], results[len(self.learners) :]
        ray.get(self.queue.set_policy_version.remote(version + 1), timeout=self.timeout)
        timings = sync_timings(time.perf_counter() - started, started_at, sent, phases)
        return version + 1, {**timings, "perf/weight_sync_barrier_s": barrier_s}


def sync_timings(total_s: float, started_at: float, sent: list[float], phases: list[dict[str, float]]) -> dict[str, float]:
    """The `perf/weight_sync_*` metrics of one sync from the learners' send times and the engines' phases."""
    return {
        "perf/weight_sync_s": total_s,
        "perf/weight_sync_pause_s": max(p["pause_s"] for p in phases),
        "perf/weight_sync_transfer_s": max(p["load_s"] for p in phases),
        "perf/weight_sync_resume_s": max(p["resume_s"] for p in phases),
        # how long the slowest engine's call waited to start (a busy actor), and the learners' send
        "perf/weight_sync_dispatch_s": max(max(p.get("started_at", started_at) - started_at, 0.0) for p in phases),
        "perf/generation_loop_lag_max_s": max(p.get("loop_lag_max_s", 0.0) for p in phases),
        "perf/weight_sync_send_s": max(sent),
    }
