"""`StreamingDispatcher`: the prompt dispatcher over a streaming dataset (`rlasync.data.streaming`).

Positions, leases, outcomes and the resume watermark are `PromptDispatcher`'s (see `rlasync.pipeline.dispatcher`);
what differs is where rows come from. New positions take the next row of the stream, so each lease carries its
`row` (the rollout actors cannot index the dataset) and the dispatcher keeps the row of every position not yet
consumed (live leases and positions to lease again), dropping it once consumed. `row_index` is the row's index
within its pass and `epoch` the pass number. Without repetition the stream is one pass and the run ends when it
is consumed; a resumed run skips the `start_index` rows consumed before. Pure Python: no torch, no ray.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from rlasync.data.streaming import RowStream
from rlasync.pipeline.dispatcher import PromptDispatcher, _Group
from rlasync.records import GroupOutcome, PromptLease

UNKNOWN_LENGTH = 2**62
"""`num_rows` while the stream's length is unknown (positions never reach it)."""


class StreamingDispatcher(PromptDispatcher):
    """Leases rows of `rows` (a re-iterable dataset) in order; `repeat=True` (a `max_steps` run) iterates it again
    when it ends, else one pass. `start_index` rows are skipped (a resumed run)."""

    def __init__(self, rows: Iterable[Any], *, repeat: bool, start_index: int = 0) -> None:
        super().__init__(UNKNOWN_LENGTH, None, start_index=start_index)
        self.stream = RowStream(rows, repeat=repeat)
        self._rows: dict[int, tuple[int, int, Any]] = {}  # position -> (epoch, row_index, row), unconsumed only
        self._pass_starts = [0]  # position of each pass's first row
        self._lookahead: tuple[int, int, Any] | None = None
        self._pulled = 0  # rows taken from the stream (positions 0 .. _pulled-1)
        for _ in range(start_index):
            if self._pull() is None:
                raise ValueError(
                    f"resume: the checkpoint consumed {start_index} prompts but the streaming dataset has only "
                    f"{self._pulled}: resume with the same dataset"
                )
        self._lookahead = None

    @property
    def pass_length(self) -> int | None:
        """Rows in one pass of the stream, once a pass ended."""
        return self.stream.pass_length

    def has_leasable(self) -> bool:
        return bool(self._relet) or self._peek() is not None

    def lease(self) -> PromptLease | None:
        if self._relet:
            position = heapq.heappop(self._relet)
            epoch, row_index, row = self._rows[position]
        else:
            entry = self._peek()
            if entry is None:
                return None
            self._lookahead = None
            epoch, row_index, row = entry
            position = self._next_position
            self._next_position += 1
            self._rows[position] = entry
        lease = PromptLease(group_id=self._next_group_id, row_index=row_index, row=row, epoch=epoch, position=position)
        self._next_group_id += 1
        self._groups[lease.group_id] = _Group(lease)
        return lease

    def _peek(self) -> tuple[int, int, Any] | None:
        if self._lookahead is None:
            self._lookahead = self._pull()
        return self._lookahead

    def _pull(self) -> tuple[int, int, Any] | None:
        known = self.pass_length is not None
        pulled = self.stream.next_row()
        if not known and self.pass_length is not None:
            self._check_filtered()  # the pass just ended: was every one of its prompts rejected?
        if pulled is None:
            self.end_index = self._pulled  # one pass, ended: the run ends once every position is consumed
            return None
        pass_number, row = pulled
        if pass_number >= len(self._pass_starts):
            self._pass_starts.append(self._pulled)
        entry = (pass_number, self._pulled - self._pass_starts[pass_number], row)
        self._pulled += 1
        return entry

    def _consume(self, group: _Group, outcome: GroupOutcome) -> None:
        self._rows.pop(group.lease.position, None)
        super()._consume(group, outcome)

    def _count_epoch(self, epoch: int, outcome: GroupOutcome) -> None:
        """An epoch is one pass; the every-prompt-filtered check runs once the pass length is known."""
        self._epoch_consumed[epoch] += 1
        self._epoch_filtered[epoch] += outcome is GroupOutcome.FILTERED
        self._check_filtered()

    def _check_filtered(self) -> None:
        length = self.pass_length
        if length is None:
            return
        for epoch, consumed in self._epoch_consumed.items():
            if consumed == length and self._epoch_filtered[epoch] == length:
                raise ValueError(
                    f"filter_prompt rejected every prompt of pass {epoch} over the streaming dataset ({length} "
                    "rows): nothing can be trained; check the filter"
                )


__all__ = ["StreamingDispatcher"]
