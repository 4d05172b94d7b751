"""Activation checkpointing per layer by memory (rlasync.model.checkpointing): the pure planner, the per-token
estimate against the tensors autograd really saves, and the applied plan (same loss and gradients, fp32)."""

import copy

import pytest
import torch

from rlasync.model import enable_tree_attention, packed_token_scores, prepare_for_training
from rlasync.model.attention import build_tree_attention, register_tree_attention
from rlasync.model.checkpointing import (
    CheckpointPlan,
    activation_bytes_per_token,
    checkpointed_layers,
    compiled_activation_bytes_per_token,
    fsdp_unsharded_bytes,
    plan_checkpointing,
    plan_for_model,
    planner_bytes_per_token,
    replan_for_eager_layers,
    sharded_state_bytes,
    spread,
    training_state_bytes,
)

GIB = 2**30


# ---- the planner -------------------------------------------------------------------------------------------------


def test_everything_fits_checkpoints_nothing():
    plan = plan_checkpointing(28, 8192, 100_000, 2_000, available_bytes=100 * GIB)
    assert plan.layers == () and plan.fits and plan.estimate_bytes == 28 * 8192 * 100_000


def test_nothing_fits_checkpoints_every_layer_and_says_so():
    plan = plan_checkpointing(28, 8192, 100_000, 2_000, available_bytes=1 * GIB)
    assert plan.layers == tuple(range(28)) and not plan.fits
    assert "does not fit even with every layer checkpointed" in plan.describe()


@pytest.mark.parametrize("available_gib", [5, 10, 15, 20])
def test_a_partial_plan_is_the_fewest_layers_that_fit(available_gib):
    layers, tokens, full, saved = 28, 8192, 100_000, 2_000
    available = available_gib * GIB
    plan = plan_checkpointing(layers, tokens, full, saved, available)
    k = len(plan.layers)
    assert 0 < k < layers and plan.fits

    def estimate(count):  # the obvious reference: every layer's bytes, plus one recompute while any is checkpointed
        return sum(full * tokens if i >= count else saved * tokens for i in range(layers)) + full * tokens * (count > 0)

    assert estimate(k) <= available < estimate(k - 1)
    assert plan.estimate_bytes == int(estimate(k))


def test_fixed_bytes_per_layer_count_for_uncheckpointed_layers_only():
    without = plan_checkpointing(4, 100, 10.0, 1.0, available_bytes=4 * 1000 + 3 * 100 + 500)
    with_fixed = plan_checkpointing(4, 100, 10.0, 1.0, available_bytes=4 * 1000 + 3 * 100 + 500, layer_fixed_bytes=300)
    assert without.layers == () and len(with_fixed.layers) > 0


def test_a_training_state_larger_than_the_device_checkpoints_everything_and_does_not_fit():
    plan = plan_checkpointing(4, 100, 10.0, 1.0, available_bytes=-5 * GIB)
    assert plan.layers == (0, 1, 2, 3) and not plan.fits and "-5.0 GiB available" in plan.describe()
    assert CheckpointPlan(4, (0,), "count").fits


def test_checkpointing_that_saves_nothing_is_not_planned():
    assert plan_checkpointing(4, 100, 1.0, 1.0, available_bytes=0).layers == ()


def test_spread_is_even_and_exact():
    assert spread(0, 28) == () and spread(28, 28) == tuple(range(28)) and spread(40, 4) == (0, 1, 2, 3)
    assert spread(1, 28) == (14,) and spread(2, 28) == (7, 21) and spread(4, 28) == (3, 10, 17, 24)
    for count in range(29):
        layers = spread(count, 28)
        assert len(layers) == count and all(0 <= i < 28 for i in layers)
        gaps = [b - a for a, b in zip(layers, layers[1:])]
        assert not gaps or max(gaps) - min(gaps) <= 1


def test_the_plan_for_a_qwen3_06b_shape_on_an_h200_checkpoints_nothing_at_8k_rows():
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    )
    full, saved = activation_bytes_per_token(config, compute_bytes=2)
    state = 0.6e9 * (2 + 2 + 8)  # bf16 weights and grads, float32 Adam moments
    available = 141e9 * 0.85 - state
    assert 5 * GIB < 28 * 8192 * full < 30 * GIB  # the issue's ~10 GB, erring high
    assert plan_checkpointing(28, 8192, full, saved, available).layers == ()
    assert 0 < len(plan_checkpointing(28, 65536, full, saved, available).layers) < 28


# ---- the estimate against what autograd saves ----------------------------------------------------------------------


