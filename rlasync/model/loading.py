"""Loading a transformers causal LM ready for tree attention."""

from __future__ import annotations

from typing import Any

import torch

from rlasync.model.attention import (
    ATTENTION_NAME,
    check_layer_types,
    check_tree_attention_support,
    enable_tree_attention,
    register_tree_attention,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    path_or_id: str,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    **from_pretrained_kwargs: Any,
) -> torch.nn.Module:
    """Load a causal LM with `attn_implementation="rlasync_tree"` on `device` (SPEC §4.3 restrictions checked).

    The layer types are checked on the config before any weight is read; sinks after loading. Raises `ValueError`
    for an unsupported architecture. Extra keyword arguments go to `AutoModelForCausalLM.from_pretrained`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    register_tree_attention()
    config_kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k in ("revision", "trust_remote_code")}
    check_layer_types(AutoConfig.from_pretrained(path_or_id, **config_kwargs))
    model = AutoModelForCausalLM.from_pretrained(
        path_or_id, dtype=resolve_dtype(dtype), attn_implementation=ATTENTION_NAME, **from_pretrained_kwargs
    )
    check_tree_attention_support(model)
    enable_tree_attention(model)  # a no-op when from_pretrained already set it; fails loudly otherwise
    return model.to(device)
