"""One rank of an N-rank FSDP2 learner, in this process, under torch's fake process group (collectives are no-ops;
sharding, the mixed-precision policy, the tree forward and the LM head all run as on rank 0 of a real job).

The root of the sharding (the scorer: embeddings, final norm, LM head) must stay unsharded from its forward to its
backward. The head's autograd function saves the head weight it read in the forward; resharding the root after the
forward frees that storage and relies on a pre-backward hook on the forward's outputs to gather it again, which
torch 2.11's FSDP2 does not register on a `TokenScores` dataclass — the backward then fails with "data is not
allocated yet" on every multi-rank CUDA run. The decoder layers are resharded after their forward as configured.
"""

import numpy as np
import pytest
import torch

VOCAB = 64


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world_size: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def tiny_model():
    from transformers import AutoModelForCausalLM, Qwen3Config

    from rlasync.model import prepare_for_training

    torch.manual_seed(3)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return prepare_for_training(AutoModelForCausalLM.from_config(config), gradient_checkpointing=True, compile=False)


def one_row(world_size: int):
    from rlasync.model import packed_row_to_tensors
    from rlasync.packing import TokenBudgetBatcher
    from rlasync.rollout import RolloutSample

    rng = np.random.default_rng(0)
    samples = []
    for group in range(2 * world_size):
        prompt = rng.integers(1, VOCAB, 6).tolist()
        for _ in range(3):
            ids = np.array(prompt + rng.integers(1, VOCAB, 4).tolist())
            mask = np.r_[np.zeros(6, np.int8), np.ones(4, np.int8)]
            samples.append(RolloutSample(ids, mask, np.zeros(len(ids), np.float32), 1.0, group))
    batch = TokenBudgetBatcher(world_size, 64).plan(samples)[0]
    return packed_row_to_tensors(batch.pack()[0], "cpu")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-mixed"])
def test_the_root_stays_gathered_from_forward_to_backward(fake_group, world_size, bf16):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from rlasync.learner.parallel import shard_for_training

    fake_group(world_size)
    model = tiny_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    scorer = shard_for_training(model, mp_policy=policy)
    scores = scorer(one_row(world_size))
    head = model.get_output_embeddings().weight
    layer_weight = model.model.layers[0].mlp.up_proj.weight
    assert not isinstance(head, DTensor), "the root was resharded after its forward (its head weight is a shard)"
    assert isinstance(layer_weight, DTensor), "decoder layers are resharded after their forward"
    scores.logprobs.float().sum().backward()  # the head's backward reads the weight it saved
    grads = [p.grad for p in scorer.parameters()]
    assert all(g is not None for g in grads)
    assert all(torch.isfinite(g.full_tensor() if isinstance(g, DTensor) else g).all() for g in grads)
