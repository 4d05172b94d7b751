"""A kept group's samples as one object in the object store: `own_group` in the queue actor, `fetch` in a learner rank.

The queue actor owns the samples (they outlive the rollout actor that made them), so it `ray.put`s what the rollout
actors send by value. One object per sample cost the queue actor's process ~0.33 ms of CPU a sample, 70% of its
time with every group kept (`bench/queue_actor_load.py`); one object per group costs about a quarter of that. Each
queue entry's payload is then a `GroupPart` (the group's ref and the sample's place in it); a rank fetches every
distinct group its step names once and picks its samples out. A group whose samples the step's plan spreads over
several ranks is fetched whole by each of them (short groups share a row under tree packing; for long ones that is
MBs a step, against the weight sync's GBs).

A rollout actor sends a kept group packed (`pack_group`): its samples pickled into one `bytes` by the rollout actor,
which the queue actor neither unpickles nor pickles again: `ray.put` of a bytes object is a copy, where the samples
by value cost the queue's process their unpickling on arrival and their pickling into the store (with `ray.put`'s
own ~0.5 ms, ~1 ms of a group's ~1.3 ms there; `bench/queue_actor_load.py`). `fetch` unpickles a stored bytes
object; samples that plain pickle cannot take (a user's metric object only cloudpickle handles) go by value.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import ray


class GroupPart(NamedTuple):
    """Sample `index` of the group stored at `ref` (a list of samples)."""

    ref: Any
    index: int


def pack_group(samples: Sequence[Any]) -> tuple[list[Any], bytes | None]:
    """A rollout actor's kept group for `QueueActor.put_group(entries, packed)`: the entries, each payload a
    `GroupPart` without its ref (its place in `packed`), and `packed`, the samples pickled as one list; or the entries
    with the samples by value and None when plain pickle cannot take them."""
    from rlasync.pipeline import QueueEntry

    try:
        packed = pickle.dumps(list(samples), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - e.g. a local class in a sample's fields: Ray's cloudpickle takes them by value
        return [QueueEntry.for_sample(s, payload=s) for s in samples], None
    return [QueueEntry.for_sample(s, payload=GroupPart(None, i)) for i, s in enumerate(samples)], packed


def own_group(entries: Sequence[Any], packed: bytes | None = None) -> list[Any]:
    """`entries` (`QueueEntry`s) with the payloads sent by value put into the object store as one list, each entry's
    payload replaced by its `GroupPart`; payloads already in the store (an ObjectRef or a GroupPart) stay as they are.
    With `packed` (`pack_group`) the bytes are stored as they came and the entries' ref-less parts point into them."""
    owned = list(entries)
    unstored = [
        i for i, entry in enumerate(entries) if isinstance(entry.payload, GroupPart) and entry.payload.ref is None
    ]
    if unstored and packed is None:
        raise ValueError("put_group: entries point into a packed group (pack_group) but its bytes were not sent")
    if packed is not None:
        ref = ray.put(packed)
        for i in unstored:
            owned[i] = replace(entries[i], payload=GroupPart(ref, entries[i].payload.index))
    loose = [i for i, entry in enumerate(owned) if not isinstance(entry.payload, (ray.ObjectRef, GroupPart))]
    if not loose:
        return owned
    ref = ray.put([owned[i].payload for i in loose])
    for place, i in enumerate(loose):
        owned[i] = replace(owned[i], payload=GroupPart(ref, place))
    return owned


def fetch(payloads: Sequence[Any], timeout_s: float | None = None) -> list[Any]:
    """The samples `payloads` (GroupParts or ObjectRefs) name, in order: one `ray.get` of the distinct objects (a
    packed group unpickled once)."""
    refs = list(dict.fromkeys(p.ref if isinstance(p, GroupPart) else p for p in payloads))
    got = ray.get(refs, timeout=timeout_s)
    values = {ref: pickle.loads(value) if isinstance(value, bytes) else value for ref, value in zip(refs, got)}
    return [values[p.ref][p.index] if isinstance(p, GroupPart) else values[p] for p in payloads]


__all__ = ["GroupPart", "fetch", "own_group", "pack_group"]
