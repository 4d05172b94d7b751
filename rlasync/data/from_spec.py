"""Datasets named by a run file's `dataset:` section (`rlasync train run.yaml`): the procedural tasks, a local
JSON/JSONL file, or a hub dataset. `datasets` is imported on use."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlasync.data.code_tasks import code_dataset
from rlasync.data.tasks import arithmetic_dataset, countdown_dataset

DATASET_NAMES = ("arithmetic", "countdown", "code", "json", "hub")
_TASKS = {"arithmetic": arithmetic_dataset, "countdown": countdown_dataset, "code": code_dataset}


def build_dataset(spec: Mapping[str, Any]) -> Any:
    """A `datasets.Dataset` from a run file's `dataset:` section.

    arithmetic / countdown / code: `size`, `seed` and the task's keyword arguments (`max_operand`, `ops`,
    `families`, ...);
    json: `path` (a .json/.jsonl file of rows); hub: `path` (+ `split`, default "train") for `datasets.load_dataset`.
    """
    spec = dict(spec)
    name = spec.pop("name")
    if name in _TASKS:
        size, seed = spec.pop("size", 1000), spec.pop("seed", 0)
        return _TASKS[name](int(size), int(seed), **spec)
    if name in ("json", "hub") and not spec.get("path"):
        raise ValueError(
            f"dataset.path is missing: dataset.name={name!r} needs a `path` (a .json/.jsonl file or hub id)"
        )
    import datasets

    if name == "json":
        path = Path(str(spec["path"])).expanduser()
        if not path.is_file():
            raise ValueError(f"dataset.path={str(spec['path'])!r}: no such file (a .json or .jsonl file of rows)")
        try:
            return datasets.load_dataset("json", data_files=str(path), split="train")
        except Exception as exc:
            raise ValueError(
                f"dataset.path={str(path)!r} cannot be read as JSON rows: {type(exc).__name__}: {exc}"
            ) from None
    if name == "hub":
        try:
            return datasets.load_dataset(spec["path"], split=spec.get("split", "train"))
        except Exception as exc:
            raise ValueError(
                f"dataset.path={spec['path']!r} (split {spec.get('split', 'train')!r}) cannot be loaded: "
                f"{type(exc).__name__}: {_first_line(exc)} (offline? a hub dataset needs the hub or the local cache)"
            ) from None
    raise ValueError(f"dataset.name={name!r}: use one of {DATASET_NAMES}")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().split("\n", 1)[0]