def _tiny(family, dtype=torch.float32, num_layers=2):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    register_tree_attention()
    cls = Qwen3Config if family == "qwen3" else LlamaConfig
    config = cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="rlasync_tree", dtype=dtype)
    return enable_tree_attention(model).train()


def _saved_bytes_per_token(model, tokens, autocast, compile_backend=None):
    """Bytes of the per-token tensors one decoder layer saves for backward (weights, their autocast copies and the
    dense [N, N] mask excluded: the mask is shared by every layer and is not built on a GPU)."""
    hidden = torch.randn(1, tokens, model.config.hidden_size, dtype=model.dtype, requires_grad=True)
    positions = torch.arange(tokens)[None]
    rotary = model.model.rotary_emb(hidden, positions)
    tree = build_tree_attention(torch.full((tokens,), tokens), positions[0], "dense", (), 128, False)
    seen = {}

    def pack(tensor):
        if tokens in tensor.shape and tensor.shape[-2:] != (tokens, tokens):
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    layer = model.model.layers[0]
    if compile_backend is not None:
        layer = torch.compile(layer, backend=compile_backend)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            layer(
                hidden,
                attention_mask=tree.full_mask,
                position_ids=positions,
                position_embeddings=rotary,
                tree_attention=tree,
            )
    return sum(seen.values()) / tokens


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("precision", ["float32", "bf16_autocast", "bfloat16"])
def test_the_estimate_errs_high_but_not_by_much(family, precision):
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    model = _tiny(family, dtype)
    measured = _saved_bytes_per_token(model, tokens=96, autocast=precision == "bf16_autocast")
    compute = 4 if precision == "float32" else 2
    full, saved = activation_bytes_per_token(model.config, compute, 2 if precision == "bfloat16" else 4)
    assert measured <= full <= 1.6 * measured
    assert saved == model.config.hidden_size * (2 if precision == "bfloat16" else 4)


@pytest.mark.parametrize(
    "family, precision",
    [("qwen3", "bfloat16"), ("qwen3", "bf16_autocast"), ("qwen3", "float32"), ("llama", "bfloat16")],
)
def test_a_compiled_layer_saves_what_the_compiled_estimate_counts(family, precision):
    """torch.compile'd layers (the learner's on a GPU) keep less than eager ones: the partition inductor uses
    (aot_eager_decomp_partition: the same min-cut partitioner without code generation) saves what
    `compiled_activation_bytes_per_token` counts for Qwen3, and less for Llama (no q/k norms: it errs high)."""
    import torch._dynamo

    torch._dynamo.reset()
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    model = _tiny(family, dtype)
    autocast = precision == "bf16_autocast"
    compiled = _saved_bytes_per_token(model, 96, autocast, compile_backend="aot_eager_decomp_partition")
    eager = _saved_bytes_per_token(model, 96, autocast)
    compute = 4 if precision == "float32" else 2
    full, saved = compiled_activation_bytes_per_token(model.config, compute, 2 if precision == "bfloat16" else 4)
    assert compiled < 0.8 * eager, "a compiled layer must recompute its elementwise ops instead of saving them"
    if family == "qwen3":
        assert full == pytest.approx(compiled, rel=0.03)
    else:
        assert compiled <= full <= 1.25 * compiled
    assert saved == model.config.hidden_size * (2 if precision == "bfloat16" else 4)


def test_the_training_state_shards_and_keeps_adam_moments_in_the_parameters_dtype():
    params = sum(p.numel() for p in _tiny("llama").parameters())
    assert sharded_state_bytes(_tiny("llama")) == params * 16  # float32: weights, grads, two moments
    assert sharded_state_bytes(_tiny("llama"), world_size=4) == params * 4
    bf16 = _tiny("llama", torch.bfloat16)
    assert sharded_state_bytes(bf16) == params * 8  # torch's AdamW moments are zeros_like(param): bf16 too
    head = training_state_bytes(bf16) - sharded_state_bytes(bf16, moment_bytes=4)
    assert head > 0 and sharded_state_bytes(bf16, moment_bytes=4) == params * 12  # the planner's reserve


