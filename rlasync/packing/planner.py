"""Micro-batch planners: which sample goes into which rank's row (docs/algorithms.md §4.5, §4.8).

A micro-batch is one `TreeRow` per DP rank. Planning is separate from doing: the planners only decide placements
(they fill `TreeRow`s, which price themselves); `MicroBatch.pack()` / `layout.pack` build the arrays.

Both planners are incremental, for a pull loop over the sample stream:

    batcher = TokenBudgetBatcher(num_ranks=P, token_budget=B)
    for sample in stream:
        for micro_batch in batcher.push(sample):   # micro-batches closed by this push (at most one)
            train_on(micro_batch)
    last = batcher.flush()                        # end of a finite stream (e.g. an epoch)

Invariants of every emitted micro-batch: exactly `num_ranks` rows and none of them empty (a rank with nothing to
forward would leave the other ranks' collectives waiting); with a token budget, every row holds at most
`token_budget` unique tokens and at most `token_budget` trained tokens.

`flush()` with fewer buffered samples than ranks cannot fill every row: it returns None and keeps the samples
buffered (`pending`), so a later `push` continues with them; `take_pending()` hands them back instead.

`plan(samples)` plans a finite list (a whole optimizer step) and completes such a short tail (docs/algorithms.md
§4.5.2), because its samples were taken for training: the token-budget planners fill the tail's empty rows by
moving a sample out of a row holding several (the open rows', then the latest micro-batch's first, heaviest row
first: rows only shrink, a moved sample fits alone), else put each tail sample beside the least-loaded earlier row
it fits in; the fixed-count planner merges the tail into the last micro-batch (no budget). What still fits nowhere
(a step of fewer samples than ranks; single-sample rows too full to take it) stays `pending`: the caller counts
it unplanned. `tail_planned_count` is the tail samples `plan` placed so.

Dropped oversize samples (`len > token_budget`) are counted, never raised: `dropped_oversize_count` on the
batcher is the running total, and each `MicroBatch.dropped_oversize_count` holds the drops since the previous
emitted micro-batch (so summing the micro-batches' counts gives the total; drops after the last emitted
micro-batch show up only on the batcher until the next one).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from rlasync.packing.collate import pad_rows
from rlasync.packing.layout import PackedRow, pack
from rlasync.packing.metrics import packing_metrics
from rlasync.packing.trie import TreeRow
from rlasync.records import PackableSample

logger = logging.getLogger(__name__)

Placement = Literal["seed", "1.16"]
PLACEMENTS: tuple[Placement, ...] = ("seed", "1.16")


@dataclass(eq=False)
class MicroBatch:
    """One row per rank, as planned.

    `token_budget` is the budget the rows were planned under (None for fixed-count batches);
    `dropped_oversize_count` the oversize samples dropped since the previous micro-batch (None without a budget).
    """

    rows: list[TreeRow]
    token_budget: int | None = None
    dropped_oversize_count: int | None = None

    @property
    def samples(self) -> list[PackableSample]:
        """All samples, row by row."""
        return [sample for row in self.rows for sample in row.samples]

    @property
    def num_samples(self) -> int:
        return sum(row.num_samples for row in self.rows)

    @property
    def group_ids(self) -> set[int]:
        """Groups trained by this micro-batch (feeds the trainer's "groups trained" set)."""
        return set().union(*(row.groups for row in self.rows))

    def pack(self) -> list[PackedRow]:
        """Lay every row out (docs/algorithms.md §4.2), rank order."""
        return [pack(row) for row in self.rows]

    def collate(self, pad_token_id: int) -> dict[str, np.ndarray]:
        """Pack and pad the rows into rectangular [P, ...] arrays with the broadcast scalars (docs/algorithms.md §4.6)."""
        return pad_rows(self.pack(), pad_token_id)

    def metrics(self) -> dict[str, Any]:
        """Collator metrics of docs/algorithms.md §4.6, plus `batch/dropped_oversize_count` when planned under a budget."""
        return packing_metrics(self.rows, self.token_budget, dropped_oversize_count=self.dropped_oversize_count)


class BudgetBatcher:
    """The skeleton every token-budget planner shares (GRPO's tree rows here, distillation's plain rows in
    `rlasync.algorithms.distill.batching`): samples placed one at a time into rows of at most `token_budget` tokens,
    an oversize sample dropped and counted, the open micro-batch emitted when a sample fits in no row.

    A subclass gives `_new_rows()` (one empty row per rank), `_place(sample)` (the rank, or None: close first),
    `_batch(rows, dropped)` (the micro-batch of closed rows), `_describe(sample)` (how errors and the drop warning
    name a sample) and `flush()`.
    """

    def __init__(self, num_ranks: int, token_budget: int) -> None:
        if num_ranks < 1:
            raise ValueError(f"{type(self).__name__}: num_ranks must be >= 1, got {num_ranks}")
        if token_budget < 1:
            raise ValueError(f"{type(self).__name__}: token_budget must be >= 1, got {token_budget}")
        self.num_ranks = num_ranks
        self.token_budget = token_budget
        self.dropped_oversize_count = 0  # running total since construction
        self.tail_planned_count = 0  # the last `plan`'s short-tail samples it placed (module docstring)
        self._dropped_since_emit = 0
        self._rows: list[Any] = self._new_rows()

    def _new_rows(self) -> list[Any]:
        raise NotImplementedError

    def _place(self, sample: Any) -> int | None:
        raise NotImplementedError

    def _batch(self, rows: list[Any], dropped: int) -> Any:
        raise NotImplementedError

    def _describe(self, sample: Any) -> str:
        return f"group {sample.group_id}"

    def flush(self) -> Any:
        raise NotImplementedError

    @property
    def pending(self) -> list[Any]:
        """Samples placed in the open (not yet emitted) rows."""
        return [sample for row in self._rows for sample in row.samples]

    def take_pending(self) -> list[Any]:
        """Empty the open rows and return their samples."""
        samples = self.pending
        self._rows = self._new_rows()
        return samples

    def push(self, sample: Any) -> list[Any]:
        """Place `sample`; return the micro-batch its placement closed (empty list or one micro-batch)."""
        if len(sample) == 0:
            raise ValueError(f"cannot plan an empty sample ({self._describe(sample)}): input_ids has no token")
        if len(sample) > self.token_budget:
            self.dropped_oversize_count += 1
            self._dropped_since_emit += 1
            logger.warning(
                "dropping a sample of %d tokens (%s): longer than token_budget=%d, it fits in no row",
                len(sample),
                self._describe(sample),
                self.token_budget,
            )
            return []
        closed = []
        rank = self._place(sample)
        if rank is None:  # a fresh set of rows always has room for an admissible sample
            closed.append(self._emit())
            rank = self._place(sample)
            assert rank is not None
        self._rows[rank].add(sample)
        return closed

    def would_close(self, sample: Any) -> bool:
        """Whether pushing `sample` would close the open micro-batch (it fits in no row and is not oversize, so it
        would open the next one); nothing changes."""
        return 0 < len(sample) <= self.token_budget and self._place(sample) is None

    def plan(self, samples: Iterable[Any]) -> list[Any]:
        """Plan a finite list: every push, then a flush; a short tail is completed (module docstring). Samples
        that fit nowhere stay `pending`."""
        batches = [batch for sample in samples for batch in self.push(sample)]
        last = self.flush()
        self.tail_planned_count = 0
        if last is None and self.pending:
            last = self._complete_tail(batches)
        return batches if last is None else [*batches, last]

    def _fresh_row(self) -> Any:
        """An empty row of this planner's kind."""
        return self._new_rows()[0]

    def _fits(self, row: Any, sample: Any) -> bool:
        """Whether `sample` fits beside `row`'s samples within the budget."""
        raise NotImplementedError

    def _complete_tail(self, batches: list[Any]) -> Any:
        """The open rows cannot be emitted (a row is empty): fill the empty rows with samples moved out of
        multi-sample rows and return the last micro-batch, or, without enough of those, add each open sample to
        the least-loaded earlier row it fits in (None returned; what fits nowhere stays pending)."""
        open_rows = self._rows
        tail = [sample for row in open_rows for sample in row.samples]
        empty = [r for r, row in enumerate(open_rows) if row.num_samples == 0]
        donors = [open_rows, *(batch.rows for batch in reversed(batches))]  # the open rows first, latest first
        if sum(max(row.num_samples - 1, 0) for rows in donors for row in rows) >= len(empty):
            for r in empty:
                rows = next(rows for rows in donors if any(row.num_samples >= 2 for row in rows))
                donor = max((d for d, row in enumerate(rows) if row.num_samples >= 2), key=lambda d: rows[d].load)
                *kept, moved = rows[donor].samples
                rows[donor] = self._row_of(kept)
                open_rows[r] = self._row_of([moved])
            self.tail_planned_count = len(tail)
            return self._emit()
        self._rows = self._new_rows()
        left = []
        for sample in tail:
            spots = [(row.load, b, r) for b, batch in enumerate(batches) for r, row in enumerate(batch.rows)]
            fitting = [spot for spot in spots if self._fits(batches[spot[1]].rows[spot[2]], sample)]
            if not fitting:
                left.append(sample)
                continue
            _, b, r = min(fitting)  # the least-loaded row, the earliest micro-batch and lowest rank on ties
            batches[b].rows[r].add(sample)
            self.tail_planned_count += 1
        for r, sample in enumerate(left):  # fewer than the ranks: one per row, pending
            self._rows[r].add(sample)
        return None

    def _row_of(self, samples: Iterable[Any]) -> Any:
        row = self._fresh_row()
        for sample in samples:
            row.add(sample)
        return row

    def _emit(self) -> Any:
        batch = self._batch(self._rows, self._dropped_since_emit)
        self._rows = self._new_rows()
        self._dropped_since_emit = 0
        return batch


class TokenBudgetBatcher(BudgetBatcher):
    """Rows bounded by `token_budget`, samples placed one at a time (docs/algorithms.md §4.5, placement rule §4.8).

    `placement="1.16"`: the home rows (rows already holding the sample's group) that fit, least loaded first;
    else, if the sample has a home row and every row holds a sample, close the micro-batch (the sample then keeps
    its prefix in a fresh row); else the least-loaded row that fits; if none fits, close.

    `placement="seed"` (default) replaces that "home full → close" branch by a guarded move: the
    least-loaded fitting row is accepted if `row.load + row.delta_load(sample) <= max(row loads)` (moving the
    sample away from its home does not raise the micro-batch's wall time), else close. A sample whose group is
    in no row is placed as in 1.16. Ties always go to the lowest rank.
    """

    def __init__(
        self, num_ranks: int, token_budget: int, placement: Placement = "seed", share_prefixes: bool = True
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"TokenBudgetBatcher: placement must be one of {PLACEMENTS}, got {placement!r}")
        self.placement = placement
        self.share_prefixes = share_prefixes
        super().__init__(num_ranks, token_budget)

    def _new_rows(self) -> list[TreeRow]:
        return _empty_rows(self.num_ranks, self.share_prefixes)

    def _batch(self, rows: list[Any], dropped: int) -> MicroBatch:
        return MicroBatch(rows, self.token_budget, dropped)

    def _fresh_row(self) -> TreeRow:
        return TreeRow(self.share_prefixes)

    def _fits(self, row: TreeRow, sample: PackableSample) -> bool:
        return row.fits(sample, self.token_budget)

    def flush(self) -> MicroBatch | None:
        """Emit the open rows at the end of a finite stream.

        Empty rows are first filled by moving samples out of rows holding several (rows only shrink, so the
        budget still holds). With fewer samples than ranks nothing is emitted: returns None, samples stay pending.
        """
        num_samples = sum(row.num_samples for row in self._rows)
        if num_samples < self.num_ranks:
            return None
        _fill_empty_rows(self._rows)
        return self._emit()

    def _place(self, sample: PackableSample) -> int | None:
        rows = self._rows
        fitting = [r for r, row in enumerate(rows) if row.fits(sample, self.token_budget)]
        home = [r for r, row in enumerate(rows) if sample.group_id in row.groups]
        home_fitting = [r for r in home if r in fitting]
        if home_fitting:
            return _least_loaded(rows, home_fitting)
        best = _least_loaded(rows, fitting)
        if not home or any(row.num_samples == 0 for row in rows):
            return best
        if self.placement == "1.16" or best is None:
            return None
        max_load = max(row.load for row in rows)
        return best if rows[best].load + rows[best].delta_load(sample) <= max_load else None


class FixedCountBatcher:
    """Micro-batches of exactly `microbatch_size` samples (B × P), balanced by attention cost (docs/algorithms.md §4.5).

    Buffered samples are bucketed by group (first-seen order); while there are fewer groups than ranks the largest
    group is split in two (first ⌊n/2⌋, rest); each group is priced by the load of a TreeRow holding it alone, and
    groups go, heaviest first (LPT), whole into the currently least-loaded row. No budget: peak memory is unbounded.
    """

    def __init__(self, num_ranks: int, microbatch_size: int, share_prefixes: bool = True) -> None:
        if num_ranks < 1:
            raise ValueError(f"FixedCountBatcher: num_ranks must be >= 1, got {num_ranks}")
        if microbatch_size < num_ranks:
            raise ValueError(
                f"FixedCountBatcher: microbatch_size ({microbatch_size}) must be >= num_ranks ({num_ranks}) "
                "so that every rank gets a sample"
            )
        self.num_ranks = num_ranks
        self.microbatch_size = microbatch_size
        self.share_prefixes = share_prefixes
        self.tail_planned_count = 0  # the last `plan`'s short-tail samples merged into its last micro-batch
        self._buffer: list[PackableSample] = []

    @property
    def pending(self) -> list[PackableSample]:
        """Buffered samples not yet emitted."""
        return list(self._buffer)

    def take_pending(self) -> list[PackableSample]:
        samples, self._buffer = self._buffer, []
        return samples

    def push(self, sample: PackableSample) -> list[MicroBatch]:
        """Buffer `sample`; return the micro-batch it completed (empty list or one micro-batch)."""
        _check_not_empty(sample)
        self._buffer.append(sample)
        if len(self._buffer) < self.microbatch_size:
            return []
        return [self._make_batch(self.take_pending())]

    def flush(self) -> MicroBatch | None:
        """Emit a short micro-batch of the buffered samples; None (samples stay pending) if fewer than ranks."""
        if len(self._buffer) < self.num_ranks:
            return None
        return self._make_batch(self.take_pending())

    def _make_batch(self, samples: list[Any]) -> Any:
        """The micro-batch of `samples` split over the ranks (subclasses change how)."""
        return MicroBatch(balance_groups(samples, self.num_ranks, self.share_prefixes))

    def plan(self, samples: Iterable[PackableSample]) -> list[MicroBatch]:
        """Plan a finite list: every push, then a flush; a tail of fewer samples than ranks joins the last
        micro-batch (rebalanced: no budget to exceed). Without a micro-batch to join it stays `pending`."""
        batches = [batch for sample in samples for batch in self.push(sample)]
        last = self.flush()
        self.tail_planned_count = 0
        if last is None and self._buffer and batches:
            tail = self.take_pending()
            self.tail_planned_count = len(tail)
            batches[-1] = self._make_batch([*batches[-1].samples, *tail])
        return batches if last is None else [*batches, last]


def balance_groups(samples: Sequence[PackableSample], num_ranks: int, share_prefixes: bool = True) -> list[TreeRow]:
    """Partition `samples` (at least `num_ranks`) into `num_ranks` non-empty rows, whole groups, LPT by load."""
    if len(samples) < num_ranks:
        raise ValueError(f"balance_groups: {len(samples)} samples cannot fill {num_ranks} rows")
    groups = _split_until(_bucket_by_group(samples), num_ranks)
    prices = [_row_of(group, share_prefixes).load for group in groups]
    order = sorted(range(len(groups)), key=lambda g: -prices[g])  # stable: ties keep first-seen order
    rows = _empty_rows(num_ranks, share_prefixes)
    for g in order:
        row = min(rows, key=lambda row: row.load)  # min() keeps the lowest rank on ties
        for sample in groups[g]:
            row.add(sample)
    return rows


def _bucket_by_group(samples: Sequence[PackableSample]) -> list[list[PackableSample]]:
    buckets: dict[int, list[PackableSample]] = {}
    for sample in samples:
        buckets.setdefault(sample.group_id, []).append(sample)
    return list(buckets.values())


def _split_until(groups: list[list[PackableSample]], num_groups: int) -> list[list[PackableSample]]:
    """Split the largest group (first on ties) into [first ⌊n/2⌋, rest] until there are `num_groups` groups."""
    groups = list(groups)
    while len(groups) < num_groups:
        largest = max(range(len(groups)), key=lambda g: len(groups[g]))
        group = groups[largest]
        half = len(group) // 2
        groups[largest : largest + 1] = [group[:half], group[half:]]
    return groups


def _row_of(samples: Iterable[PackableSample], share_prefixes: bool = True) -> TreeRow:
    row = TreeRow(share_prefixes)
    for sample in samples:
        row.add(sample)
    return row


def _fill_empty_rows(rows: list[TreeRow]) -> None:
    """Move last-added samples from the heaviest multi-sample rows into empty rows, rebuilding the donors."""
    for empty in [r for r, row in enumerate(rows) if row.num_samples == 0]:
        donors = [r for r, row in enumerate(rows) if row.num_samples >= 2]
        donor = max(donors, key=lambda r: rows[r].load)  # max() keeps the lowest rank on ties
        *kept, moved = rows[donor].samples
        rows[donor] = _row_of(kept, rows[donor].share_prefixes)
        rows[empty] = _row_of([moved], rows[donor].share_prefixes)


def _least_loaded(rows: Sequence[TreeRow], candidates: Iterable[int]) -> int | None:
    """The candidate with the smallest load, lowest rank on ties; None without candidates."""
    return min(candidates, key=lambda r: (rows[r].load, r), default=None)


def _empty_rows(num_ranks: int, share_prefixes: bool = True) -> list[TreeRow]:
    return [TreeRow(share_prefixes) for _ in range(num_ranks)]


def _check_not_empty(sample: PackableSample) -> None:
    if len(sample) == 0:
        raise ValueError(f"cannot plan an empty sample (group {sample.group_id}): input_ids has no token")
