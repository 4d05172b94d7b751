"""Streaming datasets: a `datasets.IterableDataset` (or any re-iterable of dict rows) as `train_dataset`.

A streaming dataset has no length and no random access, so the queue's dispatcher leases from an iterator
(`rlasync.pipeline.dispatcher_stream.StreamingDispatcher`) and every lease carries its row. What changes
against an indexed dataset (docs/algorithms.md §2.2):

- epochs: without `max_steps` a run makes one pass over the stream (its length is unknown up front, so
  `num_train_epochs` cannot be counted in rows); with `max_steps > 0` the stream is iterated again when it ends;
- resume: the run skips the `prompt_index` rows the checkpoint had consumed (iterating over them, not seeking);
- the up-front checks read the first rows only.

A one-shot iterator (a generator) cannot be sent to the actors nor iterated twice: pass a `datasets.IterableDataset`
or an object whose `__iter__` starts a fresh pass.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any


def is_streaming(dataset: Any) -> bool:
    """Whether `dataset` is read by iteration (no `__len__` or no indexing): a `datasets.IterableDataset`, a
    re-iterable object of rows. A list or a `datasets.Dataset` is not."""
    if isinstance(dataset, str | bytes | Mapping):
        return False
    indexed = hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    return not indexed and isinstance(dataset, Iterable)


def check_streaming_dataset(dataset: Any) -> None:
    """`ValueError` for an iterable that cannot feed a run: a one-shot iterator (a generator)."""
    if isinstance(dataset, Iterator):
        raise ValueError(
            f"train_dataset is a one-shot iterator ({type(dataset).__name__}): it cannot be sent to the actors nor "
            "iterated again; pass a datasets.IterableDataset (e.g. `IterableDataset.from_generator(gen)`) or a list"
        )


def first_rows(dataset: Any, count: int) -> list[Any]:
    """The first `count` rows of an indexed or streaming dataset (a streaming one is iterated, not consumed)."""
    if is_streaming(dataset):
        return list(itertools.islice(iter(dataset), count))
    return [dataset[i] for i in range(min(len(dataset), count))]


class RowStream:
    """Rows of a re-iterable dataset, pass after pass: `next_row()` returns `(pass_number, row)`, or None when the
    stream ended and `repeat` is False. A stream that yields no row in a pass raises `ValueError`."""

    def __init__(self, dataset: Iterable[Any], *, repeat: bool) -> None:
        check_streaming_dataset(dataset)
        self.dataset = dataset
        self.repeat = repeat
        self.pass_number = 0
        self.pass_length: int | None = None  # rows of one pass, once the first pass ended
        self._rows_this_pass = 0
        self._iterator: Iterator[Any] = iter(dataset)

    def next_row(self) -> tuple[int, Any] | None:
        while True:
            try:
                row = next(self._iterator)
            except StopIteration:
                if self._rows_this_pass == 0:
                    raise ValueError(
                        "the streaming train_dataset yielded no row: GRPO needs at least one prompt"
                    ) from None
                if self.pass_length is None:
                    self.pass_length = self._rows_this_pass
                if not self.repeat:
                    return None
                self.pass_number += 1
                self._rows_this_pass = 0
                self._iterator = iter(self.dataset)
                continue
            self._rows_this_pass += 1
            return self.pass_number, row


__all__ = ["RowStream", "check_streaming_dataset", "first_rows", "is_streaming"]
