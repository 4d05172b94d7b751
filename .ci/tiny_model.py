"""Write a tiny random Llama (2 layers, vocabulary ~50 words) with a chat template to the folder given: the model
the notebook runs with in CI (`NOTEBOOK_MODEL`). Same shape as tests/integration/conftest.py's."""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

WORDS = [str(d) for d in range(10)] + "What is + - * / ? . Answer with just the number user assistant system".split()
WORDS += [f"w{i}" for i in range(20)]


def main(folder: str) -> None:
    path = Path(folder)
    specials = ["<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + WORDS)}
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
    (path / "vocab_words.json").write_text(json.dumps(WORDS))
    print(path)


if __name__ == "__main__":
    main(sys.argv[1])
