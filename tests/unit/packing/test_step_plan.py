"""The step's composition (rlasync.packing.step_plan): the queue runs the learner's planner ahead, so a step is
exactly `gradient_accumulation_steps` micro-batches of P rows; replayed against TRL 1.16's own TokenBudgetBatcher."""

import collections
import os
from dataclasses import dataclass

import numpy as np
import pytest

from rlasync.algorithms.distill.batching import TokenBudgetBatcher as DistillBatcher
from rlasync.packing import TokenBudgetBatcher
from rlasync.packing.step_plan import StepComposer, StepPlan
from rlasync.pipeline import QueueEntry
from rlasync.pipeline.staleness_queue import StalenessQueue

DISTILL_BATCHER = "rlasync.algorithms.distill.batching:TokenBudgetBatcher"


@dataclass(eq=False)
class Sample:
    input_ids: np.ndarray
    completion_mask: np.ndarray
    group_id: int
    policy_version: int = 0

    def __len__(self):
        return len(self.input_ids)

    @property
    def num_trained_tokens(self):
        return int(self.completion_mask.sum())

    @property
    def prompt_id(self):
        return self.group_id


def sample_stream(num_groups, group_size, seed=0, max_completion=150):
    """Groups of `group_size` samples sharing a prompt (20-69 tokens), completions of geometric lengths."""
    rng = np.random.default_rng(seed)
    samples = []
    for group in range(num_groups):
        prompt_len = int(rng.integers(20, 70))
        prompt = rng.integers(0, 1000, prompt_len)
        for _ in range(group_size):
            length = int(min(rng.geometric(1 / 40), max_completion))
            ids = np.concatenate([prompt, rng.integers(0, 1000, length)])
            mask = np.r_[np.zeros(prompt_len, np.int8), np.ones(length, np.int8)]
            samples.append(Sample(ids, mask, group))
    return samples


def queue_of(samples, with_ids=True):
    queue = StalenessQueue()
    by_group = collections.defaultdict(list)
    for sample in samples:
        by_group[sample.group_id].append(sample)
    for group in by_group.values():
        queue.put(
            QueueEntry(
                payload=s,
                group_id=s.group_id,
                policy_version=s.policy_version,
                num_tokens=len(s),
                num_trained_tokens=s.num_trained_tokens,
                input_ids=s.input_ids if with_ids else None,
            )
            for s in group
        )
    return queue


def composed_steps(queue, plan, version=0, max_staleness=1):
    """Every full step the composer takes from `queue` (a partial last one stays out), as lists of samples."""
    composer = StepComposer(plan)
    steps = []
    while True:
        taken = queue.take(0, version, max_staleness, admit=composer.offer)
        if not composer.full:
            return steps, [entry.payload for entry in taken.entries]
        steps.append([entry.payload for entry in taken.entries])
        composer.reset()


def step_shape(rows, budget, tokens_of):
    return len(rows), sum(len(row.samples) for row in rows), sum(tokens_of(row) for row in rows) / (len(rows) * budget)


@pytest.mark.parametrize("num_ranks", [1, 2])
@pytest.mark.parametrize("micro_batches", [1, 2, 3])
def test_the_learner_plans_exactly_the_composed_micro_batches_and_the_next_sample_opens_the_next_step(
    num_ranks, micro_batches
):
    samples = sample_stream(60, 4)
    plan = StepPlan(num_ranks=num_ranks, token_budget=256, micro_batches=micro_batches)
    queue = queue_of(samples)
    steps, rest = composed_steps(queue, plan)
    assert len(steps) > 5
    for step in steps:
        batches = TokenBudgetBatcher(num_ranks, 256).plan(step)
        assert len(batches) == micro_batches and sum(b.num_samples for b in batches) == len(step)
        assert all(row.num_samples > 0 and row.num_tokens <= 256 for b in batches for row in b.rows)
    # exactly once, in order: the steps and what is left are the stream
    assert [s for step in steps for s in step] + rest == samples[: sum(map(len, steps)) + len(rest)]
    assert sum(map(len, steps)) + len(rest) == len(samples)


def test_a_full_step_leaves_the_sample_that_opens_the_next_one_at_the_front():
    samples = sample_stream(20, 4)
    queue = queue_of(samples)
    composer = StepComposer(StepPlan(num_ranks=1, token_budget=256, micro_batches=2))
    first = queue.take(0, 0, 1, admit=composer.offer)
    assert composer.full and first.entries and len(queue) == len(samples) - len(first.entries)
    assert queue.take(0, 0, 1, admit=composer.offer).entries == ()  # full until reset: nothing more is taken
    composer.reset()
    second = queue.take(0, 0, 1, admit=composer.offer)
    assert second.entries[0].payload is samples[len(first.entries)]


def test_stale_entries_are_dropped_while_composing_and_do_not_count_in_the_step():
    samples = sample_stream(30, 4)
    for sample in samples[:8]:
        sample.policy_version = 0  # two groups, stale at version 2 with max_staleness 1
    for sample in samples[8:]:
        sample.policy_version = 2
    queue = queue_of(samples)
    composer = StepComposer(StepPlan(num_ranks=1, token_budget=256, micro_batches=1))
    taken = queue.take(0, 2, 1, admit=composer.offer)
    assert len(taken.dropped_stale) == 8 and composer.full
    assert [e.payload for e in taken.entries] == samples[8 : 8 + len(taken.entries)]
    assert len(TokenBudgetBatcher(1, 256).plan([e.payload for e in taken.entries])) == 1


