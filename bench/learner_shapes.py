"""What the learner benches share: the benched model's config, the GRPO sample shapes, their rows and their FLOPs.

bench/tree_packing.py (ours), bench/trl_tree_anchor.py (TRL's tree packing on the same samples) and the kernel probes
(bench/flex_tiles.py, bench/attention_parts.py, bench/learner_parts.py) build the same samples, rows and MFU from here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlasync.packing import TokenBudgetBatcher  # noqa: E402
from rlasync.rollout import RolloutSample  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16 datasheet figure


@dataclass(frozen=True)
class Shape:
    prompt: int
    completion: int
    group: int
    row_tokens: int

    @property
    def name(self) -> str:
        return f"p{self.prompt}_c{self.completion}_g{self.group}_row{self.row_tokens}"


def qwen3_06b_config(num_layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=1024,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    )


def model_config(layers: int, tiny: bool = False):
    """The benched model's config (TRL's anchor builds the same): Qwen3-0.6B, or with `tiny` 2 layers, vocab 4096."""
    config = qwen3_06b_config(layers)
    if tiny:
        config.vocab_size, config.num_hidden_layers = 4096, 2
    return config


def parse_shapes(text: str) -> list[Shape]:
    """`PxCxG@ROW[,...]`: prompt, completion, group size, row token budget."""
    shapes = []
    for item in text.split(","):
        try:
            dims, row = item.split("@")
            p, c, g = (int(x) for x in dims.split("x"))
            shapes.append(Shape(p, c, g, int(row)))
        except ValueError:
            raise SystemExit(
                f"--shapes: {item!r} is not PROMPTxCOMPLETIONxGROUP@ROW_TOKENS (e.g. 1088x256x8@4096)"
            ) from None
    return shapes


def make_samples(shape: Shape, num_groups: int, vocab: int, seed: int, shared_prefix: int = 0) -> list[RolloutSample]:
    """`num_groups` GRPO groups of random tokens: one prompt, `shape.group` completions. `shared_prefix` K > 0: a
    group's completions open with the same K tokens (as a reasoning model's "<think>" does), so its trie branches
    K tokens later and each branch is `completion - K + 1` tokens (K = 0: `completion + 1`, the prompt's last token
    forwarded once per completion because it predicts a different first token)."""
    if not 0 <= shared_prefix < shape.completion:
        raise ValueError(f"shared_prefix={shared_prefix}: use 0 <= K < the completion length {shape.completion}")
    rng = np.random.default_rng(seed)
    samples = []
    for group in range(num_groups):
        prompt = rng.integers(0, vocab, shape.prompt)
        opening = rng.integers(0, vocab, shared_prefix)
        for _ in range(shape.group):
            completion = rng.integers(0, vocab, shape.completion)
            completion[:shared_prefix] = opening
            ids = np.concatenate([prompt, completion])
            mask = np.concatenate([np.zeros(shape.prompt, np.int8), np.ones(shape.completion, np.int8)])
            lps = np.where(mask == 1, -rng.random(len(ids)), 0.0).astype(np.float32)
            samples.append(RolloutSample(ids, mask, lps, advantage=float(rng.normal()), group_id=group))
    return samples


def plan_rows(samples, row_tokens: int, share: bool):
    batcher = TokenBudgetBatcher(num_ranks=1, token_budget=row_tokens, share_prefixes=share)
    batches = batcher.plan(samples)
    return [batch.rows[0] for batch in batches]


def flops_of(row, config) -> float:
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    layer_params = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * inter
    dense = 6 * layer_params * layers * row.num_tokens
    head = 6 * h * config.vocab_size * row.trained
    attention = 12 * q_dim * row.load * layers  # QK^T and PV, fwd (x1) + bwd (x2), per attended pair
    return float(dense + head + attention)
