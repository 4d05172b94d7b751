"""Room for checkpoints, checked before Ray starts: one checkpoint's size estimated from the model's safetensors
headers (the parameter count), against the free space of `output_dir`.

    estimate = parameters x (bytes of the saved model dtype + 8 for AdamW's two fp32 moments) + 10 MB (tokenizer,
               JSON files)

Less room than one checkpoint is refused (the run could never save); less than two is a warning (a save needs
room for the new checkpoint while the previous one is still kept). A LoRA run saves only its adapter: not checked.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

logger = logging.getLogger(__name__)

SAVED_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
OPTIMIZER_BYTES_PER_PARAM = 8  # AdamW: exp_avg and exp_avg_sq in fp32
EXTRA_BYTES = 10_000_000


def parameter_count(model_dir: str | Path) -> int | None:
    """The number of parameters in a local model folder's safetensors files (headers only); None if unknown."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        try:
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error):
            return None
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def checkpoint_bytes(config: TrainerConfig, model_dir: str | Path, lora: bool = False) -> int | None:
    """One checkpoint's estimated size (model in the trainer's `dtype`, fp32 AdamW moments, small files); None
    when the model is not a local folder of safetensors, or the run is LoRA (an adapter-only checkpoint)."""
    if lora:
        return None
    params = parameter_count(model_dir)
    if params is None:
        return None
    per_param = SAVED_DTYPE_BYTES.get(str(getattr(config, "dtype", "float32")), 4) + OPTIMIZER_BYTES_PER_PARAM
    return params * per_param + EXTRA_BYTES


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def check_disk(config: TrainerConfig, model_dir: str | Path, lora: bool = False) -> None:
    """`ValueError` when `output_dir` has less free space than one checkpoint; a warning below two."""
    need = checkpoint_bytes(config, model_dir, lora)
    if need is None:
        return
    try:
        free = shutil.disk_usage(config.output_dir).free
    except OSError:
        return
    if free < need:
        raise ValueError(
            f"output_dir={str(config.output_dir)!r} has {_gb(free)} free, but one checkpoint needs about {_gb(need)} "
            "(model + optimizer state): free space there or choose an output_dir on a larger disk"
        )
    if free < 2 * need:
        logger.warning(
            "output_dir=%r has %s free, room for one checkpoint of about %s but not two (a save writes the new one "
            "before the previous one is pruned): a later save may fail",
            str(config.output_dir),
            _gb(free),
            _gb(need),
        )


__all__ = ["check_disk", "checkpoint_bytes", "parameter_count"]
