"""The sample buffer between rollouts and the learner: FIFO, token-targeted takes, staleness dropped at take time.

    put(entries)  one group's scored samples ──► [ entry, entry, ... ]  (FIFO; stamped with the enqueue time)
    take(token_target, current_version, max_staleness, admit=None)
        pop from the front; an entry with current_version − policy_version > max_staleness is dropped (and
        returned in `dropped_stale`, so its group's accounting can be updated); stop once the taken entries
        hold ≥ token_target raw tokens. At least one entry is taken whenever a fresh one is available.
        With `admit` (a step's composer, `rlasync.packing.step_plan`) the token target is not read: fresh entries
        are taken while `admit(entry)` says they belong to the step; the first refused one stays at the front.

An entry's payload is opaque: in the StalenessQueue actor it is the Ray ObjectRef of a `RolloutSample`, never
fetched by the queue; here it can be any object. `take` never blocks; `wait_take` is the asyncio variant that
waits (up to a timeout) for a `put`.

Metrics of a take (docs/algorithms.md §2.7, §8.2), for `MetricSink.update`. Per consumed (taken, not dropped)
sample, as `(sum, count)` pairs so that the window reduces to the mean over samples however many takes it holds:
`rollout/queue_size` (samples still queued right after the sample was popped), `sample/time_in_queue_s`,
`sample/staleness_mean`; plus `sample/staleness_max` (float, max) and `sample/dropped_stale_count` (float, sum;
present even when 0). Takes that consume nothing report only the drop count. Pure Python: no torch, no ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlasync.metrics import MetricValue
from rlasync.pipeline._notify import Notifier
from rlasync.records import RolloutSample

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True, eq=False)
class QueueEntry:
    """One scored sample waiting for the learner: an opaque payload plus what the queue needs to know.

    num_tokens:          raw (forwarded) tokens of the sample: prompt + tools + completion
    num_trained_tokens:  tokens with a loss term
    policy_version:      the policy version the sample's group was generated under
    input_ids:           the sample's token ids, for the step's composer and the split of a step over the learner
                         ranks (None: planned as sharing nothing; the step is not split ahead)
    metrics:             the sample's per-sample scalars (the planner's metrics, computed where the step is split)
    enqueued_at:         stamped by `StalenessQueue.put` with the queue's clock
    """

    payload: Any
    group_id: int
    policy_version: int
    num_tokens: int
    num_trained_tokens: int = 0
    row_index: int = -1
    input_ids: Any = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    enqueued_at: float = math.nan

    @classmethod
    def for_sample(cls, sample: RolloutSample, payload: Any = None) -> QueueEntry:
        """The entry for `sample`; the payload defaults to the sample itself (the actor passes its ObjectRef)."""
        return cls(
            payload=sample if payload is None else payload,
            group_id=sample.group_id,
            policy_version=sample.policy_version,
            num_tokens=len(sample),
            num_trained_tokens=sample.num_trained_tokens,
            row_index=sample.row_index,
            input_ids=getattr(sample, "input_ids", None),
            metrics=dict(getattr(sample, "metrics", None) or {}),
        )


@dataclass(frozen=True, slots=True)
class TakeResult:
    """What one take returned: entries for the learner, entries dropped as stale, and the take's metrics;
    `step_full`: a composed take's step is complete (the next entry opens the next step)."""

    entries: tuple[QueueEntry, ...]
    dropped_stale: tuple[QueueEntry, ...]
    metrics: dict[str, MetricValue]
    step_full: bool = False

    @property
    def num_tokens(self) -> int:
        """Raw tokens of the taken entries."""
        return sum(entry.num_tokens for entry in self.entries)


@dataclass(slots=True)
class _Tally:
    """Observations accumulated over one (possibly waiting) take (internal)."""

    entries: list[QueueEntry] = field(default_factory=list)
    dropped: list[QueueEntry] = field(default_factory=list)
    queue_sizes: list[int] = field(default_factory=list)
    times_in_queue: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    tokens: int = 0

    def result(self) -> TakeResult:
        metrics: dict[str, MetricValue] = {"sample/dropped_stale_count": float(len(self.dropped))}
        if self.entries:
            count = float(len(self.entries))
            metrics["rollout/queue_size"] = (float(sum(self.queue_sizes)), count)
            metrics["sample/time_in_queue_s"] = (math.fsum(self.times_in_queue), count)
            metrics["sample/staleness_mean"] = (float(sum(self.staleness)), count)
            metrics["sample/staleness_max"] = float(max(self.staleness))
        return TakeResult(entries=tuple(self.entries), dropped_stale=tuple(self.dropped), metrics=metrics)


