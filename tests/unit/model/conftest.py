"""Tiny random causal LMs and random tries of sequences for the model tests (CPU, float32)."""

import numpy as np
import pytest
import torch

TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.3,  # large weights: attention patterns matter, so a mask error shows up in log-probs
    tie_word_embeddings=False,
)


def tiny_config(family: str):
    """A tiny config of `family`; `*_sliding` variants put a window of 4 on layer 0."""
    from transformers import Gemma2Config, LlamaConfig, Qwen2Config, Qwen3Config

    sliding = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    if family == "llama":
        return LlamaConfig(**TINY)
    if family == "qwen2":
        return Qwen2Config(**TINY)
    if family == "qwen3":
        return Qwen3Config(**TINY, head_dim=8)
    if family == "qwen3_sliding":
        return Qwen3Config(**TINY, head_dim=8, use_sliding_window=True, **sliding)
    if family == "gemma2":  # sliding window + attention and final-logit softcaps + tied embeddings
        config = {**TINY, "tie_word_embeddings": True}
        return Gemma2Config(**config, head_dim=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **sliding)
    raise ValueError(family)


def reference_attention(family: str) -> str:
    return "eager" if family == "gemma2" else "sdpa"  # sdpa cannot softcap attention scores


@pytest.fixture
def make_model():
    def make(family: str, seed: int = 0):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        config = tiny_config(family)
        return AutoModelForCausalLM.from_config(config, attn_implementation=reference_attention(family)).eval()

    return make


def _tokens(rng, n):
    return rng.integers(0, 128, n).tolist()


def scenario(name: str, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(sequences, prompt lengths) of a random trie shape."""
    rng = np.random.default_rng(seed)
    seqs, prompts = [], []
    if name in ("grpo", "mixed"):  # groups sharing a prompt
        for _ in range(2):
            prompt = _tokens(rng, int(rng.integers(4, 10)))
            for _ in range(int(rng.integers(2, 5))):
                seqs.append(prompt + _tokens(rng, int(rng.integers(1, 7))))
                prompts.append(len(prompt))
    if name in ("chain", "mixed"):  # multi-turn: each turn extends the previous sample
        turn = _tokens(rng, 5) + _tokens(rng, 4)
        seqs.append(turn), prompts.append(5)
        for _ in range(2):
            context = turn + _tokens(rng, 3)
            turn = context + _tokens(rng, int(rng.integers(1, 5)))
            seqs.append(turn), prompts.append(len(context))
    if name in ("disjoint", "mixed"):  # nothing shared
        for _ in range(3):
            length = int(rng.integers(2, 12))
            seqs.append(_tokens(rng, length)), prompts.append(int(rng.integers(1, length)))
    if name in ("ragged", "mixed"):  # duplicates, one-token completions, a whole-sequence completion
        base = _tokens(rng, 6)
        seqs += [base + [3], base + [3], base[:2], _tokens(rng, 7)]
        prompts += [6, 6, 1, 1]
    return seqs, prompts


@pytest.fixture
def scenarios():
    return scenario


@pytest.fixture
def packed_tensors():
    """(sequences, prompt lengths) -> PackedRowTensors of one tree-packed row (completion tokens trained)."""

    def make(seqs, prompts):
        from rlasync.model import packed_row_to_tensors
        from rlasync.packing import TreeRow, pack
        from rlasync.records import RolloutSample

        row = TreeRow()
        for seq, prompt in zip(seqs, prompts):
            mask = [0] * prompt + [1] * (len(seq) - prompt)
            row.add(RolloutSample(seq, mask, [0.0] * len(seq), advantage=0.0, group_id=0))
        return packed_row_to_tensors(pack(row))

    return make
