"""Lease owners: the leases a rollout actor held when it died are released (its prompts leased again), its queued
groups are not; every position is still consumed exactly once."""

import asyncio

import pytest

from rlasync.pipeline import PromptDispatcher, QueueService
from rlasync.pipeline.settings import QueueSettings


def test_leases_of_an_owner_are_the_live_unqueued_ones():
    d = PromptDispatcher(num_rows=6, num_epochs=1.0)
    a = [d.lease() for _ in range(3)]
    b = d.lease()
    for lease in a:
        d.assign_owner(lease.group_id, "rollout actor 0")
    d.assign_owner(b.group_id, "rollout actor 1")
    d.mark_queued(a[0].group_id, 4)  # its samples reached the queue: not the dead actor's business any more
    assert [lease.group_id for lease in d.leases_of("rollout actor 0")] == [a[1].group_id, a[2].group_id]
    assert d.leases_of("rollout actor 9") == []
    with pytest.raises(ValueError, match="already has samples in the queue"):
        d.assign_owner(a[0].group_id, "x")


def test_releasing_a_dead_owner_leases_its_prompts_again_and_the_epoch_is_exactly_once():
    service = QueueService.create(QueueSettings(5, 1.0, max_staleness=100, tokens_per_step=10**6))

    async def lease(owner):
        answer = await service.next_group(2, 0.0)
        service.dispatcher.assign_owner(answer.lease.group_id, owner)
        return answer.lease

    first = asyncio.run(lease("rollout actor 1"))
    service.drop_group(first.group_id, "zero_std", num_tokens=8)  # one completed group opens the allowance
    dead = [asyncio.run(lease("rollout actor 0")) for _ in range(3)]
    alive = asyncio.run(lease("rollout actor 1"))
    for lease_ in service.dispatcher.leases_of("rollout actor 0"):  # what QueueActor.release_owner does
        service.release(lease_)
    assert service.state().inflight_groups == 1 and service.dispatcher.num_leased == 1
    service.drop_group(alive.group_id, "zero_std")
    positions = []
    while not service.done:
        again = asyncio.run(lease("rollout actor 0 (restarted)"))
        positions.append(again.position)
        service.drop_group(again.group_id, "zero_std")
    assert sorted(positions) == sorted([lease_.position for lease_ in dead])
    assert service.dispatcher.outcome_counts["zero_std"] == 5 and service.dispatcher.consumed_groups == 5


def test_death_messages_name_the_actor_and_the_checkpoint(tmp_path):
    import json

    from actors.cluster_faults import dead_actor_name, died_error, restart_options

    assert restart_options("rollout")["max_restarts"] > 0 and restart_options("learner") == {}
    assert "no complete checkpoint" in str(died_error("learner rank 0", RuntimeError("x"), tmp_path))
    (tmp_path / "checkpoint-20").mkdir()
    (tmp_path / "checkpoint-20" / "trainer_state.json").write_text(json.dumps({"global_step": 20}))
    (tmp_path / "checkpoint-30").mkdir()  # incomplete
    message = str(died_error("learner rank 0", RuntimeError("The actor died unexpectedly\nmore"), tmp_path))
    assert message.startswith("learner rank 0 died (RuntimeError: The actor died unexpectedly)")
    assert "--resume" in message and str(tmp_path / "checkpoint-20") in message and "checkpoint-30" not in message
    names = {"ab12": "generation actor 0"}
    assert dead_actor_name("ActorDiedError: The actor died ... actor_id=ab12", names) == "generation actor 0"
    assert dead_actor_name("ValueError: ab12", names) is None


def test_a_death_by_node_loss_names_the_node(tmp_path):
    from actors.cluster_faults import died_error, lost_node

    cause = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: LearnerActor\n\tip: 10.0.0.7\n"
        "The actor died because its node has died. Node Id: 26a2935707301563a2b0\n"
    )
    assert lost_node(cause) == "26a2935707301563a2b0 (10.0.0.7)"
    assert lost_node("The actor died unexpectedly before finishing this task.") is None
    message = str(died_error("learner rank 0", cause, tmp_path))
    assert message.startswith("learner rank 0 died (its node 26a2935707301563a2b0 (10.0.0.7) was lost: The actor died")


def test_the_service_records_owners_and_releases_a_dead_owners_live_leases():
    service = QueueService.create(QueueSettings(5, 1.0, max_staleness=100, tokens_per_step=10**6))
    first = asyncio.run(service.next_group(2, 0.0)).lease
    service.drop_group(first.group_id, "zero_std", num_tokens=8)  # one completed group opens the allowance
    mine = [asyncio.run(service.next_group(2, 0.0, "rollout actor 0")).lease for _ in range(2)]
    other = asyncio.run(service.next_group(2, 0.0, "rollout actor 1")).lease
    assert service.release_owner("rollout actor 0") == 2
    assert service.release_owner("rollout actor 0") == 0  # nothing left to give back
    state = service.state()
    assert state.leased_groups == 1 and state.released_by_owner == {"rollout actor 0": 2}
    again = sorted(asyncio.run(service.next_group(2, 0.0)).lease.position for _ in range(2))
    assert again == sorted(lease.position for lease in mine) and other.position not in again