@pytest.mark.parametrize("compiled", [False, True])
def test_planner_bytes_per_token_are_the_figures_of_the_layers_as_they_run(compiled):
    """One function for the plan and the dry run: compiled layers weigh what a compiled layer saves, eager ones the
    eager estimate; bf16 over float32 weights is autocast with one rank (float32 residual stream, bf16 weight copies
    saved) and FSDP2's all-bf16 policy with several; without mixed precision everything is in the weights' dtype."""
    per_token = compiled_activation_bytes_per_token if compiled else activation_bytes_per_token
    model = _tiny("qwen3")
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    figures = planner_bytes_per_token
    assert figures(model, compiled=compiled) == (*per_token(model.config, 4, 4), 0.0)  # float32
    assert figures(model, world_size=4, compiled=compiled) == (*per_token(model.config, 4, 4), 0.0)  # no policy
    assert figures(model, mixed=True, compiled=compiled) == (*per_token(model.config, 2, 4), 2.0 * layer)  # autocast
    for world_size in (2, 8):  # FSDP2's MixedPrecisionPolicy: the whole layer in bf16, nothing fixed
        assert figures(model, mixed=True, world_size=world_size, compiled=compiled) == (
            *per_token(model.config, 2, 2),
            0.0,
        )
    bf16 = _tiny("qwen3", torch.bfloat16)
    assert figures(bf16, compiled=compiled) == (*per_token(bf16.config, 2, 2), 0.0)
    # the fix this pins: several ranks under the bf16 policy were sized as float32 eager layers (over 3x too much)
    fsdp_full = figures(model, mixed=True, world_size=2, compiled=compiled)[0]
    assert fsdp_full * 1.9 < activation_bytes_per_token(model.config, 4, 4)[0]


def test_layers_that_fall_back_to_eager_are_planned_again_on_the_same_budget():
    """A plan made for compiled layers is too small for eager ones (the learner's fallback when compiling fails)."""
    model = _tiny("qwen3", num_layers=4)
    full, saved, fixed = planner_bytes_per_token(model, compiled=True)
    compiled = plan_checkpointing(4, 512, full, saved, available_bytes=4 * 512 * full, layer_fixed_bytes=fixed)
    assert compiled.layers == () and compiled.fits
    eager = replan_for_eager_layers(model, compiled, mixed=False, world_size=1)
    assert len(eager.layers) > 0 and eager.fits and eager.available_bytes == compiled.available_bytes
    assert eager.tokens == 512 and eager.reason == "memory"
    chosen = CheckpointPlan(4, (1,), "count")
    assert replan_for_eager_layers(model, chosen, mixed=False, world_size=1) is chosen  # the user's choice stands


