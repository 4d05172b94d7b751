"""Tree-packed log-probs and gradients equal unpacked ones on tiny random transformers models (CPU, float32)."""

import copy

import pytest
import torch

from rlasync.model import (
    build_tree_attention,
    enable_tree_attention,
    packed_token_scores,
    sequence_logprobs,
)
from rlasync.model.attention import check_layer_types, check_tree_attention_support

TOL = 1e-5


def _linear_functional(logprobs, seed=1):
    flat = torch.cat(logprobs)
    weights = torch.randn(flat.shape, generator=torch.Generator().manual_seed(seed))
    return (weights * flat).sum() / max(1, flat.numel())


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _compare(reference_model, tree_model, seqs, prompts, **tree_kwargs):
    reference = sequence_logprobs(reference_model, seqs, prompts, packing="none")
    packed = sequence_logprobs(tree_model, seqs, prompts, packing="tree", **tree_kwargs)
    assert [r.shape for r in reference] == [p.shape for p in packed]
    value_diff = max((r - p).abs().max().item() for r, p in zip(reference, packed) if r.numel())
    _linear_functional(reference).backward()
    _linear_functional(packed).backward()
    ref_grads, tree_grads = _grads(reference_model), _grads(tree_model)
    assert ref_grads.keys() == tree_grads.keys() and ref_grads
    grad_diff = max((ref_grads[n] - tree_grads[n]).abs().max().item() for n in ref_grads)
    return value_diff, grad_diff


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("shape", ["grpo", "chain", "disjoint", "ragged"])
def test_tree_packed_logprobs_and_gradients_equal_unpacked(make_model, scenarios, family, shape):
    reference_model = make_model(family)
    tree_model = enable_tree_attention(copy.deepcopy(reference_model))
    value_diff, grad_diff = _compare(reference_model, tree_model, *scenarios(shape, seed=len(shape)))
    assert value_diff <= TOL and grad_diff <= TOL, (value_diff, grad_diff)


@pytest.mark.parametrize("family", ["qwen3_sliding", "gemma2"])
def test_sliding_windows_and_softcaps_apply_on_depth_positions(make_model, scenarios, family):
    reference_model = make_model(family)
    tree_model = enable_tree_attention(copy.deepcopy(reference_model))
    value_diff, grad_diff = _compare(reference_model, tree_model, *scenarios("mixed", seed=3))
    assert value_diff <= TOL and grad_diff <= TOL, (value_diff, grad_diff)


def test_gradient_checkpointing_and_training_mode_keep_the_tree_exact(make_model, scenarios):
    reference_model = make_model("qwen3")
    tree_model = enable_tree_attention(copy.deepcopy(reference_model))
    enable = getattr(tree_model, "activation_checkpointing_enable", None) or tree_model.gradient_checkpointing_enable
    enable()  # transformers >= 5.2x renamed gradient_checkpointing_enable
    tree_model.train()
    value_diff, grad_diff = _compare(reference_model, tree_model, *scenarios("mixed", seed=5))
    assert value_diff <= TOL and grad_diff <= TOL, (value_diff, grad_diff)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("family", ["llama", "qwen3_sliding"])
def test_flex_backend_matches_dense_backend(make_model, scenarios, packed_tensors, family):
    """FlexAttention run eagerly on CPU with a small block size, so the BlockMask spans many blocks (forward only:
    FlexAttention has no CPU backward; tests/gpu checks gradients on CUDA)."""
    model = enable_tree_attention(make_model(family))
    seqs, prompts = scenarios("mixed", seed=2)
    tensors = packed_tensors(seqs, prompts)
    assert tensors.num_tokens > 3 * 16
    with torch.no_grad():
        dense = packed_token_scores(model, tensors, backend="dense")
        flex = packed_token_scores(model, tensors, backend="flex", block_size=16, compile_flex=False)
    assert (dense.logprobs - flex.logprobs).abs().max() <= TOL


