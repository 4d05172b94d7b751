"""A kept group's samples as one object in the object store: `own_group` in the queue actor, `fetch` in a learner rank.

The queue actor owns the samples (they outlive the rollout actor that made them), so it `ray.put`s what the rollout
actors send by value. One object per sample cost the queue actor's process ~0.33 ms of CPU a sample, 70% of its
time with every group kept (`bench/queue_actor_load.py`); one object per group costs about a quarter of that. Each
queue entry's payload is then a `GroupPart` (the group's ref and the sample's place in it); a rank fetches every
distinct group its step names once and picks its samples out. A group whose samples the step's plan spreads over
several ranks is fetched whole by each of them (short groups share a row under tree packing; for long ones that is
MBs a step, against the weight sync's GBs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import ray


class GroupPart(NamedTuple):
    """Sample `index` of the group stored at `ref` (a list of samples)."""

    ref: Any
    index: int


def own_group(entries: Sequence[Any]) -> list[Any]:
    """`entries` (`QueueEntry`s) with the payloads sent by value put into the object store as one list, each entry's
    payload replaced by its `GroupPart`; payloads already in the store (an ObjectRef or a GroupPart) stay as they are."""
    loose = [i for i, entry in enumerate(entries) if not isinstance(entry.payload, (ray.ObjectRef, GroupPart))]
    owned = list(entries)
    if not loose:
        return owned
    ref = ray.put([entries[i].payload for i in loose])
    for place, i in enumerate(loose):
        owned[i] = replace(entries[i], payload=GroupPart(ref, place))
    return owned


def fetch(payloads: Sequence[Any], timeout_s: float | None = None) -> list[Any]:
    """The samples `payloads` (GroupParts or ObjectRefs) name, in order: one `ray.get` of the distinct objects."""
    refs = list(dict.fromkeys(p.ref if isinstance(p, GroupPart) else p for p in payloads))
    values = dict(zip(refs, ray.get(refs, timeout=timeout_s)))
    return [values[p.ref][p.index] if isinstance(p, GroupPart) else values[p] for p in payloads]


__all__ = ["GroupPart", "fetch", "own_group"]
