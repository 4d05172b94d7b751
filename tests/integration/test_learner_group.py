"""Two LearnerActor ranks on CPU (gloo, FSDP2): one step's metrics are reduced over both ranks, and a checkpoint
saved by the sharded group resumes into a new group with the same weights and the same next update."""

import numpy as np
import pytest

pytestmark = pytest.mark.integration

TOKEN_BUDGET = 48


def make_args(tmp_path):
    from rlasync.config import AsyncGRPOConfig

    return AsyncGRPOConfig(
        output_dir=str(tmp_path),
        max_steps=10,
        learning_rate=1e-2,
        gradient_checkpointing=False,
        seed=0,
        score_centering=False,
        num_sampler_logprobs=0,
        temperature=1.0,
        max_grad_norm=1.0,
    )


def make_samples(vocab_size, num_groups=4, group_size=4, seed=0):
    """Random GRPO groups (shared prompt, distinct completions) with made-up sampler log-probs and advantages."""
    from rlasync.rollout import RolloutSample

    rng = np.random.default_rng(seed)
    samples = []
    for group in range(num_groups):
        prompt = rng.integers(5, vocab_size, int(rng.integers(4, 8))).tolist()
        advantages = rng.normal(size=group_size)
        for advantage in advantages - advantages.mean():
            completion = rng.integers(5, vocab_size, int(rng.integers(3, 7))).tolist()
            ids = np.array(prompt + completion)
            mask = np.r_[np.zeros(len(prompt), np.int8), np.ones(len(completion), np.int8)]
            sampler = np.where(mask == 1, -np.log(vocab_size) + rng.normal(0, 0.1, len(ids)), 0.0).astype(np.float32)
            samples.append(RolloutSample(ids, mask, sampler, float(advantage), group))
    return samples


def start_group(ray, model_dir, args, resume_dir=None):
    from actors.learner import LearnerActor
    from rlasync.algorithms.grpo.spec import GRPO

    settings = GRPO.learner_settings(args, token_budget=TOKEN_BUDGET)
    learners = [
        LearnerActor.options(num_cpus=0.25).remote(rank=rank, world_size=2, model=model_dir, settings=settings)
        for rank in range(2)
    ]
    master = ray.get(learners[0].address.remote(), timeout=120)
    infos = ray.get([learner.setup.remote(master, 60.0, resume_dir) for learner in learners], timeout=300)
    assert all(info["sharded"] and info["device"] == "cpu" for info in infos)
    return learners


def train(ray, learners, refs):
    return ray.get([learner.train_step.remote(refs) for learner in learners], timeout=300)


def checksums(ray, learners):
    values = ray.get([learner.checksum.remote() for learner in learners], timeout=120)  # a collective under FSDP2
    assert values[0] == pytest.approx(values[1], rel=1e-12)
    return values[0]


def test_two_ranks_reduce_metrics_and_resume_from_a_sharded_checkpoint(ray_cluster, tiny_model_dir, tmp_path):
    import json

    from rlasync.packing import TokenBudgetBatcher

    ray = ray_cluster
    vocab = len(json.loads(open(f"{tiny_model_dir}/vocab_words.json").read())) + 5
    samples = make_samples(vocab)
    refs = [ray.put(sample) for sample in samples]
    args = make_args(tmp_path)

    # what each rank trains: the same plan the actors make
    per_rank = [0, 0]
    for batch in TokenBudgetBatcher(2, TOKEN_BUDGET).plan(samples):
        for rank, row in enumerate(batch.pack()):
            per_rank[rank] += len(row.target_ids)
    assert min(per_rank) > 0

    learners = start_group(ray, tiny_model_dir, args)
    try:
        first, second = train(ray, learners, refs)
        assert second == []  # rank 0 reports for the group
        metrics = dict(first)
        assert metrics["batch/trained_tokens_per_step"] == per_rank[0] + per_rank[1]
        assert metrics["batch/samples_per_step"] == len(samples)
        numerator, denominator = metrics["entropy"]  # a rate pair over both ranks' loss terms
        assert denominator == per_rank[0] + per_rank[1] and numerator > 0
        assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
        checkpoint = tmp_path / "checkpoint-1"
        ray.get([learner.save.remote(str(checkpoint)) for learner in learners], timeout=300)
        saved = checksums(ray, learners)
        train(ray, learners, refs)
        after_two_steps = checksums(ray, learners)
        assert after_two_steps != pytest.approx(saved, rel=1e-9)
    finally:
        ray.get([learner.close.remote() for learner in learners], timeout=60)
        for learner in learners:
            ray.kill(learner)

    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "optimizer.pt").is_file()
    resumed = start_group(ray, tiny_model_dir, args, resume_dir=str(checkpoint))
    try:
        assert checksums(ray, resumed) == pytest.approx(saved, rel=1e-9)  # the full weights came back
        train(ray, resumed, refs)
        # the optimizer state came back too: the same next update as the group that never stopped
        assert checksums(ray, resumed) == pytest.approx(after_two_steps, rel=1e-9)
    finally:
        ray.get([learner.close.remote() for learner in resumed], timeout=60)
        for learner in resumed:
            ray.kill(learner)
