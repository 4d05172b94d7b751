"""The real `Learner` at world sizes 1, 2 and 4 on CPU (gloo, FSDP2, float32): one `train_step` of GRPO with score
centering over the sampler's top-K, SGD and active gradient clipping, on the same samples, lands on the same
weights at every world size. The 2- and 4-rank weights are gathered the way a weight sync gathers them
(`Learner.weight_stream` -> `rlasync.weights.plan.stream_parameters`): every parameter of the manifest exactly once,
in manifest order, with its full shape, one all-gather per parameter, each gathered tensor released before the next is gathered (no
whole-model materialisation).

Why the weights must agree: the step is one micro-batch at every world size (the token budget holds all the samples
in one row), so the loss is Σ terms / (terms over all ranks) either way: each rank normalises its terms by the
all-rank count / world size and FSDP2's reduce-scatter averages the ranks' gradients; the gradient norm that clips
them is all-reduced too. What differs is only float32 summation order (per-rank partial sums, the reduce-scatter).

The 1-rank Learner runs in the test process; the ranks of 2 and 4 run this file as a script, all six at once,
one thread each: `python test_learner_ranks.py RANK WORLD INIT_FILE WORK_DIR`. Cost: ~46 s of CPU in all (most of it
the six processes importing torch and transformers, ~6 s each), so ~25 s on two idle cores; not marked slow.
"""

import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
VOCAB, TOP_K, TOKEN_BUDGET, NUM_GROUPS, GROUP_SIZE = 64, 4, 256, 6, 3
WORLDS = (2, 4)
# Measured error, max |w_N - w_1| over every element of every parameter (weights of order 0.02-1, SGD lr 0.5 with
# the gradient clipped to norm 0.5): 7.5e-9 at 2 ranks, 1.1e-8 at 4 (float32 rounding of the same sums in another
# order). The tolerance is ~10x above it, absolute only.
ATOL, RTOL = 1e-7, 0.0


def grpo_settings(output_dir: str):
    from rlasync.algorithms.grpo.spec import GRPO
    from rlasync.config import AsyncGRPOConfig

    config = AsyncGRPOConfig(
        output_dir=output_dir,
        max_steps=10,
        learning_rate=0.5,
        optim="sgd",  # deterministic, stateless: the update is -lr * the (clipped) gradient
        lr_scheduler_type="constant",
        max_grad_norm=0.5,  # active (the norm is larger): the all-reduced gradient norm is compared too
        gradient_checkpointing=False,
        seed=0,
        score_centering=True,
        num_sampler_logprobs=TOP_K,
        temperature=1.0,
    )
    return GRPO.learner_settings(config, token_budget=TOKEN_BUDGET)


