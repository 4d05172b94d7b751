"""Engine-side weight loading: by HF names, in place, streamed, tied embeddings by either name, errors that name."""

import numpy as np
import pytest
import torch

from rlasync.engine.weights import check_weight_manifest, load_named_weights


def tiny(tied):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    return AutoModelForCausalLM.from_config(config)


def test_loads_in_place_from_a_stream_holding_one_tensor_at_a_time():
    model = tiny(tied=False)
    ids_before = {name: id(p) for name, p in model.named_parameters()}
    taken = []

    def stream():
        for name, param in model.named_parameters():
            taken.append(name)
            yield name, torch.full(param.shape, 0.5, dtype=torch.float64)  # converted to the model's dtype

    assert load_named_weights(model, stream()) == len(ids_before)
    assert all(torch.all(p == 0.5) and id(p) == ids_before[name] for name, p in model.named_parameters())
    assert taken == list(ids_before)


def test_a_tied_embedding_loads_by_either_name_and_numpy_is_accepted():
    model = tiny(tied=True)
    value = np.ones(tuple(model.lm_head.weight.shape), dtype=np.float32)
    load_named_weights(model, [("lm_head.weight", value)])
    assert torch.all(model.model.embed_tokens.weight == 1)
    load_named_weights(model, [("model.embed_tokens.weight", 2 * value)])
    assert torch.all(model.lm_head.weight == 2)


def test_unknown_names_and_shape_mismatches_are_named_and_the_rest_still_loads():
    model = tiny(tied=False)
    norm = model.model.norm.weight
    with pytest.raises(ValueError, match=r"no parameter named model\.bogus.*shape mismatch for lm_head\.weight"):
        load_named_weights(
            model,
            [("model.bogus", torch.zeros(1)), ("lm_head.weight", torch.zeros(3)), ("model.norm.weight", norm * 0 + 3)],
        )
    assert torch.all(model.model.norm.weight == 3)


def test_manifest_check():
    model = tiny(tied=True)
    check_weight_manifest(model, [(name, tuple(p.shape)) for name, p in model.named_parameters()])
    check_weight_manifest(model, [("lm_head.weight", tuple(model.lm_head.weight.shape))])
    with pytest.raises(ValueError, match="model.nope"):
        check_weight_manifest(model, [("model.nope", (1,))])
    with pytest.raises(ValueError, match="shape mismatch"):
        check_weight_manifest(model, [("model.norm.weight", (3,))])
