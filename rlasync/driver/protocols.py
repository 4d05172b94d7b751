"""What the step loop talks to, as async protocols: the sample queue, the learner group, the weight transport and
the rollout fleet. `actors/cluster.py` adapts Ray actor handles to them; the unit tests use fakes. Sample refs
are opaque here (in a real run the queue's entries: each sample's Ray object ref with what the learner group plans
the step's rows with, `rlasync.learner.sharing`): the step loop only hands them from the queue to the learners.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

MetricItems = list[tuple[str, Any]]
"""(name, value) pairs, as `rlasync.metrics.MetricSink.update` takes them."""


@dataclass
class Taken:
    """One poll of the queue: the refs of the fresh samples taken, their raw tokens, and the take's metrics;
    `step_full`: the queue composes steps and this one is complete (docs/algorithms.md §4.5.1)."""

    refs: list[Any] = field(default_factory=list)
    num_tokens: int = 0
    metrics: MetricItems = field(default_factory=list)
    step_full: bool = False


class SampleQueue(Protocol):
    """The staleness queue, learner side."""

    async def take(self, token_target: int, timeout_s: float) -> Taken:
        """Fresh samples up to `token_target` raw tokens (a queue that composes steps: those of the step, then
        `step_full`); waits at most `timeout_s` for the first one."""
        ...

    async def finish_step(self, tokens: int, unplanned: int = 0) -> None:
        """The step trained `tokens` raw tokens (the token allowance's next target); `unplanned` of its samples
        were in no rank's row (`batch/unplanned_count`), counted by the queue."""
        ...

    async def set_policy_version(self, version: int) -> None: ...

    async def state(self) -> dict[str, Any]:
        """`QueueState.to_dict()`: at least `done`, `queue_size`, `inflight_groups`."""
        ...

    async def rollout_state(self) -> dict[str, Any]:
        """`RolloutState.to_dict()`: what `rollout_state.json` holds."""
        ...


class LearnerGroup(Protocol):
    """Every learner rank, as one."""

    async def train_step(self, refs: Sequence[Any]) -> MetricItems:
        """One optimizer step on the samples behind `refs` (each rank gets its own rows' samples); rank 0's metric
        items."""
        ...

    async def save(self, directory: str, tokenizer: Any) -> None:
        """Model, tokenizer and optimizer into `directory` (every rank takes part; rank 0 writes)."""
        ...


class WeightTransport(Protocol):
    """The learners' weights to the generation engines."""

    async def sync(self, version: int) -> tuple[int, dict[str, float]]:
        """Send the current weights; returns the new served policy version and the sync's timings
        (`perf/weight_sync_*` metrics)."""
        ...


class Fleet(Protocol):
    """The rollout actors."""

    async def check_health(self, stale_after_s: float) -> Sequence[tuple[str, dict[str, Any]]] | None:
        """Raise `RuntimeError` naming the failing actor when one failed or its heartbeat is older than
        `stale_after_s` seconds; else the actors' `(name, health dict)` pairs, for the watchdog's reason (None:
        nothing to report)."""
        ...

    async def drain_metrics(self) -> MetricItems:
        """Metric items the rollout loops recorded since the last drain."""
        ...

    async def stop(self) -> None: ...


__all__ = ["Fleet", "LearnerGroup", "MetricItems", "SampleQueue", "Taken", "WeightTransport"]
