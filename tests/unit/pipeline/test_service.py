"""QueueService: the dispatcher, queue and allowance kept in step; stale groups regenerated; resume; a full
asyncio run with fake rollout workers and a fake learner."""

import asyncio
import logging
import random
from collections import Counter

import pytest

from rlasync.metrics import MetricSink
from rlasync.pipeline import (
    QueueEntry,
    QueueService,
    RolloutState,
    read_rollout_state,
    write_rollout_state,
)
from rlasync.pipeline.settings import QueueSettings


class FakeClock:
    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


def group_entries(lease, version, sizes=(10, 10)):
    return [
        QueueEntry(payload=(lease.group_id, i), group_id=lease.group_id, policy_version=version, num_tokens=n)
        for i, n in enumerate(sizes)
    ]


def make_service(num_rows=4, num_epochs=1, max_staleness=0, tokens_per_step=1000, resume=None, clock=None, **kwargs):
    settings = QueueSettings(num_rows, num_epochs, max_staleness, tokens_per_step=tokens_per_step, **kwargs)
    return QueueService.create(settings, resume=resume, **({"clock": clock} if clock else {}))


def test_a_group_gone_stale_is_dropped_counted_and_leased_again():
    service = make_service(max_staleness=0)
    lease = service.try_next_group(num_rollouts=2)
    service.put_group(group_entries(lease, version=0))
    service.set_policy_version(1)
    result = service.take(token_target=100)
    assert result.entries == () and len(result.dropped_stale) == 2
    assert result.metrics["sample/dropped_stale_count"] == 2.0
    state = service.state()
    assert (state.regenerated_groups, state.consumed_groups, state.queue_size, state.queue_tokens) == (1, 0, 0, 0)
    again = service.try_next_group(num_rollouts=2)
    assert again.position == lease.position and again.group_id != lease.group_id
    service.put_group(group_entries(again, version=1))
    assert len(service.take(token_target=100).entries) == 2
    assert service.state().consumed_groups == 1 and service.rollout_state().prompt_index == 1


def test_take_marks_groups_trained_and_frees_the_allowance():
    service = make_service(num_rows=3, max_staleness=1, tokens_per_step=15)  # allowance 15 tokens
    lease = service.try_next_group(2)
    assert service.try_next_group(2) is None  # cold start: one group at a time
    service.put_group(group_entries(lease, version=0))  # 20 tokens queued
    assert service.try_next_group(2) is None  # 20 >= 15
    result = service.take(token_target=5)
    assert len(result.entries) == 1 and service.state().queue_tokens == 10
    assert service.dispatcher.first_untrained_index() == 0  # one sample still pending
    service.take(token_target=5)
    assert service.dispatcher.first_untrained_index() == 1
    assert service.try_next_group(2) is not None


def test_drop_and_release_keep_the_three_parts_consistent():
    service = make_service(num_rows=2, max_staleness=4)
    first = service.try_next_group(3)
    service.drop_group(first.group_id, "zero_std", num_tokens=90)
    assert service.allowance.mean_tokens_per_rollout == 30 and service.state().consumed_groups == 1
    second = service.try_next_group(3)
    service.release(second)
    assert service.state().inflight_groups == 0
    third = service.try_next_group(3)
    assert third.position == second.position
    with pytest.raises(ValueError, match="not generating"):
        service.put_group(group_entries(second, version=0))
    with pytest.raises(ValueError, match="not generating"):
        service.drop_group(first.group_id, "zero_std")
    service.drop_group(third.group_id, "filtered")
    assert service.done and service.state().done


def test_policy_version_never_goes_back():
    service = make_service()
    service.set_policy_version(3)
    with pytest.raises(ValueError, match="older"):
        service.set_policy_version(2)


def test_next_group_measures_time_held_by_the_allowance():
    clock = FakeClock(0.0)

    async def scenario():
        service = make_service(max_staleness=1, tokens_per_step=10, clock=clock)
        first = await service.next_group(2)
        waiter = asyncio.create_task(service.next_group(2))
        await asyncio.sleep(0)
        clock.now = 4.0
        service.put_group(group_entries(first.lease, version=0))  # 20 queued >= 10: still held
        await asyncio.sleep(0)
        assert not waiter.done()
        clock.now = 6.0
        service.take(token_target=100)
        return first, await asyncio.wait_for(waiter, 1.0)

    first, second = asyncio.run(scenario())
    assert first.waited_s == 0.0 and first.lease.position == 0
    assert second.lease.position == 1 and second.waited_s == 6.0 and not second.done


