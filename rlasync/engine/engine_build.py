"""How a `TorchEngine` is put together: its model on the device (a LoRA checkpoint's base), its dtype, EOS ids, the
paged attention layout and the KV pool sized from the memory it may take."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlasync.engine.kv_cache import DEFAULT_CPU_KV_CACHE_BYTES, kv_bytes_per_token, kv_shape, num_blocks_for
from rlasync.engine.kv_cache import kv_cache_tokens as kv_budget_tokens
from rlasync.engine.paged_attention import ATTENTION_NAME, KVPool, choose_layout, register_paged_attention
from rlasync.weights.adapter import adapter_base


def build_model(model: str | torch.nn.Module, dtype: str | torch.dtype | None, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    register_paged_attention()
    if isinstance(model, str):
        model = adapter_base(model)  # a LoRA checkpoint: the engine holds the base, adapters arrive by sync
        torch_dtype = resolve_dtype(dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype, attn_implementation=ATTENTION_NAME)
    elif dtype is not None:
        model = model.to(resolve_dtype(dtype))
    return model.to(device).eval().requires_grad_(False)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(names)}")
    return names[dtype]


def eos_ids(model: Any, eos_token_ids: Sequence[int] | int | None) -> frozenset[int]:
    if eos_token_ids is None:
        generation_config = getattr(model, "generation_config", None)
        eos_token_ids = getattr(generation_config, "eos_token_id", None)
        if eos_token_ids is None:
            eos_token_ids = getattr(model.config, "eos_token_id", None)
    if eos_token_ids is None:
        return frozenset()
    if isinstance(eos_token_ids, int):
        return frozenset({eos_token_ids})
    return frozenset(int(token) for token in eos_token_ids)


def choose_engine_layout(model: Any, device: torch.device, backend: str, block_size: int | None) -> tuple[str, int]:
    _, num_heads, num_kv_heads, head_dim = kv_shape(model.config)
    dtype = next(model.parameters()).dtype
    return choose_layout(backend, block_size, device, dtype, num_heads, num_kv_heads, head_dim)


def build_pool(
    model: Any,
    device: torch.device,
    block_size: int,
    max_model_len: int,
    kv_cache_tokens: int | None,
    gpu_memory_utilization: float,
    max_num_seqs: int,
) -> KVPool:
    num_layers, _, num_kv_heads, head_dim = kv_shape(model.config)
    dtype = next(model.parameters()).dtype
    bytes_per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype.itemsize)
    budget = DEFAULT_CPU_KV_CACHE_BYTES
    if kv_cache_tokens is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(gpu_memory_utilization * total) - (total - free)
    tokens = kv_budget_tokens(
        kv_cache_tokens,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        bytes_per_token=bytes_per_token,
        budget_bytes=budget,
    )
    num_blocks = num_blocks_for(tokens, block_size)
    return KVPool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
