"""Model side of training: tree attention for transformers causal LMs, the chunked LM head, packed-row scoring.

attention  tree attention (FlexAttention BlockMask on CUDA, dense bool mask + SDPA elsewhere), registered with
           transformers as attn_implementation="rlasync_tree"; architecture checks (docs/algorithms.md §4.3, §11)
tree_mask  the tree rule, a row's dense masks and `TreeAttention`; block_mask: its FlexAttention BlockMasks
segment_attention  the varlen backend: a row as root-path segments for FlashAttention varlen (planned on the host)
devices    non-blocking host-to-device copies of a row's arrays
head       chunked LM head: log-probs, entropy, top-K and candidate-set renormalisation without [M, V] logits
forward    PackedRow -> tensors -> TokenScores; TreeScorer (the FSDP2 root); sequence_logprobs
loading    load_model
check      `rlasync check-model`: tree-packed vs unpacked log-probs and gradients on random tries

Names are imported on first use (PEP 562), so `rlasync.model.registry` (model aliases, read by the checks that run
before anything heavy) does not import torch; importing `rlasync.model.attention` registers the tree attention
with transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ATTENTION_NAME": "attention",
    "TreeAttention": "attention",
    "build_tree_attention": "attention",
    "check_tree_attention_support": "attention",
    "dense_tree_mask": "attention",
    "enable_tree_attention": "attention",
    "register_tree_attention": "attention",
    "tree_block_mask": "attention",
    "PackedRowTensors": "forward",
    "TreeScorer": "forward",
    "packed_row_to_tensors": "forward",
    "packed_token_scores": "forward",
    "sequence_logprobs": "forward",
    "LogitTransform": "head",
    "TokenScores": "head",
    "chunked_token_scores": "head",
    "decoder_layers": "checkpointing",
    "load_model": "loading",
    "prepare_for_training": "loading",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'rlasync.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rlasync.model.{module}"), name)
    globals()[name] = value
    return value
