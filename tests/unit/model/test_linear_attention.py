"""Gated DeltaNet hybrids (Qwen3-Next style: one linear-attention and one full-attention layer) under tree
attention: trained padding-free, every sample its own chain (docs/algorithms.md §4.3). CPU, float32, transformers'
torch fallbacks of the gated delta rule and the short convolution (which take no `cu_seqlens`: a packed row would
mix its samples, so the linear-attention layers run one sample at a time)."""

import copy

import pytest
import torch

from rlasync.algorithms.grpo.spec import GRPO
from rlasync.model import enable_tree_attention, packed_row_to_tensors, packed_token_scores, sequence_logprobs
from rlasync.model.attention import check_layer_types, has_linear_attention
from rlasync.packing import TreeRow, pack
from rlasync.records import RolloutSample

TOL = 1e-5
# Gradients are sums over every token and head, whose float32 order depends on the intra-op thread split: on a
# loaded 2-core CI machine dt_bias's gradient (magnitude ~1) differed from the per-sample forward's by 1.03e-5.
GRAD_TOL = 5e-5


def tiny_qwen3_next(seed=0):
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    config = Qwen3NextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=0,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()


def samples(seed, shared_prompt):
    """(sequences, prompt lengths): three samples, sharing a 6-token prompt or not."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 128, (6,), generator=g).tolist()
    seqs = []
    for length in (5, 9, 3):
        head = prompt if shared_prompt else torch.randint(0, 128, (6,), generator=g).tolist()
        seqs.append(head + torch.randint(0, 128, (length,), generator=g).tolist())
    return seqs, [6, 6, 6]


def row_tensors(seqs, prompts, share_prefixes):
    row = TreeRow(share_prefixes=share_prefixes)
    for seq, prompt in zip(seqs, prompts):
        mask = [0] * prompt + [1] * (len(seq) - prompt)
        row.add(RolloutSample(seq, mask, [0.0] * len(seq), advantage=0.0, group_id=0))
    return packed_row_to_tensors(pack(row))


def test_the_config_check_accepts_gated_deltanet_hybrids_and_still_refuses_other_layers():
    model = tiny_qwen3_next()
    check_layer_types(model.config)
    assert has_linear_attention(model) and has_linear_attention(model.config)
    config = copy.deepcopy(model.config)
    config.layer_types = ["mamba", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types \['mamba'\]"):
        check_layer_types(config)


def test_the_torch_fallback_mixes_the_samples_of_a_plain_packed_row():
    """Why a per-sample forward: the concatenation forwarded as one sequence changes the second sample's log-probs."""
    model = tiny_qwen3_next()
    seqs, prompts = samples(1, shared_prompt=False)
    alone = sequence_logprobs(model, seqs[1:2], prompts[1:2], packing="none")[0]
    joined = sequence_logprobs(model, [seqs[0] + seqs[1]], [len(seqs[0]) + prompts[1]], packing="none")[0]
    assert (alone - joined).abs().max().item() > 1e-3


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_padding_free_logprobs_and_gradients_equal_the_per_sample_forward(shared_prompt):
    reference = tiny_qwen3_next()
    tree_model = enable_tree_attention(copy.deepcopy(reference))
    seqs, prompts = samples(2, shared_prompt)
    expected = torch.cat(sequence_logprobs(reference, seqs, prompts, packing="none"))
    got = packed_token_scores(tree_model, row_tensors(seqs, prompts, share_prefixes=False)).logprobs
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOL
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(0))
    (weights * expected).sum().backward()
    (weights * got).sum().backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    tree_grads = {n: p.grad for n, p in tree_model.named_parameters() if p.grad is not None}
    assert ref_grads.keys() == tree_grads.keys() and any("linear_attn" in n for n in ref_grads)
    for name in ref_grads:  # relative to the parameter's largest gradient (these reach ~10 with large weights)
        scale = max(1.0, ref_grads[name].abs().max().item())
        assert (ref_grads[name] - tree_grads[name]).abs().max().item() <= GRAD_TOL * scale, name


