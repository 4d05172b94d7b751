"""Datasets named by a run file's `dataset:` section (`rlasync train run.yaml`): the procedural tasks, a local
JSON/JSONL file, or a hub dataset. `datasets` is imported on use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlasync.data.tasks import arithmetic_dataset, countdown_dataset

DATASET_NAMES = ("arithmetic", "countdown", "json", "hub")


def build_dataset(spec: Mapping[str, Any]) -> Any:
    """A `datasets.Dataset` from a run file's `dataset:` section.

    arithmetic / countdown: `size`, `seed` and the task's keyword arguments (`max_operand`, `ops`, ...);
    json: `path` (a .json/.jsonl file of rows); hub: `path` (+ `split`, default "train") for `datasets.load_dataset`.
    """
    spec = dict(spec)
    name = spec.pop("name")
    if name in ("arithmetic", "countdown"):
        size, seed = spec.pop("size", 1000), spec.pop("seed", 0)
        build = arithmetic_dataset if name == "arithmetic" else countdown_dataset
        return build(int(size), int(seed), **spec)
    import datasets

    if name == "json":
        return datasets.load_dataset("json", data_files=str(spec["path"]), split="train")
    if name == "hub":
        return datasets.load_dataset(spec["path"], split=spec.get("split", "train"))
    raise ValueError(f"dataset.name={name!r}: use one of {DATASET_NAMES}")
