"""The learner's checkpoint formats: the HF model (+ tokenizer), `optimizer.pt` keyed by parameter name and
`scheduler.pt` in one directory (with LoRA the model files are peft's adapter files). File names and formats are those every earlier version wrote, so existing
checkpoints resume.

    save_checkpoint(directory, scorer, model, optimizer, scheduler, rank=rank, tokenizer=tok)   # every rank
    load_optimizer_state(directory, scorer, optimizer, scheduler, world_size=world_size)         # every rank

Both run on every rank: under FSDP2 the full state dicts are gathered (collectives), rank 0 writes them, and on
load every rank reads the full optimizer state and keeps its shard. `scorer` is the `TreeScorer` root (its keys
carry the `model.` prefix, stripped for the HF files); `model` is the HF model it holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MODEL_PREFIX = "model."  # the TreeScorer's attribute holding the HF model: stripped from state-dict keys
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"


def save_checkpoint(
    directory: str | Path,
    scorer: torch.nn.Module,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    rank: int = 0,
    tokenizer: Any = None,
    peft_model: Any = None,
) -> None:
    """Every rank: gather the full model and optimizer state (collectives under FSDP2); rank 0 writes the HF
    model (+ tokenizer: an object or a path/id to load it from), `optimizer.pt` and `scheduler.pt`. With
    `peft_model` (LoRA) the model files are the adapter only (`rlasync.learner.lora.save_adapter`)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(scorer, options=options)
    optimizer_state = get_optimizer_state_dict(scorer, optimizer, options=options)
    if rank != 0:
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model_state = {key.removeprefix(MODEL_PREFIX): value for key, value in model_state.items()}
    if peft_model is not None:
        from rlasync.learner.lora import save_adapter

        save_adapter(path, peft_model, model_state)
    else:
        model.save_pretrained(path, state_dict=model_state)
    if tokenizer is not None:
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        tokenizer.save_pretrained(path)
    torch.save(optimizer_state, path / OPTIMIZER_FILE)
    torch.save(scheduler.state_dict(), path / SCHEDULER_FILE)


def load_optimizer_state(
    directory: str | Path,
    scorer: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    world_size: int = 1,
) -> bool:
    """Every rank reads the full optimizer state and keeps its shard (FSDP2) or all of it; the scheduler's state
    too. Returns False when the directory has no `optimizer.pt` (a model-only checkpoint: nothing loaded).

    The older format keyed by parameter position (saved with one rank) still loads with one rank; with several
    it raises `ValueError` saying how to convert it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    path = Path(directory)
    if not (path / OPTIMIZER_FILE).is_file():
        return False
    state = _load(path / OPTIMIZER_FILE)
    if any(isinstance(key, int) for key in state.get("state", {})):  # an older checkpoint: keyed by position
        if world_size > 1:
            raise ValueError(
                f"{path}/optimizer.pt is keyed by parameter position (saved by an older version with one rank): "
                "resume it with cluster.num_learners=1 once, then save again"
            )
        optimizer.load_state_dict(state)
    else:
        set_optimizer_state_dict(scorer, optimizer, state, options=StateDictOptions(full_state_dict=True))
    if (path / SCHEDULER_FILE).is_file():
        scheduler.load_state_dict(_load(path / SCHEDULER_FILE))
    return True


def _load(file: Path) -> Any:
    """`torch.load` of a checkpoint file; an unreadable one (truncated: PytorchStreamReader's "failed finding central
    directory", a pickle error) raises `ValueError` naming the file."""
    try:
        return torch.load(file, weights_only=False, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - re-raised naming the file, the cause chained
        raise ValueError(
            f"{file} is corrupt or unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): "
            f"resume from an earlier checkpoint-* than {file.parent}, or delete this one"
        ) from exc
