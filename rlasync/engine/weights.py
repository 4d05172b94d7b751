"""In-place weight loading by Hugging Face parameter names (the engine side of a weight sync)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def load_named_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, Any]]) -> int:
    """Copy each `(name, tensor)` into the model's parameter of that name, in place; returns how many were copied.

    Names are the model's own (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, ...). Tied parameters
    answer to every name they have, so `lm_head.weight` and `model.embed_tokens.weight` both load a tied embedding.
    Values may be tensors on any device and in any dtype, or numpy arrays; they are converted on copy.

    The iterable is consumed as a stream (one tensor held at a time, so a sender may free each after it is
    taken). An unknown name or a shape mismatch does not stop the stream: every matching entry is loaded, then a
    `ValueError` names all the others. Check a sender's manifest up front with `check_weight_manifest`.
    """
    targets = dict(model.named_parameters(remove_duplicate=False))
    unknown: list[str] = []
    mismatched: list[str] = []
    num_loaded = 0
    with torch.no_grad():
        for name, value in named_tensors:
            target = targets.get(name)
            if target is None:
                unknown.append(name)
                continue
            value = torch.as_tensor(value)
            if value.shape != target.shape:
                mismatched.append(f"{name} {tuple(value.shape)} (model: {tuple(target.shape)})")
                continue
            target.copy_(value)
            num_loaded += 1
    _raise_if_bad(unknown, mismatched)
    return num_loaded


def check_weight_manifest(model: torch.nn.Module, entries: Iterable[tuple[str, tuple[int, ...]]]) -> None:
    """Raise `ValueError` unless every `(name, shape)` names a parameter of `model` with that shape."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    unknown, mismatched = [], []
    for name, shape in entries:
        if name not in targets:
            unknown.append(name)
        elif tuple(shape) != tuple(targets[name].shape):
            mismatched.append(f"{name} {tuple(shape)} (model: {tuple(targets[name].shape)})")
    _raise_if_bad(unknown, mismatched)


def _raise_if_bad(unknown: list[str], mismatched: list[str]) -> None:
    problems = []
    if unknown:
        problems.append(f"the model has no parameter named {_listed(unknown)}")
    if mismatched:
        problems.append(f"shape mismatch for {_listed(mismatched)}")
    if problems:
        raise ValueError("load_weights: " + "; ".join(problems))


def _listed(items: list[str]) -> str:
    return ", ".join(items[:5]) + (f", ... ({len(items)} in all)" if len(items) > 5 else "")
