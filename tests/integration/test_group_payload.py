"""The queue actor stores a kept group's samples as one object (`actors.group_payload`) and a learner rank's `fetch`
gives back exactly the samples the step names, in the step's order, whatever mix of groups and plain refs."""

import numpy as np
import pytest


def _sample(group_id, i):
    from rlasync.records import RolloutSample

    n = 6 + i
    mask = np.zeros(n, dtype=bool)
    mask[3:] = True
    return RolloutSample(
        input_ids=np.arange(n, dtype=np.int64) + 10 * group_id,
        completion_mask=mask,
        sampler_logprobs=np.full(n, -0.25 * (i + 1), dtype=np.float32),
        advantage=float(i) - 1.0,
        group_id=group_id,
        policy_version=0,
        rollout_id=f"g{group_id}r{i}",
    )


def test_the_queue_owns_a_group_as_one_object_and_fetch_returns_each_sample(ray_cluster):
    import ray

    from actors.group_payload import GroupPart, fetch, own_group, pack_group
    from actors.staleness_queue import QueueActor
    from rlasync.pipeline import QueueEntry
    from rlasync.pipeline.settings import QueueSettings

    # own_group here (the driver owns the objects): loose payloads become parts of one list, refs stay as they are
    loose = [_sample(1, i) for i in range(3)]
    kept_ref = ray.put(_sample(9, 0))
    entries = [QueueEntry.for_sample(s, payload=s) for s in loose]
    entries.insert(1, QueueEntry.for_sample(_sample(9, 0), payload=kept_ref))
    owned = own_group(entries)
    parts = [e.payload for e in owned if isinstance(e.payload, GroupPart)]
    assert len(parts) == 3 and len({p.ref for p in parts}) == 1 and [p.index for p in parts] == [0, 1, 2]
    assert owned[1].payload is kept_ref and own_group(owned) == owned  # already stored: nothing put again
    got = fetch([owned[3].payload, owned[1].payload, owned[0].payload, owned[3].payload])
    assert [s.rollout_id for s in got] == ["g1r2", "g9r0", "g1r0", "g1r2"]
    np.testing.assert_array_equal(got[0].sampler_logprobs, loose[2].sampler_logprobs)

    # a group packed by its rollout actor: the bytes stored as they are, fetch unpickles them once
    entries, packed = pack_group(loose)
    assert isinstance(packed, bytes) and [e.payload for e in entries] == [GroupPart(None, i) for i in range(3)]
    with pytest.raises(ValueError, match="packed"):
        own_group(entries)  # parts without their bytes
    owned = own_group(entries, packed)
    assert [type(ray.get(e.payload.ref)) for e in owned] == [bytes] * 3
    got = fetch([owned[2].payload, owned[0].payload])
    assert [s.rollout_id for s in got] == ["g1r2", "g1r0"]
    np.testing.assert_array_equal(got[0].sampler_logprobs, loose[2].sampler_logprobs)
    # a sample plain pickle cannot take goes by value (Ray's cloudpickle takes it)
    odd = _sample(2, 0)
    odd.metrics["f"] = lambda: 1.0
    by_value, none = pack_group([odd])
    assert none is None and by_value[0].payload is odd

    # through the queue actor: a group put by value and one packed, one take, the payloads fetched as a rank does
    queue = QueueActor.options(num_cpus=0).remote(
        settings=QueueSettings(num_rows=10, num_epochs=None, max_staleness=2, tokens_per_step=10_000)
    )
    try:
        groups = {}
        for packed_here in (False, True):
            lease = ray.get(queue.next_group.remote(3, 5.0, "test#0")).lease
            samples = [_sample(lease.group_id, i) for i in range(3)]
            if packed_here:  # as a rollout actor's held group goes when no lease carries it
                ray.get(queue.hand_over.remote([], [pack_group(samples)]))
            else:
                ray.get(queue.put_group.remote([QueueEntry.for_sample(s, payload=s) for s in samples]))
            groups[lease.group_id] = samples
        taken = ray.get(queue.wait_take.remote(10_000, 5.0))
        payloads = [e.payload for e in taken.entries]
        assert len(payloads) == 6 and all(isinstance(p, GroupPart) for p in payloads)
        assert len({p.ref for p in payloads}) == 2  # one object per group
        fetched = fetch(payloads, timeout_s=30)
        want = {s.rollout_id: s for samples in groups.values() for s in samples}
        for entry, sample in zip(taken.entries, fetched, strict=True):
            assert sample.group_id == entry.group_id
            np.testing.assert_array_equal(sample.input_ids, want[sample.rollout_id].input_ids)
        assert sorted(s.rollout_id for s in fetched) == sorted(want)
    finally:
        ray.kill(queue, no_restart=True)