def test_a_flex_compile_failure_falls_back_to_dense_masks_with_one_warning(
    make_model, scenarios, packed_tensors, monkeypatch, caplog
):
    """Inductor may find no FlexAttention kernel for a shape/dtype on some GPU (NoValidChoicesError): the step must
    still run, with the dense masks, and say so once."""
    import torch._dynamo.exc

    from rlasync.model import attention

    class NoValidChoicesError(torch._dynamo.exc.TorchDynamoException):  # as Inductor's, wrapped by Dynamo
        pass

    calls = []

    def failing_compiled_flex():
        def run(*args, **kwargs):
            calls.append(1)
            raise NoValidChoicesError("No choices to select")

        return run

    monkeypatch.setattr(attention, "_compiled_flex_attention", failing_compiled_flex)
    monkeypatch.setattr(attention, "_FLEX_COMPILE_FAILED", [])
    model = enable_tree_attention(make_model("qwen3_sliding"))
    seqs, prompts = scenarios("mixed", seed=3)
    tensors = packed_tensors(seqs, prompts)
    with torch.no_grad(), caplog.at_level("WARNING", logger=attention.__name__):
        dense = packed_token_scores(model, tensors, backend="dense")
        fallback = packed_token_scores(model, tensors, backend="flex", block_size=16, compile_flex=True)
        again = packed_token_scores(model, tensors, backend="flex", block_size=16, compile_flex=True)
    assert (dense.logprobs - fallback.logprobs).abs().max() <= TOL
    assert torch.equal(fallback.logprobs, again.logprobs)
    assert len(calls) == 1  # after the first failure no compile is attempted again
    warnings = [r for r in caplog.records if "compiled FlexAttention failed" in r.getMessage()]
    assert len(warnings) == 1 and "NoValidChoicesError" in warnings[0].getMessage()


def test_plain_causal_packing_would_differ_so_the_comparison_has_power(make_model, scenarios, packed_tensors):
    """Packing the same row with a plain causal mask (subtree_end = N) is far off: the tests above can fail."""
    model = enable_tree_attention(make_model("llama"))
    seqs, prompts = scenarios("grpo", seed=1)
    tensors = packed_tensors(seqs, prompts)
    tree = packed_token_scores(model, tensors).logprobs
    causal = copy.copy(tensors)
    object.__setattr__(causal, "subtree_end", torch.full_like(tensors.subtree_end, tensors.num_tokens))
    assert (packed_token_scores(model, causal).logprobs - tree).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["qwen3_sliding", "gemma2"])
def test_a_plain_forward_of_a_tree_enabled_model_is_unchanged(make_model, family):
    reference_model = make_model(family)
    tree_model = enable_tree_attention(copy.deepcopy(reference_model))
    ids = torch.tensor([[5, 9, 2, 7, 7, 1, 3, 8], [0, 0, 4, 6, 1, 2, 9, 9]])
    attention_mask = torch.tensor([[1] * 8, [0, 0] + [1] * 6])  # left padding
    expected = reference_model(input_ids=ids, attention_mask=attention_mask).logits
    got = tree_model(input_ids=ids, attention_mask=attention_mask).logits
    assert (expected - got)[attention_mask.bool()].abs().max() <= TOL


def test_unsupported_layer_types_are_refused():
    from transformers import AutoModelForCausalLM, Lfm2Config

    config = Lfm2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention"],
    )
    with pytest.raises(ValueError, match="layer_types"):
        check_layer_types(config)
    with pytest.raises(ValueError, match=r"\['conv'\]"):
        enable_tree_attention(AutoModelForCausalLM.from_config(config))


def test_attention_sinks_are_refused():
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="sinks"):
        check_tree_attention_support(model)
    with pytest.raises(ValueError, match="sinks"):
        enable_tree_attention(model)


def test_scoring_needs_tree_attention(make_model):
    model = make_model("llama")
    with pytest.raises(ValueError, match="enable_tree_attention"):
        sequence_logprobs(model, [[1, 2, 3]], [1], packing="tree")


def test_prompt_length_must_leave_a_predicting_token(make_model):
    model = make_model("llama")
    with pytest.raises(ValueError, match="prompt_length"):
        sequence_logprobs(model, [[1, 2, 3]], [0], packing="none")
    assert sequence_logprobs(model, [[1, 2, 3]], [3], packing="none")[0].shape == (0,)


def test_tree_attention_refuses_a_mismatched_row(make_model):
    model = enable_tree_attention(make_model("llama"))
    tree = build_tree_attention(torch.tensor([3, 3, 3]), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="built for 3 tokens"):
        model.get_decoder()(
            input_ids=torch.tensor([[1, 2]]),
            position_ids=torch.tensor([[0, 1]]),
            attention_mask=tree.full_mask,
            use_cache=False,
            tree_attention=tree,
        )


