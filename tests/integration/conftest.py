"""Integration fixtures: one Ray local cluster for the session, a tiny random Llama with a tiny tokenizer, and the
by-value pickling of a test module for the actors (the tiny runs' shared pieces are in tiny_runs.py)."""

import json
import os

import pytest

VOCAB_WORDS = (
    [str(d) for d in range(10)]
    + "What is + - * / ? . Answer with just the number user assistant system".split()
    + [f"w{i}" for i in range(20)]
)


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def pickle_by_value(ray_cluster, request):
    """Ship the requesting test module's functions and classes, and tiny_runs.py's, to the actors by value; a module
    asks for it with `pytestmark = [..., pytest.mark.usefixtures("pickle_by_value")]`."""
    from tests.integration.tiny_runs import pickle_by_value

    pickle_by_value(request.module)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama (vocab ~50) saved with a WordLevel tokenizer that has a chat template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny_llama")
    specials = ["<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + VOCAB_WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", chat_template=template
    )
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=vocab["<eos>"],
        pad_token_id=vocab["<pad>"],
        bos_token_id=None,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    (path / "vocab_words.json").write_text(json.dumps(VOCAB_WORDS))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return str(path)