def test_training_state_counts_weights_grads_adam_fsdp_gathers_row_inputs_and_head_buffers():
    model = _tiny("llama")
    params = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    head = training_state_bytes(model) - params * 16
    assert head > 0
    root = params - 2 * layer  # embedding, head, final norm
    gathered = (root + 2 * layer) * 4  # the root and two layers, float32 (no policy)
    assert fsdp_unsharded_bytes(model, world_size=2, compute_bytes=4) == gathered
    assert fsdp_unsharded_bytes(model, world_size=1, compute_bytes=4) == 0
    assert training_state_bytes(model, world_size=2) == params * 8 + gathered + head
    assert training_state_bytes(model, world_size=2, mixed=True) == params * 8 + gathered // 2 + head  # bf16 gathers
    # a row's final-norm and head inputs: float32 residual + bf16 head input under autocast, bf16 + bf16 under FSDP2
    assert training_state_bytes(model, mixed=True, tokens=100) - training_state_bytes(model, mixed=True) == 100 * 64 * 6
    extra = training_state_bytes(model, world_size=2, mixed=True, tokens=100) - (params * 8 + gathered // 2 + head)
    assert extra == 100 * 64 * 4


# ---- the plan for a model, and applied --------------------------------------------------------------------------


def test_plan_for_model_choices():
    model = _tiny("llama")
    cpu = torch.device("cpu")
    assert plan_for_model(model, "auto", device=cpu, tokens=512).layers == (0, 1)  # CPU: every layer
    assert plan_for_model(model, "all", device=cpu, tokens=512).layers == (0, 1)
    assert plan_for_model(model, 1, device=cpu, tokens=512).layers == (1,)
    assert plan_for_model(model, 0, device=cpu, tokens=512).layers == ()
    assert plan_for_model(model, "all", device=cpu, tokens=512, enabled=False) == CheckpointPlan(2, (), "disabled")
    with pytest.raises(ValueError, match=r"gradient_checkpointing_layers=3: the model has 2 decoder layers"):
        plan_for_model(model, 3, device=cpu, tokens=512)
    with pytest.raises(ValueError, match=r"gradient_checkpointing_layers='most'"):
        plan_for_model(model, "most", device=cpu, tokens=512)


def _scores_and_grads(model, row):
    model.zero_grad(set_to_none=True)
    scores = packed_token_scores(model, row, backend="dense")
    weights = torch.randn(scores.logprobs.shape, generator=torch.Generator().manual_seed(3))
    (weights * scores.logprobs).sum().backward()
    return scores.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_any_plan_gives_the_same_logprobs_and_gradients(family, make_model, packed_tensors, scenarios):
    base = make_model(family)
    seqs, prompts = scenarios("mixed")
    row = packed_tensors(seqs, prompts)
    results, recomputes = {}, {}
    for name, layers in {"none": (), "first": (0,), "second": (1,), "all": (0, 1)}.items():
        model = prepare_for_training(copy.deepcopy(base), checkpoint_layers=layers).train()
        assert checkpointed_layers(model) == layers
        calls = [0, 0]
        for i, layer in enumerate(model.model.layers):
            layer.mlp.register_forward_pre_hook(lambda *_, i=i, calls=calls: calls.__setitem__(i, calls[i] + 1))
        results[name] = _scores_and_grads(model, row)
        recomputes[name] = tuple(i for i in range(2) if calls[i] == 2)  # a checkpointed layer runs forward twice
    assert recomputes == {"none": (), "first": (0,), "second": (1,), "all": (0, 1)}
    ref_logprobs, ref_grads = results["none"]
    for name, (logprobs, grads) in results.items():
        assert (logprobs - ref_logprobs).abs().max().item() <= 1e-6, name
        assert grads.keys() == ref_grads.keys()
        assert max((grads[n] - ref_grads[n]).abs().max().item() for n in grads) <= 1e-5, name


def test_compiled_layers_with_a_partial_plan_and_padded_rows_match_eager(make_model, packed_tensors, scenarios):
    """Regional compilation (aot_eager: Dynamo and AOTAutograd, no Inductor, fast on CPU) over layers of which only
    some are checkpointed, on rows padded to two lengths: the same log-probs and gradients, a bounded graph count."""
    from rlasync.model.loading import compiled_layer_count, uncompile_decoder_layers
    from rlasync.model.row_shapes import pad_row_tensors, padded_length

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    base = make_model("qwen3")
    rows = [packed_tensors(*scenarios("mixed", seed)) for seed in (0, 1)]
    rows = [pad_row_tensors(row, padded_length(row.num_tokens, 32)) for row in rows]
    eager = prepare_for_training(copy.deepcopy(base), checkpoint_layers=(1,)).train()
    compiled = prepare_for_training(
        copy.deepcopy(base), checkpoint_layers=(1,), compile="layers", compile_backend="aot_eager"
    ).train()
    assert compiled_layer_count(compiled) == 2
    for row in rows:
        expected, got = _scores_and_grads(eager, row), _scores_and_grads(compiled, row)
        assert (expected[0] - got[0]).abs().max().item() <= 1e-6
        assert max((expected[1][n] - got[1][n]).abs().max().item() for n in expected[1]) <= 1e-5
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4  # 2 checkpointing variants x 2 shapes at most
    assert uncompile_decoder_layers(compiled) == 2 and compiled_layer_count(compiled) == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("mixed", [False, True])
def test_auto_on_a_gpu_plans_by_the_memory_it_reports(monkeypatch, mixed):
    """The CUDA branch of "auto" with the device's memory faked: a roomy device checkpoints nothing, a tight one
    some layers, one already full of another process' memory every layer."""
    model = _tiny("llama", num_layers=6)
    cuda = torch.device("cuda")
    state = training_state_bytes(model, mixed=mixed, tokens=512)
    full, saved = activation_bytes_per_token(model.config, 2 if mixed else 4, 4)
    fixed = 2 * sum(p.numel() for p in model.model.layers[0].parameters()) if mixed else 0
    one_layer = 512 * full + fixed

    def fake(free, total, gpu_share=1.0):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
        return plan_for_model(model, "auto", device=cuda, tokens=512, mixed=mixed, gpu_share=gpu_share)

    roomy = fake(free=100 * GIB, total=100 * GIB)
    assert roomy.layers == () and roomy.fits and roomy.reason == "memory"
    tight_total = (state + 4.5 * one_layer) / 0.85  # room for 4.5 of 6 layers' activations: 3 checkpointed
    tight = fake(free=tight_total, total=tight_total)
    assert tight.layers == (1, 3, 5) and tight.fits
    shared = fake(free=state, total=100 * GIB)  # a colocated process holds the rest
    assert shared.layers == tuple(range(6)) and not shared.fits
    # a learner given half the GPU (an engine will take the rest later) plans within half of it
    assert fake(free=2 * tight_total, total=2 * tight_total, gpu_share=0.5).layers == (1, 3, 5)
    assert fake(free=2 * tight_total, total=2 * tight_total).layers == ()
    with pytest.raises(ValueError, match="gpu_share"):
        fake(free=tight_total, total=tight_total, gpu_share=0.0)
    assert plan_for_model(model, "auto", device=cuda, tokens=0).reason == "no token_budget"
