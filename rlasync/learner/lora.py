"""LoRA for the learner (peft): wrap the loaded model with the run's `LoraConfig` (a fresh adapter, or the one of a
checkpoint being resumed), and save a checkpoint's adapter as `PeftModel.save_pretrained` writes it.

    peft_model = wrap_with_lora(model, peft_config, adapter_dir=resume_dir)   # model: tree attention on
    scorer = TreeScorer(peft_model.base_model.model)   # the HF model with LoRA layers injected in place

The TreeScorer holds the HF model itself (peft replaces its Linear modules in place), so the tree-packed forward,
the chunked head (it reads `get_output_embeddings().weight`, never adapted: `check_peft_config`) and FSDP2's
per-layer sharding see the same module tree as without LoRA; only the adapters require grad.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlasync.weights.adapter import adapter_base, is_adapter_checkpoint

if TYPE_CHECKING:
    from peft import PeftConfig


def wrap_with_lora(model: torch.nn.Module, peft_config: PeftConfig | None, adapter_dir: str | None = None) -> Any:
    """`model` with LoRA layers (a `PeftModel`): the adapter of `adapter_dir` (a checkpoint, trainable) when it holds
    one, else a fresh one from `peft_config`. Only adapter parameters require grad."""
    from peft import PeftModel, get_peft_model

    from rlasync.weights.adapter import check_peft_config, lora_layers

    check_peft_config(peft_config)
    if is_adapter_checkpoint(adapter_dir):
        peft_model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    else:
        peft_model = get_peft_model(model, peft_config)
    if not lora_layers(peft_model.base_model.model):
        raise ValueError(f"peft_config.target_modules={peft_config.target_modules!r} matched no layer of the model")
    return peft_model


def save_adapter(directory: Path, peft_model: Any, model_state: dict[str, torch.Tensor]) -> None:
    """Write the adapter (`adapter_config.json`, `adapter_model.safetensors`) from the gathered full state dict of the
    HF model (keys without the scorer's prefix); `PeftModel.from_pretrained(base, directory)` loads it."""
    state = {f"base_model.model.{key}": value for key, value in model_state.items() if ".lora_" in key}
    peft_model.save_pretrained(directory, state_dict=state)


def trainable_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


__all__ = ["adapter_base", "is_adapter_checkpoint", "save_adapter", "trainable_parameters", "wrap_with_lora"]
