"""In-place weight loading by Hugging Face parameter names (the engine side of a weight sync)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def load_named_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, Any]]) -> int:
    """Copy each `(name, tensor)` into the model's parameter of that name, in place; returns how many were copied.

    Names are the model's own (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, ...). Tied parameters
    answer to every name they have, so `lm_head.weight` and `model.embed_tokens.weight` both load a tied embedding.
    Values may be tensors on any device and in any dtype, or numpy arrays; they are converted on copy. Everything is
    checked before anything is copied: an unknown name or a shape mismatch raises `ValueError` naming it, and the
    model is left untouched.
    """
    targets = dict(model.named_parameters(remove_duplicate=False))
    items = [(name, torch.as_tensor(value)) for name, value in named_tensors]
    unknown = [name for name, _ in items if name not in targets]
    if unknown:
        shown = ", ".join(unknown[:5]) + (f", ... ({len(unknown)} in all)" if len(unknown) > 5 else "")
        raise ValueError(f"load_weights: the model has no parameter named {shown}")
    mismatched = [
        f"{name} {tuple(value.shape)} (model: {tuple(targets[name].shape)})"
        for name, value in items
        if value.shape != targets[name].shape
    ]
    if mismatched:
        raise ValueError(f"load_weights: shape mismatch for {', '.join(mismatched[:5])}")
    with torch.no_grad():
        for name, value in items:
            targets[name].copy_(value)
    return len(items)