def test_fsdp2_wrapped_tree_scorer_gives_the_same_scores_and_gradients(make_model, scenarios, packed_tensors, tmp_path):
    """FSDP2 applied from outside (decoder layers, then the TreeScorer as root), with activation checkpointing."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from rlasync.model import TreeScorer

    model = enable_tree_attention(make_model("qwen3"))
    reference = copy.deepcopy(model)
    row = packed_tensors(*scenarios("mixed", seed=4))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        scorer = TreeScorer(model)
        for layer in model.get_decoder().layers:
            fully_shard(layer)
        fully_shard(scorer)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        scorer.train()
        scores = packed_token_scores(scorer, row)
        _linear_functional([scores.logprobs]).backward()
        grads = {name: p.grad.full_tensor() for name, p in scorer.model.named_parameters()}
    finally:
        dist.destroy_process_group()
    expected = packed_token_scores(reference, row)
    _linear_functional([expected.logprobs]).backward()
    assert (scores.logprobs - expected.logprobs).abs().max() <= TOL
    for name, p in reference.named_parameters():
        assert (grads[name] - p.grad).abs().max() <= TOL, name


def decoder_layers_over(model, row, tree):
    """(a function running the decoder layers of `model` over `row` with `tree`, the embedded row it takes)."""
    decoder = model.get_decoder()
    hidden = decoder.embed_tokens(row.input_ids[None])
    rotary = decoder.rotary_emb(hidden, row.position_ids[None])

    def layers(hidden):
        for layer in decoder.layers:
            hidden = layer(hidden, attention_mask=tree.full_mask, position_embeddings=rotary, tree_attention=tree)
        return hidden

    return layers, hidden


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_a_decoder_layer_with_tree_attention_compiles_without_graph_breaks(make_model, packed_tensors, backend):
    model = enable_tree_attention(make_model("qwen3_sliding"))
    row = packed_tensors([[1, 2, 3, 4, 5], [1, 2, 3, 9]], [2, 2])
    tree = build_tree_attention(row.subtree_end, row.position_ids, backend, windows=(4,), block_size=16)
    layers, hidden = decoder_layers_over(model, row, tree)
    compiled = torch.compile(layers, backend="eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(hidden)
        if backend == "dense":
            assert torch.equal(out, layers(hidden))
    assert out.shape == hidden.shape


def _renormalised(logp, v, support, norm):
    outside = v < 0 or (support is not None and v not in support)
    return float("-inf") if outside else (logp[v] - norm).item()


def test_sampler_topk_and_sampling_masks_flow_from_samples_to_scores(make_model, scenarios):
    """PackedRow top-K ids and candidate sets reach the head: compare with the full logits of each sample."""
    import numpy as np

    from rlasync.model import packed_row_to_tensors
    from rlasync.packing import TreeRow, pack
    from rlasync.records import RolloutSample

    model = make_model("qwen3")
    tree_model = enable_tree_attention(copy.deepcopy(model))
    seqs, prompts = scenarios("grpo", seed=8)
    rng = np.random.default_rng(0)
    row, samples = TreeRow(), []
    for i, (seq, prompt) in enumerate(zip(seqs, prompts)):
        length = len(seq)
        topk = rng.integers(-1, 128, (length, 3))
        candidates = rng.integers(-1, 128, (length, 5))
        candidates[:, 0] = seq  # the sampled token is a candidate
        topk[:, 0] = candidates[:, 1]
        sample = RolloutSample(
            seq,
            [0] * prompt + [1] * (length - prompt),
            [0.0] * length,
            0.0,
            group_id=0,
            sampler_topk_ids=topk,
            sampler_topk_logprobs=np.zeros((length, 3)),
            sampling_mask=candidates if i % 2 else None,
        )
        row.add(sample)
        samples.append(sample)
    temperature = 0.8
    scores = packed_token_scores(tree_model, packed_row_to_tensors(pack(row)), temperature=temperature)
    expected_lp, expected_extra = [], []
    for sample, prompt in zip(samples, prompts):
        logits = model(input_ids=torch.as_tensor(sample.input_ids)[None]).logits[0].detach()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        for p in range(prompt, len(sample)):
            support = None
            if sample.sampling_mask is not None:
                support = sorted({int(c) for c in sample.sampling_mask[p] if c >= 0})
            norm = torch.logsumexp(logp[p - 1, support], 0) if support else torch.tensor(0.0)

            expected_lp.append(_renormalised(logp[p - 1], int(sample.input_ids[p]), support, norm))
            expected_extra.append(
                [_renormalised(logp[p - 1], int(v), support, norm) for v in sample.sampler_topk_ids[p]]
            )
    torch.testing.assert_close(scores.logprobs, torch.tensor(expected_lp), atol=TOL, rtol=0)
    torch.testing.assert_close(scores.extra_logprobs, torch.tensor(expected_extra), atol=TOL, rtol=0)


def test_load_model_gives_a_tree_ready_model(make_model, tmp_path):
    from rlasync.model import ATTENTION_NAME, TreeScorer, load_model

    make_model("llama").save_pretrained(tmp_path / "m")
    model = load_model(str(tmp_path / "m"), dtype="float32", device="cpu")
    assert model.config._attn_implementation == ATTENTION_NAME
    assert model.dtype == torch.float32
    TreeScorer(model)
    with pytest.raises(ValueError, match="tree attention"):
        TreeScorer(make_model("llama"))
