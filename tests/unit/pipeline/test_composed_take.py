"""QueueService with a StepPlan: takes compose the step as the learner plans it (docs/algorithms.md §4.5.1); the
sample that opens the next step stays queued; every prompt is still consumed exactly once; max_staleness=0 keeps
its synchronous steps."""

import asyncio
import random
from collections import Counter

import numpy as np
import pytest

from rlasync.packing import TokenBudgetBatcher
from rlasync.packing.step_plan import StepPlan
from rlasync.pipeline import QueueEntry, QueueService
from rlasync.pipeline.settings import QueueSettings


class Planned:
    """What the learner's planner reads of a sample."""

    def __init__(self, ids, group_id, prompt_len):
        self.input_ids = np.asarray(ids, dtype=np.int64)
        self.group_id = group_id
        self.num_trained_tokens = len(ids) - prompt_len

    def __len__(self):
        return len(self.input_ids)


def group_entries(lease, version, rng, group_size=4):
    prompt = [lease.group_id * 1000 + i for i in range(rng.randint(10, 30))]
    entries = []
    for _ in range(group_size):
        ids = prompt + [rng.randint(0, 999) for _ in range(rng.randint(1, 40))]
        sample = Planned(ids, lease.group_id, len(prompt))
        entries.append(
            QueueEntry(
                payload=sample,
                group_id=lease.group_id,
                policy_version=version,
                num_tokens=len(ids),
                num_trained_tokens=sample.num_trained_tokens,
                input_ids=sample.input_ids,
            )
        )
    return entries


def make_service(max_staleness=1, plan=None, num_rows=40, num_epochs=1):
    plan = plan or StepPlan(num_ranks=1, token_budget=256, micro_batches=2)
    settings = QueueSettings(num_rows, num_epochs, max_staleness, tokens_per_step=100, step_plan=plan)
    return QueueService.create(settings)


def fill(service, rng, groups):
    for _ in range(groups):
        lease = service.try_next_group(4)
        assert lease is not None
        service.put_group(group_entries(lease, service.policy_version, rng))


def test_a_take_composes_the_step_whatever_the_token_target_and_finish_step_starts_the_next():
    rng = random.Random(0)
    service = make_service()
    service.allowance.set_tokens_per_step(10**6)  # admit everything
    fill(service, rng, 12)
    queued = len(service.queue)
    first = service.take(token_target=1)
    assert first.step_full and len(first.entries) > 4  # far more than one token's worth
    assert len(TokenBudgetBatcher(1, 256).plan([e.payload for e in first.entries])) == 2
    assert len(service.queue) == queued - len(first.entries)  # the sample opening the next step stays queued
    again = service.take(token_target=10**6)
    assert again.step_full and again.entries == ()  # nothing more until the step is finished
    service.finish_step(first.num_tokens)
    second = service.take(token_target=1)
    assert second.step_full and second.entries[0].group_id >= first.entries[-1].group_id


def test_wait_take_returns_a_full_step_at_once_and_waits_for_a_step_still_filling():
    async def scenario():
        rng = random.Random(1)
        service = make_service()
        service.allowance.set_tokens_per_step(10**6)
        fill(service, rng, 1)  # 4 short samples: one step is not full yet
        partial = await service.wait_take(token_target=1, timeout_s=0.05)
        assert partial.entries and not partial.step_full
        nothing = await service.wait_take(token_target=1, timeout_s=0.05)  # times out: no sample, not full
        assert nothing.entries == () and not nothing.step_full
        fill(service, rng, 10)
        rest = await service.wait_take(token_target=1, timeout_s=1.0)
        assert rest.step_full
        steps = [e.payload for e in partial.entries + rest.entries]
        assert len(TokenBudgetBatcher(1, 256).plan(steps)) == 2

    asyncio.run(scenario())


def test_max_staleness_0_keeps_its_synchronous_steps_without_composing():
    service = make_service(max_staleness=0)
    assert service.composer is None


@pytest.mark.parametrize("seed", [0, 1])
def test_composed_steps_consume_every_prompt_exactly_once(seed):
    """Fake rollout workers (some groups dropped or released) and a learner that takes composed steps, its
    version moving two per step with max_staleness=1: every prompt is consumed exactly once, every full step plans
    into exactly two micro-batches of two rows."""
    rng = random.Random(seed)
    num_rows, num_epochs = 30, 2
    service = make_service(
        plan=StepPlan(num_ranks=2, token_budget=200, micro_batches=2), num_rows=num_rows, num_epochs=num_epochs
    )
    positions, dropped, trained, micro_batches = {}, [], set(), []

    async def rollout_worker():
        while True:
            admission = await service.next_group(4, timeout_s=1.0)
            if admission.done:
                return
            if admission.lease is None:
                continue
            lease = admission.lease
            positions[lease.group_id] = lease.position
            await asyncio.sleep(0)
            roll = rng.random()
            if roll < 0.1:
                service.release(lease)
            elif roll < 0.2:
                service.drop_group(lease.group_id, "zero_std", num_tokens=30)
                dropped.append(lease.position)
            else:
                service.put_group(group_entries(lease, admission.policy_version, rng))

    async def learner():
        version, step = 0, []
        while not service.done or len(service.queue):
            result = await service.wait_take(token_target=1, timeout_s=0.2)
            step += [entry.payload for entry in result.entries]
            trained.update(entry.group_id for entry in result.entries)
            if result.step_full:
                micro_batches.append(len(TokenBudgetBatcher(2, 200).plan(step)))
                service.finish_step(sum(len(s) for s in step))
                step = []
                version += 2
                service.set_policy_version(version)
            await asyncio.sleep(0)

    async def run():
        await asyncio.wait_for(asyncio.gather(learner(), *(rollout_worker() for _ in range(3))), 20.0)

    asyncio.run(run())
    consumed = Counter([positions[group_id] for group_id in trained] + dropped)
    assert consumed == Counter(range(num_rows * num_epochs)), "every prompt consumed exactly once"
    assert micro_batches and set(micro_batches) == {2}
    assert service.state().first_untrained_index == num_rows * num_epochs