class StalenessQueue:
    """FIFO of `QueueEntry`s with token-targeted, staleness-checked takes (see the module docstring).

    Not thread-safe: the actor serialises calls. `clock` (seconds) stamps enqueue times and measures time in
    queue; `notifier` is shared when one actor hosts several waiting components.
    """

    def __init__(self, clock: Clock = time.monotonic, notifier: Notifier | None = None) -> None:
        self._clock = clock
        self._notifier = notifier or Notifier()
        self._entries: deque[QueueEntry] = deque()
        self._num_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        """Raw tokens of every queued entry."""
        return self._num_tokens

    def put(self, entries: Iterable[QueueEntry], now: float | None = None) -> None:
        """Append one group's samples (together, in order), stamped with the enqueue time."""
        entries = list(entries)
        check_group_entries(entries)
        stamp = self._clock() if now is None else now
        for entry in entries:
            self._entries.append(dataclasses.replace(entry, enqueued_at=stamp))
            self._num_tokens += entry.num_tokens
        self._notifier.notify()

    def take(
        self,
        token_target: int,
        current_version: int,
        max_staleness: int,
        now: float | None = None,
        admit: Callable[[QueueEntry], bool] | None = None,
    ) -> TakeResult:
        """Pop entries until the taken raw tokens reach `token_target` (with `admit`: while it admits them); never
        blocks (may return nothing)."""
        tally = _Tally()
        self._take_into(tally, token_target, current_version, max_staleness, now, admit)
        return tally.result()

    async def wait_take(
        self, token_target: int, current_version: int, max_staleness: int, *, timeout_s: float | None
    ) -> TakeResult:
        """`take`, waiting up to `timeout_s` (None = forever) for a fresh entry when none is queued.

        Returns as soon as a take got at least one entry (possibly fewer tokens than the target: call again
        for the rest), or when the time is up (then with nothing taken, but with any stale drops).
        """
        tally = _Tally()
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            self._take_into(tally, token_target, current_version, max_staleness, None)
            if tally.entries:
                break
            remaining = None if deadline is None else deadline - loop.time()
            if not await self._notifier.wait(remaining):
                break
        return tally.result()

    def _take_into(
        self,
        tally: _Tally,
        token_target: int,
        current_version: int,
        max_staleness: int,
        now: float | None,
        admit: Callable[[QueueEntry], bool] | None = None,
    ) -> None:
        now = self._clock() if now is None else now
        while self._entries and (admit is not None or tally.tokens < token_target or not tally.entries):
            entry = self._entries[0]
            staleness = current_version - entry.policy_version
            if staleness <= max_staleness and admit is not None and not admit(entry):
                break  # it opens the next step: it stays at the front
            self._entries.popleft()
            self._num_tokens -= entry.num_tokens
            if staleness > max_staleness:
                tally.dropped.append(entry)
                continue
            tally.entries.append(entry)
            tally.tokens += entry.num_tokens
            tally.queue_sizes.append(len(self._entries))
            tally.times_in_queue.append(now - entry.enqueued_at)
            tally.staleness.append(staleness)


def empty_take() -> TakeResult:
    """A take that got nothing (the metrics of an empty take)."""
    return _Tally().result()


def check_group_entries(entries: list[QueueEntry]) -> None:
    """A put holds one group's samples: at least one entry, all with the same group_id, none negative in size."""
    if not entries:
        raise ValueError("put: no entries; a group without samples is dropped, not queued")
    group_ids = {entry.group_id for entry in entries}
    if len(group_ids) != 1:
        raise ValueError(f"put: entries of several groups {sorted(group_ids)}; put one group's samples at a time")
    for entry in entries:
        if entry.num_tokens < 0 or entry.num_trained_tokens < 0:
            raise ValueError(f"put: negative token count in {entry}")
