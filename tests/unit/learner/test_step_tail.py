"""A step's short tail (docs/algorithms.md §4.5.2): samples the driver took that leave the last micro-batch with
fewer samples than learner ranks. The queue counted them as trained when they were taken, so every one of them is
either planned into a row of the step (trained by a rank) or counted as unplanned (`batch/unplanned_count`, the
queue's `unplanned_samples`), never left in no row silently.

The steps here are the ones the queue does not compose: `max_staleness=0` (a token target, the version's last step
takes everything queued) and fixed-count steps (`token_budget=0`), split over 2 ranks by the driver's
`StepSplitter`.
"""

import numpy as np
import pytest

from rlasync.algorithms.distill.samples import DistillationSample
from rlasync.algorithms.distill.spec import DISTILL
from rlasync.algorithms.grpo.spec import GRPO
from rlasync.config import AsyncDistillationConfig, AsyncGRPOConfig
from rlasync.learner.objectives import make_objective
from rlasync.learner.sharing import StepSplitter, split_step
from rlasync.pipeline import QueueEntry, QueueService
from rlasync.pipeline.settings import QueueSettings
from rlasync.rollout import RolloutSample

WORLD = 2


def grpo_settings(tmp_path, token_budget=40, **overrides):
    config = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=10, gradient_checkpointing=False, **overrides)
    return GRPO.learner_settings(config, token_budget=token_budget)


def synchronous_service(num_rows=8):
    """S = 0: steps of a token target; nothing composes them."""
    return QueueService.create(QueueSettings(num_rows, 1, max_staleness=0, tokens_per_step=10**6))


def queue_groups(service, groups):
    """One group per list of sample lengths; every sample's ids are its own (nothing shared in a row)."""
    for lengths in groups:
        lease = service.try_next_group(len(lengths))
        assert lease is not None
        entries = []
        for index, length in enumerate(lengths):
            ids = np.arange(length, dtype=np.int64) + 1000 * lease.group_id + 100 * index
            mask = np.r_[np.zeros(1, np.int8), np.ones(length - 1, np.int8)]
            sample = RolloutSample(ids, mask, np.zeros(length, np.float32), 1.0, lease.group_id)
            entries.append(QueueEntry.for_sample(sample, payload=f"g{lease.group_id}s{index}"))
        service.put_group(entries)


def take_and_split(service, settings):
    """The driver's step: one take (S = 0: everything of the version), split over the ranks; returns (the taken
    payloads, the payloads some rank trains, rank 0's share)."""
    taken = service.take(10**6)
    parts = StepSplitter.for_learners(settings, WORLD).split(list(taken.entries))
    trained = [payload for payloads, _ in parts for payload in payloads]
    return [entry.payload for entry in taken.entries], trained, parts[0][1]


def test_a_short_tail_is_moved_into_a_row_so_every_taken_sample_is_trained(tmp_path):
    """Four 10-token samples fill two rows of 20 tokens; a 35-token sample fits in neither, so it opens a second
    micro-batch, alone: one sample for two ranks. It used to stay in no row (trained by no rank, yet counted as
    trained by the queue); now a sample moves out of a two-sample row into the empty one."""
    service = synchronous_service()
    queue_groups(service, [[10, 10], [10, 10], [35]])
    taken, trained, share = take_and_split(service, grpo_settings(tmp_path))
    assert sorted(trained) == sorted(taken) and len(taken) == 5  # every taken sample is in a rank's rows
    items = dict(share.step_items)
    assert items["batch/unplanned_count"] == 0 and items["batch/tail_planned_count"] == 1
    assert len(share.layout) == 2  # two micro-batches, every row of them holds a sample
    service.finish_step(sum(10 for _ in range(4)) + 35, unplanned=int(items["batch/unplanned_count"]))
    state = service.state()
    assert state.outcomes == {"trained": 3} and state.taken_samples == 5 and state.unplanned_samples == 0


def test_a_tail_that_fits_in_an_earlier_row_joins_it(tmp_path):
    """No row holds two samples to give one away, but the tail's sample fits beside a row's: it joins it."""
    service = synchronous_service()
    queue_groups(service, [[10], [40], [40], [40], [30]])  # 10 | 40, then 40 | 40, then 30 alone: it fits beside 10
    taken, trained, share = take_and_split(service, grpo_settings(tmp_path, token_budget=45))
    assert sorted(trained) == sorted(taken)
    assert dict(share.step_items)["batch/unplanned_count"] == 0 and len(share.layout) == 2
    assert [len(positions) for positions in share.layout] == [2, 1]  # rank 0's first row: the 10 and the 30


