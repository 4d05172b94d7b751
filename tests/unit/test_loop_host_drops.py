"""`actors.loop_host.QueuePromptSource`: a group finished after its work, dropped or kept (its samples packed), rides
on the next lease's call to the queue actor (one call instead of two), goes by itself when no lease carries it in
time, and at once after the prompt stream ended; a failed send is raised, not lost. A fake queue handle (no Ray)."""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from actors import loop_host
from actors.group_payload import GroupPart
from actors.loop_host import QueueGroupSink, QueuePromptSource
from rlasync.records import PromptLease, RolloutSample


class FakeQueue:
    """Records every call; `next_group` answers the leases of `answers` in turn (then "done")."""

    def __init__(self, answers=(), fail_drops=False, during_lease=None):
        self.calls, self.answers, self.fail_drops = [], list(answers), fail_drops
        self.during_lease = during_lease  # run while a next_group call is in flight

    def __getattr__(self, method):
        async def call(*args):
            self.calls.append((method, args))
            if method == "hand_over" and self.fail_drops:
                raise ConnectionError("the queue actor is gone")
            if method == "next_group":
                if self.during_lease is not None:
                    self.during_lease()
                lease = self.answers.pop(0) if self.answers else None
                return SimpleNamespace(lease=lease, waited_s=0.0, done=lease is None, policy_version=0)
            return None

        return SimpleNamespace(remote=call)

    def named(self, method):
        return [args for name, args in self.calls if name == method]


def source_for(queue):
    actor = SimpleNamespace(
        queue=queue, kind="rollout actor", index=0, dataset=[{"prompt": [{"role": "user", "content": "1+1"}]}] * 8,
        config=SimpleNamespace(strict_dataset=False), loop=SimpleNamespace(update_policy_version=lambda v: None),
    )  # fmt: skip
    return QueuePromptSource(actor, group_size=4)


def dropped(group_id, tokens=12):
    scored = SimpleNamespace(drop_cause="constant", drop_detail=lambda: "all rewards 1.0")
    return SimpleNamespace(group_id=group_id, dropped=True, scored=scored, num_rollout_tokens=tokens)


def test_a_dropped_group_rides_on_the_next_lease_call():
    queue = FakeQueue(answers=[PromptLease(group_id=2, row_index=1)])
    source = source_for(queue)

    async def run():
        await QueueGroupSink(queue, source).put(dropped(1))
        lease = await source.lease()
        await asyncio.sleep(loop_host.DROP_FLUSH_S * 2)  # the fallback finds nothing left to send
        return lease

    assert asyncio.run(run()).group_id == 2
    [(size, _, owner, drops, kept)] = queue.named("next_group")
    assert drops == [(1, "zero_std", 12, "constant", "all rewards 1.0")] and size == 4 and owner == source.owner
    assert kept == []
    assert not queue.named("drop_group") and not queue.named("hand_over")  # one call for the lease and the drop


def test_a_drop_no_lease_carries_goes_by_itself_in_one_call_for_all():
    queue = FakeQueue()
    source = source_for(queue)

    async def run():
        sink = QueueGroupSink(queue, source)
        await sink.put(dropped(1))
        await sink.put(dropped(3, tokens=20))
        assert queue.calls == []  # held for a lease, briefly
        await asyncio.sleep(loop_host.DROP_FLUSH_S * 3)

    asyncio.run(run())
    assert [len(drops) for drops, kept in queue.named("hand_over")] == [2]
    assert [drop[0] for drop in queue.named("hand_over")[0][0]] == [1, 3] and queue.named("hand_over")[0][1] == []


def test_after_the_stream_ended_a_drop_goes_at_once_and_what_was_held_is_sent_first():
    queue = FakeQueue(answers=[])  # the first lease call hears "done"
    source = source_for(queue)
    queue.during_lease = lambda: source.drops.append((7, "zero_std", 5, None, None))  # dropped meanwhile

    async def run():
        sink = QueueGroupSink(queue, source)
        await sink.put(dropped(1))
        assert await source.lease() is None
        await sink.put(dropped(9))

    asyncio.run(run())
    assert queue.named("next_group")[0][3] == [(1, "zero_std", 12, "constant", "all rewards 1.0")]
    assert queue.named("hand_over") == [([(7, "zero_std", 5, None, None)], [])]  # flushed on hearing "done"
    assert queue.named("drop_group") == [(9, "zero_std", 12, "constant", "all rewards 1.0")]
    assert source.drops == []


def test_a_failed_send_of_held_drops_is_raised_at_the_next_drop_or_lease():
    queue = FakeQueue(fail_drops=True)
    source = source_for(queue)

    async def run():
        await QueueGroupSink(queue, source).put(dropped(1))
        await asyncio.sleep(loop_host.DROP_FLUSH_S * 3)
        with pytest.raises(RuntimeError, match="handing groups to the queue failed.*the queue actor is gone"):
            await source.lease()

    asyncio.run(run())


def kept(group_id, n=3):
    samples = [
        RolloutSample(
            input_ids=np.arange(5 + i, dtype=np.int64),
            completion_mask=np.arange(5 + i) >= 3,
            sampler_logprobs=np.full(5 + i, -0.5, dtype=np.float32),
            advantage=float(i),
            group_id=group_id,
            policy_version=1,
            rollout_id=f"g{group_id}r{i}",
        )
        for i in range(n)
    ]
    return SimpleNamespace(group_id=group_id, dropped=False, scored=SimpleNamespace(samples=samples))


def test_a_kept_group_rides_on_the_next_lease_call_packed():
    queue = FakeQueue(answers=[PromptLease(group_id=6, row_index=1)])
    source = source_for(queue)

    async def run():
        sink = QueueGroupSink(queue, source)
        await sink.put(kept(4))
        await sink.put(dropped(5))
        assert queue.calls == []  # held for the lease
        lease = await source.lease()
        await asyncio.sleep(loop_host.DROP_FLUSH_S * 2)  # the fallback finds nothing left to send
        return lease

    assert asyncio.run(run()).group_id == 6
    [(_, _, _, drops, [(entries, packed)])] = queue.named("next_group")
    assert [d[0] for d in drops] == [5] and queue.calls[1:] == []  # one call for the lease and both groups
    assert [e.payload for e in entries] == [GroupPart(None, i) for i in range(3)]
    assert [e.group_id for e in entries] == [4] * 3 and [e.num_tokens for e in entries] == [5, 6, 7]
    assert [s.rollout_id for s in pickle.loads(packed)] == ["g4r0", "g4r1", "g4r2"]


def test_kept_groups_no_lease_carries_go_together_and_after_the_end_at_once():
    queue = FakeQueue(answers=[])
    source = source_for(queue)

    async def run():
        sink = QueueGroupSink(queue, source)
        await sink.put(kept(1))
        await sink.put(kept(2, n=2))
        await asyncio.sleep(loop_host.DROP_FLUSH_S * 3)
        assert [len(k) for _, k in queue.named("hand_over")] == [2]  # one call for both
        assert await source.lease() is None  # the stream ended
        await sink.put(kept(3))  # goes at once

    asyncio.run(run())
    [(drops, groups)] = queue.named("hand_over")
    assert drops == [] and [[e.group_id for e in entries][0] for entries, _ in groups] == [1, 2]
    [(entries, packed)] = queue.named("put_group")
    assert entries[0].group_id == 3 and len(pickle.loads(packed)) == 3 and source.kept == []