def test_a_row_that_shares_a_prefix_is_refused_with_the_layout_that_works():
    tree_model = enable_tree_attention(tiny_qwen3_next())
    seqs, prompts = samples(3, shared_prompt=True)
    with pytest.raises(ValueError, match=r"share_prefixes=False"):
        packed_token_scores(tree_model, row_tensors(seqs, prompts, share_prefixes=True))


def test_the_model_keeps_its_plain_forward_and_state_dict():
    reference = tiny_qwen3_next()
    tree_model = enable_tree_attention(copy.deepcopy(reference))
    assert tree_model.state_dict().keys() == reference.state_dict().keys()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(tree_model(ids).logits, reference(ids).logits, atol=TOL)


def test_the_grpo_objective_plans_a_hybrid_padding_free_and_steps_on_it():
    """The learner's GRPO objective sees the linear-attention layers and packs each sample as its own chain: a
    group's shared prompt is forwarded once per sample, and a training step runs on the hybrid model."""
    import numpy as np

    from rlasync.config import AsyncGRPOConfig
    from rlasync.learner.objectives import StepParts, make_objective
    from rlasync.model import TreeScorer

    settings = GRPO.learner_settings(AsyncGRPOConfig(output_dir="/tmp/x", score_centering=False), token_budget=64)
    model = enable_tree_attention(tiny_qwen3_next())
    seqs, prompts = samples(5, shared_prompt=True)
    with torch.no_grad():  # on-policy sampler log-probs: no token is masked by the importance-sampling clip
        sampled = sequence_logprobs(tiny_qwen3_next(), seqs, prompts, packing="none")
    group = [
        RolloutSample(
            np.array(seq),
            np.r_[np.zeros(p, np.int8), np.ones(len(seq) - p, np.int8)],
            np.r_[np.zeros(p), lp.numpy()].astype(np.float32),
            advantage,
            0,
        )
        for seq, p, lp, advantage in zip(seqs, prompts, sampled, (1.0, -1.0, 0.5))
    ]
    for linear, expected_tokens in (
        (True, sum(map(len, seqs))),
        (False, sum(map(len, seqs)) - 2 * 5),
    ):  # the trie branches one token early
        objective = make_objective(settings, rank=0, world_size=1)
        scorer = TreeScorer(model if linear else tiny_qwen3_next_like_llama())
        optimizer = torch.optim.SGD(scorer.parameters(), lr=1e-3)
        objective.build(
            StepParts(
                scorer=scorer,
                optimizer=optimizer,
                scheduler=None,
                rank=0,
                world_size=1,
                device=torch.device("cpu"),
                clip_grad_norm=lambda max_norm, s=scorer: torch.nn.utils.clip_grad_norm_(s.parameters(), max_norm),
                autocast_dtype=None,
                sum_across_ranks=None,
            )
        )
        assert objective.share_prefixes is not linear
        rows = objective.rows(objective.plan(group), torch.device("cpu"), pad_id=0)
        assert rows.forwarded_tokens == expected_tokens
    before = [p.detach().clone() for p in model.parameters()]
    objective = make_objective(settings, rank=0, world_size=1)
    scorer = TreeScorer(model)
    optimizer = torch.optim.SGD(scorer.parameters(), lr=1e-2)
    objective.build(
        StepParts(
            scorer=scorer,
            optimizer=optimizer,
            scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
            rank=0,
            world_size=1,
            device=torch.device("cpu"),
            autocast_dtype=None,
            sum_across_ranks=None,
            clip_grad_norm=lambda max_norm: torch.nn.utils.clip_grad_norm_(scorer.parameters(), max_norm),
        )
    )
    metrics = objective.step(objective.rows(objective.plan(group), torch.device("cpu"), pad_id=0))
    assert metrics and any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def tiny_qwen3_next_like_llama():
    """A full-attention-only model of the same vocabulary: its rows share the group's prompt."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return enable_tree_attention(AutoModelForCausalLM.from_config(config).float())
