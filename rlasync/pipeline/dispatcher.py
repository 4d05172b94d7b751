"""Prompt leases: which dataset row each new group generates from, epochs, and the resume position.

Positions. Every prompt the run will ever generate has an absolute *position* `p = 0, 1, 2, ...` in the
stream "epoch 0's rows, then epoch 1's rows, ...": `row_index = p mod num_rows`, `epoch = p // num_rows`.
This is the space of `rollout_state.json`'s `prompt_index` (docs/algorithms.md §7.1): a run resumed from `prompt_index`
starts at position `start_index = prompt_index`, so its first pass starts at row `start_index mod num_rows`
and runs to the end of the dataset, later passes are full (docs/algorithms.md §2.2). With `num_epochs` set, the run ends
at position `ceil(num_epochs × num_rows)` (docs/algorithms.md §7.3's `target_groups`), so a resumed run only has the
remainder left.

Leases. `lease()` hands out a position as a `PromptLease` with a fresh `group_id` (a global counter starting
at 0 on every start, docs/algorithms.md §2.2). Holes are leased before new positions. Every lease ends in exactly one way:

    lease ──release()──────────────────────────────────────────► position leased again (not consumed)
      │ ──mark_dropped(reason)─────────────────────────────────► consumed: "zero_std" | "filtered"
      └─mark_queued(n)──► queued ──mark_trained / mark_stale──► (when all n samples are accounted for)
                                        some sample trained ──► consumed: "trained"
                                        every sample stale  ──► position leased again (a new group_id)

A lease may carry an owner (`assign_owner`: the rollout actor generating it); when that actor dies, its live,
not yet queued leases (`leases_of(owner)`) are released, so their prompts are generated again.

A group whose samples were all dropped as stale is not consumed: its position is leased again in the same
epoch rather than left as a hole for the next resume (docs/algorithms.md §7.1 only regenerates it on resume). Dropped
zero-std groups and `filter_prompt` rejections count as consumed (docs/algorithms.md §2.6.3, §7.3).

Resume. `first_untrained_index()` is the smallest position not yet consumed (TRL's `prompt_index =
dataset_start_index + first_untrained`), the value to write to `rollout_state.json`: the generator runs ahead
of the learner, so the generator's own position would skip prompts whose samples were never trained.

Invariant (property-tested): over any interleaving of the calls above, every position in
`[start_index, end)` is consumed exactly once. Pure Python: no torch, no ray.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass

from rlasync.records import DROP_REASONS, GroupOutcome, PromptLease

DropReason = GroupOutcome
"""Kept name: the outcomes `mark_dropped` takes are `DROP_REASONS` (zero_std, filtered, failed) of `GroupOutcome`."""


@dataclass(slots=True)
class _Group:
    """Mutable bookkeeping of one live lease (internal)."""

    lease: PromptLease
    owner: str | None = None  # who generates it (a rollout actor's name): its leases are released if it dies
    queued: bool = False
    pending_samples: int = 0
    trained_samples: int = 0


class PromptDispatcher:
    """Leases prompt positions epoch by epoch and tracks which have been consumed (see the module docstring).

    num_rows:     dataset length (>= 1)
    num_epochs:   passes over the dataset, fractional allowed; `None` = stream forever
    start_index:  the resume position (`rollout_state.json`'s `prompt_index`); 0 for a fresh run
    """

    def __init__(self, num_rows: int, num_epochs: float | None = 1.0, start_index: int = 0) -> None:
        if num_rows < 1:
            raise ValueError(f"num_rows={num_rows}: the dataset needs at least one row")
        if num_epochs is not None and not num_epochs > 0:
            raise ValueError(f"num_epochs={num_epochs}: must be > 0, or None to stream forever")
        if start_index < 0:
            raise ValueError(f"start_index={start_index}: must be >= 0")
        self.num_rows = num_rows
        self.num_epochs = num_epochs
        self.start_index = start_index
        self.end_index: int | None = None if num_epochs is None else math.ceil(num_epochs * num_rows)
        self._next_position = start_index
        self._relet: list[int] = []  # heap of positions to lease again (released or all-stale)
        self._groups: dict[int, _Group] = {}
        self._next_group_id = 0
        self._watermark = start_index  # every position below it is consumed
        self._consumed_ahead: set[int] = set()  # consumed positions above the watermark
        self.consumed_groups = 0
        self.outcome_counts: Counter[str] = Counter()
        self._epoch_consumed: Counter[int] = Counter()
        self._epoch_filtered: Counter[int] = Counter()

    # ---- leasing -------------------------------------------------------------------------------------------

    def has_leasable(self) -> bool:
        """Whether `lease()` would return a lease now."""
        return bool(self._relet) or self.end_index is None or self._next_position < self.end_index

    def lease(self) -> PromptLease | None:
        """The next prompt to generate, holes first; None when nothing is leasable now.

        None does not mean the run is over: leased groups may still come back (released, or all stale).
        `done` says whether every position has been consumed.
        """
        if self._relet:
            position = heapq.heappop(self._relet)
        elif self.end_index is None or self._next_position < self.end_index:
            position = self._next_position
            self._next_position += 1
        else:
            return None
        lease = PromptLease(
            group_id=self._next_group_id,
            row_index=position % self.num_rows,
            epoch=position // self.num_rows,
            position=position,
        )
        self._next_group_id += 1
        self._groups[lease.group_id] = _Group(lease)
        return lease

    def assign_owner(self, group_id: int, owner: str) -> None:
        """Record who generates the live lease `group_id` (a rollout actor), so `leases_of(owner)` finds it."""
        self._leased_group(group_id, "assign_owner").owner = owner

    def owners(self) -> set[str]:
        """The owners of live leases whose samples have not reached the queue."""
        return {g.owner for g in self._groups.values() if g.owner is not None and not g.queued}

    def leases_of(self, owner: str) -> list[PromptLease]:
        """The live leases of `owner` whose samples have not reached the queue (what dies with it), oldest first."""
        return [g.lease for g in self._groups.values() if g.owner == owner and not g.queued]

    def release(self, lease: PromptLease) -> None:
        """Give an unconsumed lease back (its rollout failed for good, or the worker stopped); it is leased again.

        Only `lease.group_id` is read, so a caller's own lease record with that attribute works too.
        """
        group = self._leased_group(lease.group_id, "release")
        del self._groups[lease.group_id]
        heapq.heappush(self._relet, group.lease.position)

    # ---- outcomes ------------------------------------------------------------------------------------------

    def mark_queued(self, group_id: int, num_samples: int) -> None:
        """The group's `num_samples` samples entered the queue; they are accounted for by mark_trained/mark_stale."""
        if num_samples < 1:
            raise ValueError(
                f"mark_queued: group {group_id} queued {num_samples} samples; a group without samples is "
                "dropped (mark_dropped), not queued"
            )
        group = self._leased_group(group_id, "mark_queued")
        group.queued = True
        group.pending_samples = num_samples

    def mark_dropped(self, group_id: int, reason: GroupOutcome | str) -> GroupOutcome:
        """The group ended without queuing samples, for a reason that counts as consumed (docs/algorithms.md §2.6.3).

        Raises ValueError when `filter_prompt` has rejected every prompt of a whole epoch (docs/algorithms.md §2.2).
        """
        if reason not in DROP_REASONS:
            raise ValueError(f"mark_dropped: unknown reason {reason!r}; expected one of {DROP_REASONS}")
        group = self._leased_group(group_id, "mark_dropped")
        outcome = GroupOutcome(reason)
        self._consume(group, outcome)
        return outcome

    def mark_trained(self, group_id: int, num_samples: int) -> GroupOutcome | None:
        """`num_samples` of the group's queued samples were taken by the learner.

        Returns the group's outcome once all its samples are accounted for, else None.
        """
        group = self._queued_group(group_id, num_samples, "mark_trained")
        group.pending_samples -= num_samples
        group.trained_samples += num_samples
        return self._settle(group)

    def mark_stale(self, group_id: int, num_samples: int) -> GroupOutcome | None:
        """`num_samples` of the group's queued samples were dropped as stale at take time (docs/algorithms.md §2.7).

        Returns the group's outcome once all its samples are accounted for, else None; "stale" means every
        sample was stale and the position will be leased again.
        """
        group = self._queued_group(group_id, num_samples, "mark_stale")
        group.pending_samples -= num_samples
        return self._settle(group)

    # ---- progress and resume -------------------------------------------------------------------------------

    def first_untrained_index(self) -> int:
        """The smallest position not yet consumed: `rollout_state.json`'s `prompt_index`."""
        return self._watermark

    @property
    def current_epoch(self) -> int:
        """The epoch of the first unconsumed position."""
        return self._watermark // self.num_rows

    def epoch_done(self, epoch: int) -> bool:
        """Whether every position of `epoch` within this run's range is consumed."""
        epoch_end = (epoch + 1) * self.num_rows
        if self.end_index is not None:
            epoch_end = min(epoch_end, self.end_index)
        return self._watermark >= epoch_end

    @property
    def done(self) -> bool:
        """Every position up to the epoch budget is consumed (never, when streaming forever)."""
        return self.end_index is not None and self._watermark >= self.end_index

    @property
    def num_leased(self) -> int:
        """Leases out now (generating, or with samples in the queue)."""
        return len(self._groups)

    # ---- internals -----------------------------------------------------------------------------------------

    def _leased_group(self, group_id: int, action: str) -> _Group:
        """The live, not yet queued group `group_id`."""
        group = self._live_group(group_id, action)
        if group.queued:
            raise ValueError(
                f"{action}: group {group_id} already has samples in the queue; its outcome now comes from "
                "mark_trained/mark_stale"
            )
        return group

    def _queued_group(self, group_id: int, num_samples: int, action: str) -> _Group:
        group = self._live_group(group_id, action)
        if not group.queued:
            raise ValueError(f"{action}: group {group_id} has no queued samples (call mark_queued first)")
        if not 0 < num_samples <= group.pending_samples:
            raise ValueError(
                f"{action}: group {group_id} has {group.pending_samples} samples pending; "
                f"cannot account for {num_samples}"
            )
        return group

    def _live_group(self, group_id: int, action: str) -> _Group:
        group = self._groups.get(group_id)
        if group is not None:
            return group
        if 0 <= group_id < self._next_group_id:
            raise ValueError(f"{action}: group {group_id} already ended (completed, dropped or released)")
        raise ValueError(f"{action}: unknown group {group_id}; it was never leased")

    def _settle(self, group: _Group) -> GroupOutcome | None:
        if group.pending_samples > 0:
            return None
        if group.trained_samples > 0:
            self._consume(group, GroupOutcome.TRAINED)
            return GroupOutcome.TRAINED
        del self._groups[group.lease.group_id]
        heapq.heappush(self._relet, group.lease.position)
        self.outcome_counts[GroupOutcome.STALE.value] += 1
        return GroupOutcome.STALE

    def _consume(self, group: _Group, outcome: GroupOutcome) -> None:
        lease = group.lease
        del self._groups[lease.group_id]
        assert lease.position >= self._watermark and lease.position not in self._consumed_ahead, lease
        self._consumed_ahead.add(lease.position)
        while self._watermark in self._consumed_ahead:
            self._consumed_ahead.remove(self._watermark)
            self._watermark += 1
        self.consumed_groups += 1
        self.outcome_counts[outcome.value] += 1
        self._count_epoch(lease.epoch, outcome)

    def _count_epoch(self, epoch: int, outcome: GroupOutcome) -> None:
        self._epoch_consumed[epoch] += 1
        self._epoch_filtered[epoch] += outcome is GroupOutcome.FILTERED
        whole_epoch = self._epoch_consumed[epoch] == self.num_rows
        if whole_epoch and self._epoch_filtered[epoch] == self.num_rows:
            raise ValueError(
                f"filter_prompt rejected every prompt of epoch {epoch} ({self.num_rows} rows): nothing can be "
                "trained; check the filter"
            )