def test_entries_without_token_ids_share_nothing_so_a_step_never_overflows():
    samples = sample_stream(40, 4)
    plan = StepPlan(num_ranks=2, token_budget=512, micro_batches=2)
    with_ids, _ = composed_steps(queue_of(samples), plan)
    without, _ = composed_steps(queue_of(samples, with_ids=False), plan)
    assert len(without[0]) < len(with_ids[0])  # sharing a prompt packs more samples per row
    for step in without:
        assert len(TokenBudgetBatcher(2, 512).plan(step)) <= 2


def test_distillation_steps_compose_with_its_plain_row_batcher():
    samples = sample_stream(80, 1)
    plan = StepPlan(num_ranks=2, token_budget=300, micro_batches=2, batcher=DISTILL_BATCHER)
    steps, _ = composed_steps(queue_of(samples), plan)
    assert len(steps) > 5
    for step in steps:
        batches = DistillBatcher(2, 300).plan(step)
        assert len(batches) == 2 and sum(b.num_samples for b in batches) == len(step)


def test_oversize_samples_are_taken_and_dropped_by_the_planner_as_by_the_learner():
    samples = sample_stream(10, 2)
    long = Sample(np.arange(400), np.ones(400, np.int8), 99)
    stream = samples[:4] + [long] + samples[4:]
    steps, _ = composed_steps(queue_of(stream), StepPlan(num_ranks=1, token_budget=256, micro_batches=2))
    assert any(long in step for step in steps)
    for step in steps:
        assert len(TokenBudgetBatcher(1, 256).plan(step)) == 2


def test_a_bad_step_plan_names_the_field():
    with pytest.raises(ValueError, match="micro_batches=0"):
        StepPlan(num_ranks=1, token_budget=256, micro_batches=0)
    with pytest.raises(ValueError, match="module:Class"):
        StepPlan(num_ranks=1, token_budget=256, micro_batches=1, batcher="TokenBudgetBatcher")


# ---- TRL 1.16's own batcher ------------------------------------------------------------------------------------------


def trl_steps(samples, num_ranks, budget, micro_batches):
    """TRL's TokenBudgetBatcher over the stream; a step = `gradient_accumulation_steps` consecutive micro-batches
    (its trainer's accumulation), complete steps only (TRL never emits the open rows at the end of a stream)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = pytest.importorskip("trl.experimental.async_grpo.async_grpo_trainer")
    stream = [{"input_ids": s.input_ids, "completion_mask": s.completion_mask, "group_id": s.group_id} for s in samples]
    micro = list(trainer.TokenBudgetBatcher(stream, num_ranks, budget, collections.defaultdict(list)))
    steps = [micro[k : k + micro_batches] for k in range(0, len(micro) - micro_batches + 1, micro_batches)]
    return [step_shape([row for mb in step for row in mb], budget, lambda row: len(row.tokens)) for step in steps]


def our_steps(samples, num_ranks, budget, micro_batches, placement):
    """Our composition, then our learner's planner over each step's samples."""
    plan = StepPlan(num_ranks=num_ranks, token_budget=budget, micro_batches=micro_batches, placement=placement)
    steps, _ = composed_steps(queue_of(samples), plan)
    shapes = []
    for step in steps:
        rows = [row for b in TokenBudgetBatcher(num_ranks, budget, placement=placement).plan(step) for row in b.rows]
        shapes.append(step_shape(rows, budget, lambda row: row.num_tokens))
    return shapes


@pytest.mark.parametrize("budget", [256, 512, 1024])
@pytest.mark.parametrize("num_ranks", [1, 2])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_steps_match_trl_1_16_token_budget_batcher(budget, num_ranks, micro_batches):
    """With TRL's placement rule ("1.16") every step has the same rows, samples and fill as TRL's; with ours ("seed",
    the learner's default) rows per step are the same GA × P, and the guarded move (docs/algorithms.md §4.8) only
    ever places a sample TRL would have sent to the next micro-batch when that does not raise the micro-batch's
    cost, so a step holds as many samples or a few more (at most 10% over the stream), at a fill as high or higher."""
    samples = sample_stream(150, 4)
    trl = trl_steps(samples, num_ranks, budget, micro_batches)
    same_rule = our_steps(samples, num_ranks, budget, micro_batches, "1.16")
    assert len(trl) > 3 and same_rule[: len(trl)] == trl and len(same_rule) == len(trl)
    seed = our_steps(samples, num_ranks, budget, micro_batches, "seed")
    assert {rows for rows, _, _ in seed} == {num_ranks * micro_batches}
    n = min(len(seed), len(trl))
    ours_mean = np.mean([s for _, s, _ in seed[:n]])
    trl_mean = np.mean([s for _, s, _ in trl[:n]])
    assert trl_mean <= ours_mean <= 1.1 * trl_mean
    assert np.mean([f for _, _, f in seed]) >= np.mean([f for _, _, f in trl]) - 1e-9
    if num_ranks == 1:  # one row: the guarded move never applies, the rules are equal
        assert seed == trl