def save_tiny_qwen3(path: Path) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(5)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def make_samples(model_dir: Path) -> list:
    """GRPO groups (shared prompt, distinct completions) with near-on-policy sampler log-probs and the sampler's
    top-K (what score centering reads), from the saved model."""
    from transformers import AutoModelForCausalLM

    from rlasync.rollout import RolloutSample

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = np.random.default_rng(7)
    samples = []
    for group in range(NUM_GROUPS):
        prompt = rng.integers(2, VOCAB, int(rng.integers(6, 10))).tolist()
        advantages = rng.normal(size=GROUP_SIZE)
        for advantage in advantages - advantages.mean():
            seq = prompt + rng.integers(2, VOCAB, int(rng.integers(3, 8))).tolist()
            with torch.no_grad():
                logprobs = model(torch.tensor([seq])).logits[0, :-1].log_softmax(-1)  # position t predicts t + 1
            chosen = logprobs.gather(1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()
            mask = np.r_[np.zeros(len(prompt), np.int8), np.ones(len(seq) - len(prompt), np.int8)]
            sampler = np.zeros(len(seq), np.float32)
            sampler[1:] = chosen + rng.normal(0, 0.05, len(seq) - 1)  # slightly off-policy: ratios != 1
            sampler[mask == 0] = 0.0
            top = torch.topk(logprobs, TOP_K, dim=-1)
            ids, vals = np.full((len(seq), TOP_K), -1, np.int64), np.full((len(seq), TOP_K), -np.inf, np.float32)
            ids[1:], vals[1:] = top.indices.numpy(), top.values.numpy()
            samples.append(
                RolloutSample(
                    np.array(seq),
                    mask,
                    sampler,
                    float(advantage),
                    group,
                    sampler_topk_ids=ids,
                    sampler_topk_logprobs=vals,
                )
            )
    return samples


def gathered_weights(learner) -> dict[str, torch.Tensor]:
    """The weight sync's gather, checked: each manifest entry once, in order, full shape, from exactly one
    all-gather per parameter when sharded (none with one rank); the stream keeps no reference to a tensor it has
    yielded once it has moved on (one parameter gathered at a time)."""
    from torch.distributed.tensor import DTensor

    manifest = learner.weight_manifest()
    weights: dict[str, torch.Tensor] = {}
    gathers: list[tuple[int, ...]] = []
    full_tensor = DTensor.full_tensor

    def counted(self, *args, **kwargs):
        gathers.append(tuple(self.shape))
        return full_tensor(self, *args, **kwargs)

    previous = None
    DTensor.full_tensor = counted
    try:
        for entry, (name, tensor) in zip(manifest, learner.weight_stream(), strict=True):
            assert previous is None or previous() is None, f"the stream still holds the tensor before {name}"
            assert name == entry.name and name not in weights, name
            assert tuple(tensor.shape) == tuple(entry.shape), name
            assert not isinstance(tensor, DTensor), name  # a plain (gathered) tensor, not a shard
            weights[name] = tensor.clone()
            previous = weakref.ref(tensor)
            del tensor
    finally:
        DTensor.full_tensor = full_tensor
    sharded = learner.world_size > 1
    assert gathers == ([tuple(entry.shape) for entry in manifest] if sharded else []), gathers
    return weights


def rank_main(rank: int, world: int, init_file: str, work_dir: str) -> None:
    import torch.distributed as dist

    from rlasync.learner import Learner
    from rlasync.learner.parallel import GroupReducer

    torch.set_num_threads(1)
    work = Path(work_dir)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        reducer = GroupReducer(rank, torch.device("cpu"), timeout_s=120.0)
        learner = Learner(
            str(work / "model"),
            grpo_settings(str(work / f"out{world}")),
            rank=rank,
            world_size=world,
            device="cpu",
            reducer=reducer,
        )
        assert learner.info()["sharded"]
        items = learner.train_step(torch.load(work / "samples.pt", weights_only=False))
        weights = gathered_weights(learner)
    finally:
        dist.destroy_process_group()
    torch.save({"weights": weights, "items": items}, work / f"world{world}_rank{rank}.pt")


def one_rank(model_dir: Path, samples: list, output_dir: str):
    from rlasync.learner import Learner

    learner = Learner(str(model_dir), grpo_settings(output_dir), device="cpu")
    before = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    metrics = dict(learner.train_step(samples))
    return before, gathered_weights(learner), metrics


def test_two_and_four_learner_ranks_take_the_one_rank_step(tmp_path):
    from rlasync.packing import TokenBudgetBatcher

    torch.set_num_threads(1)
    save_tiny_qwen3(tmp_path / "model")
    samples = make_samples(tmp_path / "model")
    torch.save(samples, tmp_path / "samples.pt")
    loads = {}
    for world in (1, *WORLDS):  # the learner's plan: one micro-batch, every rank holds samples
        (batch,) = TokenBudgetBatcher(world, TOKEN_BUDGET).plan(list(samples))
        assert all(row.num_samples > 0 for row in batch.rows), world
        loads[world] = [row.load for row in batch.rows]

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(world), str(tmp_path / f"pg{world}"), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for world in WORLDS
        for rank in range(world)
    ]
    before, expected, metrics = one_rank(tmp_path / "model", samples, str(tmp_path / "out1"))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)

    assert metrics["batch/microbatches_per_step"] == 1  # one micro-batch: the normaliser is the same at any world
    moved = [name for name in before if not torch.equal(before[name], expected[name])]
    assert len(moved) == len(before)  # every parameter was trained, so the comparison covers them all
    for world in WORLDS:
        results = [torch.load(tmp_path / f"world{world}_rank{rank}.pt") for rank in range(world)]
        for rank, result in enumerate(results):
            assert list(result["weights"]) == list(expected), (world, rank)
            for name, value in expected.items():
                torch.testing.assert_close(result["weights"][name], value, atol=ATOL, rtol=RTOL, msg=f"{world} {name}")
        items = dict(results[0]["items"])
        assert all(result["items"] == [] for result in results[1:])  # only rank 0 reports
        assert items["batch/microbatches_per_step"] == 1
        assert items["batch/row_imbalance"] == pytest.approx(
            max(loads[world]) / np.mean(loads[world])
        )  # attention cost
        assert items["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
        assert items["grad_norm"] > 0.5  # the clip was active
        assert items["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-6)


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