def test_next_group_reports_done_and_times_out_when_only_outstanding_leases_remain():
    async def scenario():
        service = make_service(num_rows=1, max_staleness=1)
        first = await service.next_group(1)
        timed_out = await service.next_group(1, timeout_s=0.01)  # the only prompt is out
        service.put_group(group_entries(first.lease, version=0))
        service.take(100)
        return timed_out, await service.next_group(1, timeout_s=0.01)

    timed_out, finished = asyncio.run(scenario())
    assert timed_out.lease is None and not timed_out.done
    assert finished.lease is None and finished.done


def test_wait_take_returns_on_put_and_times_out_cleanly():
    async def scenario():
        service = make_service(max_staleness=1)
        empty = await service.wait_take(100, timeout_s=0.01)
        lease = service.try_next_group(2)
        waiter = asyncio.create_task(service.wait_take(100, timeout_s=5.0))
        await asyncio.sleep(0)
        service.put_group(group_entries(lease, version=0))
        return empty, await asyncio.wait_for(waiter, 1.0)

    empty, result = asyncio.run(scenario())
    assert empty.entries == () and len(result.entries) == 2


def test_rollout_state_round_trips_through_the_file(tmp_path):
    service = make_service(num_rows=10, max_staleness=1, tokens_per_step=10**6)
    leases = []
    for _ in range(3):
        lease = service.try_next_group(1)
        service.put_group(group_entries(lease, version=0, sizes=(1,)))
        leases.append(lease)
    service.take(token_target=0)  # trains group 0 only
    service.set_policy_version(7)
    path = write_rollout_state(tmp_path, service.rollout_state())
    assert path.name == "rollout_state.json"
    state = read_rollout_state(tmp_path)
    assert (state.prompt_index, state.model_version) == (1, 7)
    assert state.allowance == service.allowance.learned_state()  # the allowance's learned state too
    resumed = make_service(num_rows=10, resume=state)
    assert resumed.policy_version == 7 and resumed.try_next_group(1).position == 1


