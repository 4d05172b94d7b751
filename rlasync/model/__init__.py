"""Model side of training: tree attention for transformers causal LMs, the chunked LM head, packed-row scoring.

attention  tree attention (FlexAttention BlockMask on CUDA, dense bool mask + SDPA elsewhere), registered with
           transformers as attn_implementation="rlasync_tree"; architecture checks (docs/algorithms.md §4.3, §11)
tree_mask  the tree rule, a row's dense masks and `TreeAttention`; block_mask: its FlexAttention BlockMasks
head       chunked LM head: log-probs, entropy, top-K and candidate-set renormalisation without [M, V] logits
forward    PackedRow -> tensors -> TokenScores; TreeScorer (the FSDP2 root); sequence_logprobs
loading    load_model
check      `rlasync check-model`: tree-packed vs unpacked log-probs and gradients on random tries
"""

from rlasync.model.attention import (
    ATTENTION_NAME,
    TreeAttention,
    build_tree_attention,
    check_tree_attention_support,
    dense_tree_mask,
    enable_tree_attention,
    register_tree_attention,
    tree_block_mask,
)
from rlasync.model.forward import (
    PackedRowTensors,
    TreeScorer,
    packed_row_to_tensors,
    packed_token_scores,
    sequence_logprobs,
)
from rlasync.model.head import LogitTransform, TokenScores, chunked_token_scores
from rlasync.model.loading import decoder_layers, load_model, prepare_for_training

register_tree_attention()

__all__ = [
    "ATTENTION_NAME",
    "LogitTransform",
    "PackedRowTensors",
    "TokenScores",
    "TreeAttention",
    "TreeScorer",
    "build_tree_attention",
    "check_tree_attention_support",
    "chunked_token_scores",
    "dense_tree_mask",
    "enable_tree_attention",
    "decoder_layers",
    "load_model",
    "prepare_for_training",
    "packed_row_to_tensors",
    "packed_token_scores",
    "register_tree_attention",
    "sequence_logprobs",
    "tree_block_mask",
]
