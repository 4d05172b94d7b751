"""A step split over the learner ranks (`rlasync.learner.sharing`): each rank gets only the samples of its own rows.

* the shares of 2 and 4 ranks are disjoint, their union is the step, and each rank's rows are exactly the rows the
  objective's balancing planner gives that rank (GRPO's tree batcher, distillation's Σ L² batcher);
* the driver's split, over the queue entries' metadata (`StepSplitter`), is the split of the full samples;
* a rank's packed rows and the all-reduced normalisers equal what it computed before from the whole step (every
  rank packing every row: `batch.pack()[rank]`, Σ terms over all rows; distillation's collated `[P, N]` batch);
* two gloo ranks, each sent only its share's samples, land on the weights of one rank training the whole step.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlasync.algorithms.distill.samples import DistillationSample
from rlasync.algorithms.distill.spec import DISTILL
from rlasync.algorithms.grpo.spec import GRPO
from rlasync.config import AsyncDistillationConfig, AsyncGRPOConfig
from rlasync.learner.objectives import make_objective
from rlasync.learner.sharing import StepSplitter, split_step
from rlasync.pipeline.staleness_queue import QueueEntry
from rlasync.rollout import RolloutSample

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
TOKEN_BUDGET = 40


def grpo_samples(num_groups=10, group_size=3, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for group in range(num_groups):
        prompt = rng.integers(2, 50, int(rng.integers(4, 9))).tolist()
        for _ in range(group_size):
            seq = prompt + rng.integers(2, 50, int(rng.integers(2, 9))).tolist()
            mask = np.r_[np.zeros(len(prompt), np.int8), np.ones(len(seq) - len(prompt), np.int8)]
            logprobs = np.where(mask == 1, -rng.random(len(seq)), 0.0).astype(np.float32)
            metrics = {"reward": float(rng.random()), "rewards/len": float(len(seq))}
            samples.append(RolloutSample(np.array(seq), mask, logprobs, float(rng.normal()), group, metrics=metrics))
    return samples


def distill_samples(num_prompts=24, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for prompt_id in range(num_prompts):
        prompt_len, completion_len = int(rng.integers(2, 6)), int(rng.integers(2, 8))
        n, width = prompt_len + completion_len, int(rng.integers(2, 5))  # widths differ across samples
        ids = np.full((n, width), -1, np.int64)
        ids[prompt_len:] = rng.integers(2, 50, (completion_len, width))
        logprobs = np.where(ids >= 0, -rng.random((n, width)), -np.inf).astype(np.float32)
        mask = np.r_[np.zeros(prompt_len, np.int8), np.ones(completion_len, np.int8)]
        samples.append(DistillationSample(rng.integers(2, 50, n), mask, ids, logprobs, prompt_id=prompt_id))
    return samples


def grpo_settings(tmp_path, token_budget=TOKEN_BUDGET, **overrides):
    config = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=10, gradient_checkpointing=False, **overrides)
    return GRPO.learner_settings(config, token_budget=token_budget)


def distill_settings(tmp_path, token_budget=TOKEN_BUDGET):
    config = AsyncDistillationConfig(output_dir=str(tmp_path), max_steps=10, gradient_checkpointing=False)
    return DISTILL.learner_settings(config, token_budget=token_budget)


def check_split(settings, samples, world):
    """The shares partition the step and hold the planner's rows; returns (shares, the planner's micro-batches)."""
    batches = make_objective(settings, 0, world).new_batcher().plan(list(samples))
    assert len(batches) >= 2  # several micro-batches: the layout spans them
    shares = split_step(make_objective(settings, 0, world), samples)
    assert [share.rank for share in shares] == list(range(world))
    taken = [i for share in shares for i in share.indices]
    assert len(taken) == len(set(taken))  # disjoint
    planned = {id(sample) for batch in batches for sample in batch.samples}  # a short tail is planned too (§4.5.2)
    assert {id(samples[i]) for i in taken} == planned == {id(sample) for sample in samples}
    assert all(share.unplanned == [] for share in shares)
    for share in shares:
        assert len(share.layout) == len(batches)
        for batch, positions in zip(batches, share.layout, strict=True):
            mine = [id(samples[share.indices[p]]) for p in positions]
            assert mine == [id(sample) for sample in batch.rows[share.rank].samples]  # the balancing's row, in order
    metrics = [item for batch in batches for item in batch.metrics().items()]
    assert shares[0].planner_items == metrics and all(not s.planner_items for s in shares[1:])
    assert dict(shares[0].step_items)["batch/samples_per_step"] == len(samples)
    assert all(not s.step_items for s in shares[1:])
    assert max(s.num_samples for s in shares) < len(samples)  # no rank is sent the whole step
    return shares, batches


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_gets_a_disjoint_part_of_the_step_as_the_balancing_planned_it(tmp_path, world):
    samples = grpo_samples()
    shares, batches = check_split(grpo_settings(tmp_path), samples, world)
    imbalance = [value for key, value in shares[0].planner_items if key == "batch/row_imbalance"]
    loads = [[row.load for row in batch.rows] for batch in batches]
    assert imbalance == pytest.approx([max(load) / np.mean(load) for load in loads])


@pytest.mark.parametrize("world", [2, 4])
def test_a_fixed_count_plan_and_a_distillation_plan_split_the_same_way(tmp_path, world):
    check_split(grpo_settings(tmp_path, token_budget=0, per_device_train_batch_size=2), grpo_samples(), world)
    check_split(distill_settings(tmp_path), distill_samples(), world)


@pytest.mark.parametrize("world", [2, 4])
def test_the_driver_splits_the_queue_entries_as_the_ranks_would_split_the_samples(tmp_path, world):
    settings = grpo_settings(tmp_path)
    samples = grpo_samples(seed=1)
    entries = [QueueEntry.for_sample(sample, payload=f"ref{i}") for i, sample in enumerate(samples)]
    parts = StepSplitter.for_learners(settings, world).split(entries)
    expected = split_step(make_objective(settings, 0, world), samples)
    assert [share for _, share in parts] == expected  # indices, layout and the planner's metrics alike
    for payloads, share in parts:
        assert payloads == [f"ref{i}" for i in share.indices]
    without_ids = [QueueEntry(payload=i, group_id=0, policy_version=0, num_tokens=3) for i in range(4)]
    assert StepSplitter.for_learners(settings, world).split(without_ids) is None  # the ranks split it themselves


class TwoPhaseReduce:
    """Every rank's all-reduce in one process: record each rank's vectors, then answer with their sums / maxes."""

    def __init__(self):
        self.sums, self.maxes, self.answer = [], [], None

    def __call__(self, sums, maxes):
        if self.answer is None:
            self.sums.append(sums.clone())
            self.maxes.append(maxes.clone())
            return sums, maxes
        return self.answer

    def close(self):
        self.answer = (torch.stack(self.sums).sum(0), torch.stack(self.maxes).max(0).values)


def rank_rows(settings, samples, world):
    """Each rank's `Objective.rows` over only its share's samples, the normalisers all-reduced over the ranks."""
    shares = split_step(make_objective(settings, 0, world), samples)
    objectives = [make_objective(settings, rank, world) for rank in range(world)]
    reduce = TwoPhaseReduce()
    for phase in range(2):
        out = []
        for objective, share in zip(objectives, shares, strict=True):
            objective.all_reduce = reduce
            objective.layout = share.layout
            out.append(objective.rows(objective.plan([samples[i] for i in share.indices]), torch.device("cpu"), 0))
        if phase == 0:
            reduce.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_ranks_rows_and_normalisers_are_those_it_took_from_the_whole_step(tmp_path, world):
    settings = grpo_settings(tmp_path)
    samples = grpo_samples(seed=2)
    batches = make_objective(settings, 0, world).new_batcher().plan(list(samples))
    whole = [batch.pack() for batch in batches]  # what every rank packed before
    terms = [float(sum(len(row.target_ids) for row in packed)) for packed in whole]
    for rank, rows in enumerate(rank_rows(settings, samples, world)):
        assert rows.global_terms == terms
        for mine, packed in zip(rows.rows, whole, strict=True):
            for name in ("input_ids", "position_ids", "subtree_end", "token_index", "target_ids", "advantages"):
                np.testing.assert_array_equal(getattr(mine, name), getattr(packed[rank], name), err_msg=name)


@pytest.mark.parametrize("world", [2, 4])
def test_a_distillation_ranks_row_is_its_row_of_the_collated_micro_batch(tmp_path, world):
    from rlasync.algorithms.distill.learner_step import distill_row_tensors

    settings = distill_settings(tmp_path)
    samples = distill_samples(seed=3)
    batches = make_objective(settings, 0, world).new_batcher().plan(list(samples))
    for rank, rows in enumerate(rank_rows(settings, samples, world)):
        for mine, batch in zip(rows.rows, batches, strict=True):
            before = distill_row_tensors(batch.collate(0), rank)  # the [P, N] batch of every rank's rows
            assert mine.global_n_tokens == before.global_n_tokens
            for name in ("input_ids", "position_ids", "completion_mask", "teacher_topk_ids", "teacher_topk_logprobs"):
                assert torch.equal(getattr(mine, name), getattr(before, name)), name


# ---- two gloo ranks, each sent only its share ------------------------------------------------------------------


def ranks_module():
    spec = importlib.util.spec_from_file_location("learner_ranks", HERE / "test_learner_ranks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank_main(rank: int, world: int, init_file: str, work_dir: str) -> None:
    import torch.distributed as dist

    from rlasync.learner import Learner
    from rlasync.learner.parallel import GroupReducer

    ranks = ranks_module()
    torch.set_num_threads(1)
    work = Path(work_dir)
    samples = torch.load(work / "samples.pt", weights_only=False)
    settings = ranks.grpo_settings(str(work / f"out{world}"))
    entries = [QueueEntry.for_sample(sample, payload=sample) for sample in samples]  # the driver's side
    payloads, share = StepSplitter.for_learners(settings, world).split(entries)[rank]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        reducer = GroupReducer(rank, torch.device("cpu"), timeout_s=120.0)
        learner = Learner(str(work / "model"), settings, rank=rank, world_size=world, device="cpu", reducer=reducer)
        items = learner.train_step(payloads, share=share)
        weights = ranks.gathered_weights(learner)
    finally:
        dist.destroy_process_group()
    torch.save({"weights": weights, "items": items, "sent": len(payloads)}, work / f"share{world}_rank{rank}.pt")


def test_two_ranks_sent_only_their_share_take_the_one_rank_step(tmp_path):
    ranks = ranks_module()
    torch.set_num_threads(1)
    ranks.save_tiny_qwen3(tmp_path / "model")
    samples = ranks.make_samples(tmp_path / "model")
    torch.save(samples, tmp_path / "samples.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), "2", str(tmp_path / "pg2"), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    _, expected, metrics = ranks.one_rank(tmp_path / "model", samples, str(tmp_path / "out1"))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    results = [torch.load(tmp_path / f"share2_rank{rank}.pt") for rank in range(2)]
    assert sum(result["sent"] for result in results) == len(samples)  # each sample to one rank
    assert all(0 < result["sent"] < len(samples) for result in results)
    for result in results:
        for name, value in expected.items():
            torch.testing.assert_close(result["weights"][name], value, atol=ranks.ATOL, rtol=ranks.RTOL, msg=name)
    items = dict(results[0]["items"])
    assert items["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-6)
    assert items["batch/samples_per_step"] == len(samples)  # the whole step's, from the split
    assert items["batch/samples_per_rank_max"] == max(result["sent"] for result in results)
    assert metrics["batch/samples_per_rank_max"] == len(samples)  # one rank is sent the whole step


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])


@pytest.mark.parametrize("spec", ["grpo", "distill"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fixed_count_steps_give_each_rank_per_device_train_batch_size_samples_per_micro_batch(tmp_path, spec, world):
    """TRL's `per_device_train_batch_size` (token_budget=0): every rank's row of a micro-batch holds B samples, so
    a step of B x GA x P samples is GA micro-batches (B = 1 with several ranks included)."""
    per_device, accumulation = (1, 3) if world > 1 else (2, 3)
    if spec == "grpo":
        config = AsyncGRPOConfig(
            output_dir=str(tmp_path),
            max_steps=10,
            gradient_checkpointing=False,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
        )
        settings, samples = GRPO.learner_settings(config, token_budget=0), grpo_samples(num_groups=12, group_size=4)
    else:
        config = AsyncDistillationConfig(
            output_dir=str(tmp_path),
            max_steps=10,
            gradient_checkpointing=False,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
        )
        settings, samples = DISTILL.learner_settings(config, token_budget=0), distill_samples(num_prompts=48)
    step = samples[: config.samples_per_step(world)]
    batches = make_objective(settings, 0, world).new_batcher().plan(list(step))
    assert len(batches) == accumulation
    assert all(len(batch.rows) == world for batch in batches)
    assert sum(len(row.samples) for batch in batches for row in batch.rows) == len(step)
