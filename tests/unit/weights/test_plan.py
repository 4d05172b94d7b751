import pytest
import torch

from rlasync.weights import (
    ManifestEntry,
    bucket_manifest,
    build_manifest,
    most_common_dtype,
    stream_parameters,
    transfer_name,
)


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize(
    ("learner", "engine"),
    [
        ("module.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("model.layers.1._checkpoint_wrapped_module.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
            "model.layers.0.self_attn.q_proj.weight",
        ),
        ("base_model.model.score.modules_to_save.default.weight", "score.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_transfer_name_strips_wrappers(learner, engine):
    assert transfer_name(learner) == engine


def test_manifest_equals_the_stream_and_matches_engine_names():
    model = tiny_model()
    manifest = build_manifest(model)
    streamed = list(stream_parameters(model))
    assert [e.name for e in manifest] == [name for name, _ in streamed]
    assert [e.shape for e in manifest] == [tuple(t.shape) for _, t in streamed]
    engine_names = dict(tiny_model().named_parameters(remove_duplicate=False))
    assert all(e.name in engine_names for e in manifest)
    assert len({e.name for e in manifest}) == len(manifest)  # the tied embedding is sent once


def test_frozen_parameters_are_not_sent_unless_peft():
    model = tiny_model()
    model.model.embed_tokens.weight.requires_grad_(False)
    names = [e.name for e in build_manifest(model)]
    assert "model.embed_tokens.weight" not in names
    peft_names = [e.name for e in build_manifest(model, is_peft=True)]
    assert "model.embed_tokens.weight" in peft_names


def test_sending_into_a_fresh_model_reproduces_the_weights():
    source, target = tiny_model(), tiny_model()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    from rlasync.engine.weights import load_named_weights

    load_named_weights(target, stream_parameters(source))
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters()):
        assert torch.equal(a, b), name


def test_buckets_bound_bytes_and_keep_order():
    manifest = [ManifestEntry(f"p{i}", "float32", (n,)) for i, n in enumerate([10, 10, 15, 5, 100])]
    buckets = bucket_manifest(manifest, bucket_bytes=80)
    assert [[e.name for e in b] for b in buckets] == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    assert [e for b in buckets for e in b] == manifest
    assert most_common_dtype(manifest) == "float32" and most_common_dtype([]) is None
    with pytest.raises(ValueError):
        bucket_manifest(manifest, 0)


def test_colliding_names_are_refused():
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)
            self.register_parameter("weight", torch.nn.Parameter(torch.zeros(2, 2)))

    with pytest.raises(ValueError, match="map to the engine name"):
        build_manifest(Wrapper())


def test_float_weights_travel_in_the_engine_dtype():
    """float32 master weights sent as bf16 (half the bytes); the manifest says so, the stream matches it."""
    model = tiny_model()
    manifest = build_manifest(model, dtype=torch.bfloat16)
    assert {entry.dtype for entry in manifest} == {"bfloat16"}
    streamed = list(stream_parameters(model, dtype=torch.bfloat16))
    assert [name for name, _ in streamed] == [entry.name for entry in manifest]
    params = dict(model.named_parameters())
    for name, tensor in streamed:
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, params[name].detach().to(torch.bfloat16))
    assert sum(e.num_bytes for e in manifest) * 2 == sum(e.num_bytes for e in build_manifest(model))