def test_the_sinks_send_samples_by_value_so_the_queue_owns_them():
    """A rollout actor's samples reach the queue inside its calls, not as ObjectRefs (which the rollout actor would
    own: lost with its node, docs/design.md §4 "Nodes"); the queue actor `ray.put`s them and owns them. A GRPO group
    goes pickled into one bytes object (`pack_group`), held for the next lease's call; samples plain pickle cannot
    take go as they are."""
    import pickle
    from types import SimpleNamespace

    import numpy as np

    from actors.group_payload import GroupPart
    from actors.loop_host import QueueGroupSink, QueueSampleSink
    from rlasync.records import RolloutSample

    class Sample:  # a local class: plain pickle cannot take it
        group_id, prompt_id, policy_version, num_trained_tokens, row_index = 3, 3, 1, 4, 0

        def __len__(self):
            return 8

    sent, kept = [], []

    async def put_group(entries):
        sent.append(entries)

    async def keep(entries, packed):
        kept.append((entries, packed))

    queue = SimpleNamespace(put_group=SimpleNamespace(remote=put_group))
    source = SimpleNamespace(taken=lambda group_id: None, keep=keep)
    samples = [
        RolloutSample(
            input_ids=np.arange(4 + i), completion_mask=np.arange(4 + i) >= 2, sampler_logprobs=np.zeros(4 + i),
            advantage=1.0, group_id=3, policy_version=1, rollout_id=f"r{i}",
        )
        for i in range(2)
    ]  # fmt: skip
    odd = [Sample(), Sample()]
    for group in (samples, odd):
        result = SimpleNamespace(group_id=3, dropped=False, scored=SimpleNamespace(samples=group))
        asyncio.run(QueueGroupSink(queue, source).put(result))
    asyncio.run(QueueSampleSink(queue, source).put(odd[0]))
    (entries, packed), (odd_entries, none) = kept
    assert [e.payload for e in entries] == [GroupPart(None, 0), GroupPart(None, 1)]
    assert [s.rollout_id for s in pickle.loads(packed)] == ["r0", "r1"]
    assert none is None and all(e.payload is s for e, s in zip(odd_entries, odd, strict=True))
    assert [[entry.payload for entry in entries] for entries in sent] == [[odd[0]]]


def test_a_dead_incarnations_late_next_group_is_leased_nothing_after_its_restart():
    """The race a lost node showed: a rollout actor asks `next_group` (it waits on the gate), dies, and its restarted
    incarnation registers (releasing what the dead one held: nothing yet); then the gate opens. The waiting call of
    the dead incarnation must get no lease (it would stay in flight forever, holding the gate), the new one must."""

    async def scenario():
        service = QueueService.create(QueueSettings(6, 1.0, max_staleness=1, tokens_per_step=40))
        first = await service.next_group(2, 0.0, "rollout actor 0#old")
        late = asyncio.create_task(service.next_group(2, 5.0, "rollout actor 0#old"))  # waits: cold start
        await asyncio.sleep(0)
        assert service.register_owner("rollout actor 0#new") == 1  # the dead incarnation's first group
        assert service.retired("rollout actor 0#old") and not service.retired("rollout actor 0#new")
        fresh = asyncio.create_task(service.next_group(2, 5.0, "rollout actor 0#new"))
        await asyncio.sleep(0)
        answer = await fresh  # the released group made room: the live incarnation is leased
        assert answer.lease is not None
        service.drop_group(answer.lease.group_id, "zero_std", num_tokens=8)
        assert (await late).lease is None  # the dead incarnation, answered after the gate opened: nothing
        state = service.state()
        assert state.inflight_groups == 0 and service.dispatcher.num_leased == 0
        assert state.released_by_owner == {"rollout actor 0": 1}
        assert first.lease.position in {answer.lease.position}  # the released prompt was leased again

    asyncio.run(scenario())


def test_an_owner_released_on_removal_is_leased_nothing_more_and_other_names_are_untouched():
    service = QueueService.create(QueueSettings(6, 1.0, max_staleness=100, tokens_per_step=10**6))
    service.drop_group(asyncio.run(service.next_group(2, 0.0)).lease.group_id, "zero_std", num_tokens=8)
    asyncio.run(service.next_group(2, 0.0, "rollout actor 1#a"))
    assert service.register_owner("rollout actor 0#a") == 0  # a first start releases nothing
    assert service.release_owner("rollout actor 0#a") == 0
    assert asyncio.run(service.next_group(2, 0.0, "rollout actor 0#a")).lease is None  # removed: nothing more
    assert asyncio.run(service.next_group(2, 0.0, "rollout actor 1#a")).lease is not None
    assert service.register_owner("rollout actor 1#b") == 2  # rollout actor 1 restarted: its two leases back
