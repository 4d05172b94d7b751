"""The Cluster's weight sync: the group of learner rank 0 and every engine, and one sync as the step loop's
`WeightTransport` (`sync(version) -> (version + 1, timings)`). Every Ray call of a weight sync is here.

    connect_weights   device identities -> transport (NCCL when each holds its own GPU, gloo, or "ipc") -> join the
                      group (every member at once: a rendezvous) -> rank 0's manifest
    RayWeightSync     learners send (or share, over "ipc") while the engines receive, pause, load, resume; then the
                      queue publishes version + 1
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

from rlasync.weights.broadcast import choose_backend

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()
# Blocking Ray calls run here, off the step loop's event loop. Not asyncio's default executor: on Ctrl-C,
# asyncio.run would wait for that one (a train_step's ray.get can block for an hour) before the Cluster kills the
# actors, which is what unblocks these threads.
_RAY_CALLS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlasync-ray")


async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` (a blocking Ray call) awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_RAY_CALLS, partial(fn, *args, **kwargs))


def _warn_once(message: str) -> None:
    """Log `message` as a warning the first time this process sees it."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def connect_weights(learners: list[Any], engines: list[Any], cluster: Any) -> tuple[str, list[Any]]:
    """Join learner rank 0 and every engine into the weight-sync group; returns (backend, rank 0's manifest)."""
    timeout = cluster.collective_timeout_s
    host, port = ray.get(learners[0].address.remote(), timeout=timeout)
    world = 1 + len(engines)
    infos = ray.get([learners[0].device_info.remote()] + [e.device_info.remote() for e in engines], timeout=timeout)
    backend, why_not_nccl = choose_backend(infos[0], infos[1:], cluster.weight_sync_backend)
    if why_not_nccl:
        _warn_once(f"weight sync: {why_not_nccl}")
    bucket_bytes = max(1, int(cluster.weight_sync_bucket_mb * (1 << 20)))
    ray.get(
        [learners[0].join_weight_group.remote(host, port, world, timeout, backend, bucket_bytes)]
        + [
            engine.join_weight_group.remote(host, port, i + 1, world, timeout, backend, bucket_bytes)
            for i, engine in enumerate(engines)
        ],
        timeout=timeout + 30,
    )
    logger.info("weight-sync group: %d engines over %s", len(engines), backend)
    return backend, ray.get(learners[0].manifest.remote(), timeout=timeout)


class RayWeightSync:
    """Every learner rank gathers, rank 0 broadcasts; each engine receives while still generating, pauses (its step
    in flight finishes meanwhile), loads, resumes (`GenerationActor.sync_weights`); then version + 1 is published.
    The timings are the sync's phases (SPEC §6.1 names): `perf/weight_sync_s` (total, including the version
    bump), and over the engines the slowest `perf/weight_sync_pause_s` (until paused, overlapping the transfer),
    `perf/weight_sync_transfer_s` (paused until loaded: what of the transfer did not overlap, and the copies) and
    `perf/weight_sync_resume_s`; also `perf/weight_sync_dispatch_s` (until the slowest engine's call started) and
    `perf/weight_sync_send_s` (rank 0's broadcast, waiting for the receivers included), and
    `perf/generation_loop_lag_max_s` (the worst event-loop lag of a GenerationActor since the previous sync)."""

    def __init__(self, learners: list[Any], engines: list[Any], queue: Any, manifest: list[Any], timeout: float,
                 staging_bytes: int = 0, backend: str = "gloo") -> None:  # fmt: skip
        self.learners, self.engines, self.queue = learners, engines, queue
        self.manifest, self.timeout, self.staging_bytes, self.backend = manifest, timeout, staging_bytes, backend

    async def sync(self, version: int) -> tuple[int, dict[str, float]]:
        return await in_thread(self.sync_now, version)

    def sync_now(self, version: int) -> tuple[int, dict[str, float]]:
        """One sync, blocking (the cold sync runs it before the step loop starts)."""
        started, started_at = time.perf_counter(), time.time()
        sent: list[float] = []
        if self.backend == "ipc":  # rank 0 shares buckets on its device; the engines copy from them; then release
            handles = ray.get([learner.share_weights.remote() for learner in self.learners], timeout=self.timeout)[0]
            try:
                phases = ray.get(
                    [engine.sync_weights.remote(self.manifest, 0, handles) for engine in self.engines],
                    timeout=self.timeout + 60,
                )
            finally:
                ray.get(self.learners[0].release_weights.remote(), timeout=self.timeout)
        else:
            results = ray.get(
                [learner.send_weights.remote() for learner in self.learners]
                + [engine.sync_weights.remote(self.manifest, self.staging_bytes) for engine in self.engines],
                timeout=self.timeout + 60,
            )
            sent, phases = results[: len(self.learners)], results[len(self.learners) :]
        ray.get(self.queue.set_policy_version.remote(version + 1), timeout=self.timeout)
        timings = {
            "perf/weight_sync_s": time.perf_counter() - started,
            "perf/weight_sync_pause_s": max(p["pause_s"] for p in phases),
            "perf/weight_sync_transfer_s": max(p["load_s"] for p in phases),
            "perf/weight_sync_resume_s": max(p["resume_s"] for p in phases),
            # how long the slowest engine's call waited to start (a busy actor), and the learners' send
            "perf/weight_sync_dispatch_s": max(max(p.get("started_at", started_at) - started_at, 0.0) for p in phases),
            "perf/generation_loop_lag_max_s": max(p.get("loop_lag_max_s", 0.0) for p in phases),
        }
        if sent:
            timings["perf/weight_sync_send_s"] = max(sent)
        return version + 1, timings