def test_old_rollout_state_files_without_model_version_resume_at_zero(tmp_path, caplog):
    (tmp_path / "rollout_state.json").write_text('{"prompt_index": 12}')
    assert read_rollout_state(tmp_path) == RolloutState(prompt_index=12, model_version=0)
    with caplog.at_level(logging.WARNING):
        assert read_rollout_state(tmp_path / "missing") is None
    assert "resuming the prompt stream from prompt 0" in caplog.text
    with pytest.raises(ValueError, match="prompt_index"):
        RolloutState.from_dict({"model_version": 3})
    with pytest.raises(ValueError, match="non-negative"):
        RolloutState(prompt_index=-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_full_asynchronous_run_consumes_every_prompt_exactly_once(seed):
    """Three fake rollout workers and a fake learner whose version moves three per step, with max_staleness=2: the
    gate admits two steps of tokens, so groups left over from a step go stale and are regenerated; every prompt is
    consumed exactly once."""
    rng = random.Random(seed)
    num_rows, num_epochs, group_size = 7, 2, 3
    service = make_service(num_rows=num_rows, num_epochs=num_epochs, max_staleness=2, tokens_per_step=60)
    positions = {}  # group_id -> position
    dropped = []
    trained_groups = set()
    sink = MetricSink()

    async def rollout_worker():
        while True:
            admission = await service.next_group(group_size, timeout_s=1.0)
            if admission.done:
                return
            if admission.lease is None:
                continue
            lease = admission.lease
            positions[lease.group_id] = lease.position
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
            roll = rng.random()
            if roll < 0.1:
                service.release(lease)
            elif roll < 0.2:
                service.drop_group(lease.group_id, "zero_std", num_tokens=30)
                dropped.append(lease.position)
            else:
                sizes = [rng.randint(5, 15) for _ in range(group_size)]
                service.put_group(group_entries(lease, admission.policy_version, sizes))

    async def learner():
        version = 0
        while not service.done:
            result = await service.wait_take(token_target=40, timeout_s=1.0)
            sink.update(result.metrics)
            trained_groups.update(entry.group_id for entry in result.entries)
            if result.entries:
                service.finish_step(result.num_tokens)
                version += 3
                service.set_policy_version(version)
            await asyncio.sleep(0)

    async def run():
        await asyncio.wait_for(asyncio.gather(learner(), *(rollout_worker() for _ in range(3))), 5.0)

    asyncio.run(run())
    consumed = Counter([positions[group_id] for group_id in trained_groups] + dropped)
    assert consumed == Counter(range(num_rows * num_epochs)), "every prompt consumed exactly once"
    state = service.state()
    assert state.done and state.first_untrained_index == num_rows * num_epochs
    assert state.regenerated_groups > 0 and sink.reduce()["sample/dropped_stale_count"] > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_max_staleness_0_is_synchronous_nothing_generated_while_training_and_nothing_stale(seed):
    """S = 0: each version generates one step of samples; while the learner trains (between its last take and the
    weight sync) no group starts, and no sample goes stale; every prompt is still consumed exactly once, also when
    a step's samples run longer than the last step's (the learner waits for more: one group at a time)."""
    rng = random.Random(seed)
    num_rows, group_size, target = 40, 4, 100
    service = make_service(num_rows=num_rows, num_epochs=1, max_staleness=0, tokens_per_step=target)
    training = {"now": False, "admitted_while_training": 0, "stale": 0, "steps": 0}
    positions, trained_groups, dropped = {}, set(), []

    async def rollout_worker():
        while True:
            admission = await service.next_group(group_size, timeout_s=0.5)
            if admission.done:
                return
            if admission.lease is None:
                continue
            training["admitted_while_training"] += training["now"]
            lease = admission.lease
            positions[lease.group_id] = lease.position
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
            if rng.random() < 0.2:
                service.drop_group(lease.group_id, "zero_std", num_tokens=20)
                dropped.append(lease.position)
            else:  # later steps' samples run longer than the first ones'
                low = 5 + 2 * training["steps"]
                sizes = [rng.randint(low, low + 10) for _ in range(group_size)]
                service.put_group(group_entries(lease, admission.policy_version, sizes))

    async def learner():
        version = 0
        while not service.done:
            tokens = 0
            while tokens < target and not service.done:
                result = await service.wait_take(token_target=target - tokens, timeout_s=0.5)
                training["stale"] += len(result.dropped_stale)
                trained_groups.update(entry.group_id for entry in result.entries)
                tokens += result.num_tokens
            if tokens == 0:
                continue
            training["now"] = True
            for _ in range(5):  # "training": the rollout workers get every chance to start a group
                await asyncio.sleep(0)
            service.finish_step(tokens)
            version += 1
            training["steps"] += 1
            training["now"] = False
            service.set_policy_version(version)

    async def run():
        await asyncio.wait_for(asyncio.gather(learner(), *(rollout_worker() for _ in range(3))), 10.0)

    asyncio.run(run())
    assert training["steps"] >= 3
    assert training["admitted_while_training"] == 0
    assert training["stale"] == 0 and service.state().regenerated_groups == 0
    consumed = Counter([positions[group_id] for group_id in trained_groups] + dropped)
    assert consumed == Counter(range(num_rows)), "every prompt consumed exactly once"


def test_max_staleness_0_serves_weight_sync_steps_steps_per_version():
    service = make_service(num_rows=20, max_staleness=0, tokens_per_step=20, steps_per_version=2)
    assert service.allowance.allowance_tokens == 40
    leases = []
    while (lease := service.try_next_group(num_rollouts=2)) is not None:
        leases.append(lease)
        service.put_group(group_entries(lease, version=0))  # 20 tokens a group
    assert len(leases) == 2  # two steps of 20 tokens for this version, then the gate holds
    assert service.take(token_target=15).num_tokens == 20  # the first step: its target (one whole sample over)
    assert service.take(token_target=5).num_tokens == 20  # the version's last step: everything that is left
    assert service.try_next_group(num_rollouts=2) is None  # both steps taken: wait for the sync
    service.set_policy_version(1)
    assert service.try_next_group(num_rollouts=2) is not None
