"""Loading a transformers causal LM ready for tree attention."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch

from rlasync.model.attention import (
    ATTENTION_NAME,
    check_layer_types,
    check_tree_attention_support,
    enable_tree_attention,
    register_tree_attention,
)
from rlasync.model.checkpointing import apply_checkpoint_plan, decoder_layers

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def model_init_options(
    model_init_kwargs: dict[str, Any] | None, dtype: str = "auto", trust_remote_code: bool = False
) -> tuple[str, dict[str, Any]]:
    """The learner's `(dtype, from_pretrained kwargs)` from the config: `model_init_kwargs` (TRL's; its `dtype` or
    `torch_dtype` wins over `dtype`; "auto" means float32 for training), `trust_remote_code`. The attention
    implementation is rlasync's own: one given there is dropped with a warning."""
    kwargs = dict(model_init_kwargs or {})
    chosen = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None) or dtype
    kwargs.pop("torch_dtype", None)
    if isinstance(chosen, torch.dtype):
        chosen = str(chosen).removeprefix("torch.")
    if chosen == "auto":
        chosen = "float32"
    if chosen not in DTYPES:
        raise ValueError(f"model_init_kwargs dtype={chosen!r}: use one of {sorted(DTYPES)} or 'auto'")
    if "attn_implementation" in kwargs:
        logger.warning(
            "model_init_kwargs attn_implementation=%r is ignored: the learner uses tree attention",
            kwargs.pop("attn_implementation"),
        )
    if trust_remote_code:
        kwargs.setdefault("trust_remote_code", True)
    return chosen, kwargs


def load_model(
    path_or_id: str,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    **from_pretrained_kwargs: Any,
) -> torch.nn.Module:
    """Load a causal LM with `attn_implementation="rlasync_tree"` on `device` (docs/algorithms.md §4.3 restrictions checked).

    The layer types are checked on the config before any weight is read; sinks after loading. Raises `ValueError`
    for an unsupported architecture. Extra keyword arguments go to `AutoModelForCausalLM.from_pretrained`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlasync.model.registry import resolve_model

    path_or_id = resolve_model(path_or_id)  # aliases such as "smollm2-135m-instruct" become a cached folder
    register_tree_attention()
    config_kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k in ("revision", "trust_remote_code")}
    check_layer_types(AutoConfig.from_pretrained(path_or_id, **config_kwargs))
    model = AutoModelForCausalLM.from_pretrained(
        path_or_id, dtype=resolve_dtype(dtype), attn_implementation=ATTENTION_NAME, **from_pretrained_kwargs
    )
    check_tree_attention_support(model)
    enable_tree_attention(model)  # a no-op when from_pretrained already set it; fails loudly otherwise
    return model.to(device)


def prepare_for_training(
    model: torch.nn.Module,
    *,
    gradient_checkpointing: bool = True,
    compile: bool | Literal["layers", "decoder"] = False,
    use_reentrant: bool = False,
    checkpoint_layers: Sequence[int] | None = None,
    compile_backend: str | None = None,
    compile_mode: str | None = None,
) -> torch.nn.Module:
    """Tree attention on, activation checkpointing per decoder layer, and (optionally) each decoder layer compiled.

    `checkpoint_layers`: the decoder layers to checkpoint (default: all of them; `rlasync.model.checkpointing`
    chooses them by memory). `compile=True` or "layers": regional compilation (`compile_decoder_layers`). Every
    decoder layer runs the same code, so one compiled graph serves all of them (compile time does not grow with
    depth); transformers >= 5.2x checkpoints a layer's `forward`, so the checkpoint is traced inside the compiled
    layer. Each layer call still pays Python and guard overhead: on an H200 a 3k-token row of a 0.6B model left the
    GPU idle half the time. "decoder": the whole decoder is one compiled graph with dynamic shapes (checkpointing
    traced inside it): minutes to compile once, then GPU-bound. Returns `model` (changed in place).
    """
    if not getattr(model, "supports_gradient_checkpointing", True) and gradient_checkpointing:
        raise ValueError(
            f"{type(model).__name__} does not support gradient checkpointing; pass gradient_checkpointing=False"
        )
    enable_tree_attention(model)
    if gradient_checkpointing:
        kwargs = {"use_reentrant": use_reentrant}  # gradient_checkpointing_kwargs' only supported key
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if hasattr(model, "config"):
            model.config.use_cache = False
        if checkpoint_layers is not None:
            apply_checkpoint_plan(model, checkpoint_layers)
    options = {"backend": compile_backend, "mode": compile_mode}
    if compile == "decoder":
        model.get_decoder().compile(dynamic=True, **_given(options))
    elif compile in (True, "layers"):
        compile_decoder_layers(model, backend=compile_backend, mode=compile_mode)
    elif compile is not False:
        raise ValueError(f"compile={compile!r}: use False, True / 'layers' (each decoder layer) or 'decoder'")
    return model


def compile_decoder_layers(model: torch.nn.Module, *, backend: str | None = None, mode: str | None = None) -> None:
    """Regional compilation: `layer.compile(dynamic=True)` on each decoder layer (the compiled call replaces the
    layer's own; `uncompile_decoder_layers` undoes it): one graph for every row length from the first call. Dynamo's
    default would compile the first length statically and compile again, dynamic, at the first other length (9 s of
    a cold start on an H100 for SmolLM2, at a run's 7th step); a graph per length is no faster (docs/algorithms.md
    §5.5). The modes that replay CUDA graphs ("reduce-overhead", "max-autotune") keep Dynamo's default: graphs want
    static row shapes."""
    from rlasync.config.trl_fields import COMPILE_MODES

    if mode not in COMPILE_MODES:
        raise ValueError(f"torch_compile_mode={mode!r}: use one of {[m for m in COMPILE_MODES if m]} or None")
    dynamic = None if mode in ("reduce-overhead", "max-autotune") else True
    for layer in decoder_layers(model):
        layer.compile(**_given({"backend": backend, "mode": mode, "dynamic": dynamic}))


def uncompile_decoder_layers(model: torch.nn.Module) -> int:
    """Back to eager decoder layers (after a compile failure); returns how many layers were compiled."""
    count = 0
    for layer in decoder_layers(model):
        if getattr(layer, "_compiled_call_impl", None) is not None:
            layer._compiled_call_impl = None
            count += 1
    return count


def compiled_layer_count(model: torch.nn.Module) -> int:
    return sum(getattr(layer, "_compiled_call_impl", None) is not None for layer in decoder_layers(model))


def _given(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if v is not None}