def test_a_tail_that_fits_nowhere_is_counted_unplanned_not_trained(tmp_path):
    """Three 25-token samples under a 40-token budget: each row holds one, the third fits beside none and there is
    no sample to move. It is trained by no rank, and says so: `batch/unplanned_count` and the queue's count."""
    service = synchronous_service()
    queue_groups(service, [[25], [25], [25]])
    taken, trained, share = take_and_split(service, grpo_settings(tmp_path))
    assert len(trained) == 2 and len(taken) == 3
    items = dict(share.step_items)
    assert items["batch/unplanned_count"] == 1 and share.unplanned == [2]
    service.finish_step(75, unplanned=int(items["batch/unplanned_count"]))
    state = service.state()
    assert state.taken_samples == 3 and state.unplanned_samples == 1  # trained = taken - unplanned: 2, as planned


def test_a_fixed_count_tail_joins_the_last_micro_batch(tmp_path):
    """Fixed count (token_budget=0), micro-batches of 2 samples over 2 ranks (one per rank): a step of 5 samples (the
    stream's last, short step) leaves one; it joins the last micro-batch instead of being trained by no rank."""
    settings = grpo_settings(tmp_path, token_budget=0, per_device_train_batch_size=1)
    service = synchronous_service()
    queue_groups(service, [[6, 7], [8, 9], [5]])
    taken, trained, share = take_and_split(service, settings)
    assert sorted(trained) == sorted(taken) and len(taken) == 5
    assert dict(share.step_items)["batch/unplanned_count"] == 0 and len(share.layout) == 2


def test_a_distillation_tail_is_planned_too(tmp_path):
    """Distillation's plain-row batcher: the same completion (a row holding two samples gives one away)."""
    config = AsyncDistillationConfig(output_dir=str(tmp_path), max_steps=10, gradient_checkpointing=False)
    settings = DISTILL.learner_settings(config, token_budget=40)
    samples = []
    for prompt_id, length in enumerate([10, 10, 10, 10, 35]):
        ids = np.full((length, 2), -1, np.int64)
        ids[1:] = 3
        logprobs = np.where(ids >= 0, -0.5, -np.inf).astype(np.float32)
        mask = np.r_[np.zeros(1, np.int8), np.ones(length - 1, np.int8)]
        samples.append(DistillationSample(np.arange(length) + 2, mask, ids, logprobs, prompt_id=prompt_id))
    shares = split_step(make_objective(settings, 0, WORLD), samples)
    assert sorted(i for share in shares for i in share.indices) == list(range(5))
    assert all(all(positions for positions in share.layout) for share in shares)  # no empty row


@pytest.mark.parametrize("lengths", [[10, 10, 10, 10, 35], [10, 40, 40, 40, 30], [25, 25, 25]])
def test_the_rank_plans_the_tail_as_the_driver_does(tmp_path, lengths):
    """A rank given the whole step (no split ahead) plans the same rows as the driver's split."""
    settings = grpo_settings(tmp_path, token_budget=45)
    samples = []
    for group, length in enumerate(lengths):
        ids = np.arange(length) + 100 * group
        mask = np.r_[np.zeros(1, np.int8), np.ones(length - 1, np.int8)]
        samples.append(RolloutSample(ids, mask, np.zeros(length, np.float32), 1.0, group))
    shares = split_step(make_objective(settings, 0, WORLD), samples)
    for rank in range(WORLD):
        objective = make_objective(settings, rank, WORLD)
        rows = objective.plan(samples)
        mine = [[samples[shares[rank].indices[p]] for p in positions] for positions in shares[rank].layout]
        assert [[id(s) for s in row.samples] for row in rows] == [[id(s) for s in row] for row in mine]


def test_the_queue_refuses_more_unplanned_samples_than_it_handed_out():
    service = synchronous_service()
    queue_groups(service, [[10, 10]])
    service.take(10**6)
    with pytest.raises(ValueError, match="unplanned=3 samples, but only 2 taken"):
        service.finish_step(20, unplanned=3)
    with pytest.raises(ValueError, match="unplanned=-1 must be >= 0"):
        service.finish_step(20, unplanned=-1)
    service.finish_step(20, unplanned=2)
    assert service.state().unplanned_samples == 2
