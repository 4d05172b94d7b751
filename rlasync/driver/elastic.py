"""Elastic pools, the pure side (no Ray): when to add or remove generation and rollout actors while a run goes.

    StepLoop ──after_step(step, window metrics)──► ElasticController
        1. resize requests (`trainer.resize(generation=2)`, from any thread), checked against the bounds
        2. else, with `cluster.elastic`, every `elastic_interval_steps`: ElasticPolicy.decide(metrics, sizes)
        3. a target differing from the current sizes ──► Resizable.resize(target) (the Cluster: actors/cluster_elastic.py)

The policy reads the window's means (docs/algorithms.md §8 names): `perf/rollout_wait_s` over `perf/step_s` is how
much of a step the learner waited for samples; `rollout/vllm_kv_cache_usage_frac` and `rollout/vllm_queued_requests`
say whether the engines are saturated. Waiting a lot with saturated engines: one more GenerationActor; waiting with
engines that have room: the rollout side does not feed them, one more rollout actor; hardly waiting: the learner
is the bottleneck, one generation actor less (else one rollout actor less), never below the minimum. One change per
decision, then `interval_steps` steps of quiet so the metrics show the new size before the next decision.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from rlasync.driver.protocols import MetricItems

logger = logging.getLogger(__name__)

POOLS = ("generation", "rollout")


@dataclass(frozen=True)
class Sizes:
    """Actors per pool."""

    generation: int
    rollout: int

    def get(self, pool: str) -> int:
        return self.generation if pool == "generation" else self.rollout


@dataclass(frozen=True)
class ElasticBounds:
    """`(min, max)` actors per pool (`ClusterConfig.pool_bounds`)."""

    generation: tuple[int, int]
    rollout: tuple[int, int]

    @classmethod
    def from_cluster(cls, cluster: Any) -> ElasticBounds:
        return cls(cluster.pool_bounds("generation"), cluster.pool_bounds("rollout"))

    def check(self, pool: str, count: int) -> int:
        """`count` if it is within the pool's bounds, else a ValueError naming the fields to change."""
        low, high = getattr(self, pool)
        if isinstance(count, bool) or not isinstance(count, int) or not low <= count <= high:
            raise ValueError(
                f"resize({pool}={count!r}): the {pool} pool takes {low}..{high} actors "
                f"(cluster.min_{pool}_actors / cluster.max_{pool}_actors)"
            )
        return count

    def clamp(self, sizes: Sizes) -> Sizes:
        (glow, ghigh), (rlow, rhigh) = self.generation, self.rollout
        return Sizes(min(max(sizes.generation, glow), ghigh), min(max(sizes.rollout, rlow), rhigh))


@dataclass(frozen=True)
class ElasticPolicySettings:
    interval_steps: int = 5
    wait_high_frac: float = 0.3
    """The learner waited more than this fraction of a step for samples: the generation side is too small."""
    wait_low_frac: float = 0.05
    """Less than this: the generation side is larger than the learner needs."""
    saturated_kv_frac: float = 0.8
    """Engines with more of their KV cache in use (or any request queued) are saturated."""


class ElasticPolicy:
    """Decides a new size from a window of step metrics (see the module docstring); None: keep the sizes."""

    def __init__(self, bounds: ElasticBounds, settings: ElasticPolicySettings | None = None) -> None:
        self.bounds = bounds
        self.settings = settings or ElasticPolicySettings()
        self._quiet_until = 0

    def decide(self, step: int, metrics: dict[str, Any], sizes: Sizes) -> Sizes | None:
        s = self.settings
        if step < self._quiet_until or step % s.interval_steps != 0:
            return None
        wait, step_s = metrics.get("perf/rollout_wait_s"), metrics.get("perf/step_s")
        if not isinstance(wait, (int, float)) or not isinstance(step_s, (int, float)) or step_s <= 0:
            return None  # no full step measured yet
        frac = wait / step_s
        saturated = (
            float(metrics.get("rollout/vllm_kv_cache_usage_frac") or 0.0) > s.saturated_kv_frac
            or float(metrics.get("rollout/vllm_queued_requests") or 0.0) > 0
        )
        (_, ghigh), (_, rhigh) = self.bounds.generation, self.bounds.rollout
        (glow, _), (rlow, _) = self.bounds.generation, self.bounds.rollout
        target = None
        if frac > s.wait_high_frac:
            if saturated and sizes.generation < ghigh:
                target = Sizes(sizes.generation + 1, sizes.rollout)
            elif sizes.rollout < rhigh:
                target = Sizes(sizes.generation, sizes.rollout + 1)
            elif sizes.generation < ghigh:
                target = Sizes(sizes.generation + 1, sizes.rollout)
        elif frac < s.wait_low_frac:
            if not saturated and sizes.generation > glow:
                target = Sizes(sizes.generation - 1, sizes.rollout)
            elif sizes.rollout > rlow:
                target = Sizes(sizes.generation, sizes.rollout - 1)
        if target is None:
            return None
        self._quiet_until = step + s.interval_steps + 1  # the next decision sees a window at the new size
        logger.info(
            "elastic: learner waited %.0f%% of a step (engines %s): %s -> %s",
            100 * frac,
            "saturated" if saturated else "with room",
            sizes,
            target,
        )
        return target


class Resizable(Protocol):
    """The pools of a running cluster (actors/cluster_elastic.py implements it over Ray)."""

    def sizes(self) -> Sizes: ...

    async def resize(self, target: Sizes) -> MetricItems:
        """Add or remove actors until the pools have `target` sizes; metric items of what was done."""
        ...


class ResizeRequests:
    """Sizes asked for by the user while the run goes (`trainer.resize`), from any thread; the newest wins."""

    def __init__(self, bounds: ElasticBounds) -> None:
        self.bounds = bounds
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}

    def request(self, generation: int | None = None, rollout: int | None = None) -> None:
        """Ask for pool sizes (None: unchanged); ValueError when out of the bounds."""
        if generation is None and rollout is None:
            raise ValueError("resize(): give generation=N and/or rollout=N")
        asked = {
            pool: self.bounds.check(pool, n)
            for pool, n in zip(POOLS, (generation, rollout), strict=True)
            if n is not None
        }
        with self._lock:
            self._pending.update(asked)

    def take(self, sizes: Sizes) -> Sizes | None:
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return None
        return Sizes(pending.get("generation", sizes.generation), pending.get("rollout", sizes.rollout))


class ElasticController:
    """The StepLoop's elastic hook: `after_step(step, metrics)` applies a user request or the policy's decision."""

    def __init__(self, pools: Resizable, requests: ResizeRequests, policy: ElasticPolicy | None = None) -> None:
        self.pools, self.requests, self.policy = pools, requests, policy

    async def after_step(self, step: int, metrics: dict[str, Any]) -> MetricItems:
        sizes = self.pools.sizes()
        target = self.requests.take(sizes)
        if target is None and self.policy is not None:
            target = self.policy.decide(step, metrics, sizes)
        items: MetricItems = []
        if target is not None and target != sizes:
            items = list(await self.pools.resize(self.requests.bounds.clamp(target)))
            sizes = self.pools.sizes()
        return [
            *items,
            ("elastic/generation_actors", float(sizes.generation)),
            ("elastic/rollout_actors", float(sizes.rollout)),
        ]


__all__ = [
    "ElasticBounds",
    "ElasticController",
    "ElasticPolicy",
    "ElasticPolicySettings",
    "POOLS",
    "Resizable",
    "ResizeRequests",
    "Sizes",
]
