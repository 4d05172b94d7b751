"""Datasets named by a run file's `dataset:` section (`rlasync train run.yaml`): the procedural tasks, a local
JSON/JSONL file, or a hub dataset. `datasets` is imported on use."""

from __future__ import annotations

import json
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
    dataset = _build(dict(spec))
    try:
        empty = len(dataset) == 0
    except TypeError:  # a streaming dataset: no length
        empty = False
    if empty:
        where = f"dataset.path={str(spec.get('path'))!r}" if spec.get("path") else f"dataset.name={spec.get('name')!r}"
        raise ValueError(f"{where}: the dataset is empty (0 rows); give it rows with a 'prompt' column")
    return dataset


def _build(spec: dict[str, Any]) -> Any:
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
        check_json_rows(path)
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


def check_json_rows(path: Path) -> None:
    """A `.json` / `.jsonl` file that is not UTF-8 JSON: `ValueError` naming the file and the line (the `datasets`
    reader says only "An error occurred while generating the dataset"). JSON Lines: every line is one JSON value."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(
            f"dataset.path={str(path)!r}: line {line}, column {column}: byte 0x{data[exc.start]:02x} is not UTF-8 "
            "(save the file as UTF-8)"
        ) from None
    stripped = text.lstrip()
    if not stripped:
        raise ValueError(
            f"dataset.path={str(path)!r}: the dataset is empty (0 rows); give it rows with a 'prompt' column"
        )
    if stripped[0] == "[":  # a JSON array: the reader's own errors are about the whole file
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as exc:
            if number == 1 and stripped[0] == "{" and path.suffix == ".json":
                return  # one JSON object over several lines (a .json file, not JSON Lines)
            raise ValueError(
                f"dataset.path={str(path)!r}: line {number} is not JSON ({exc.msg} at column {exc.colno}); "
                "JSON Lines has one JSON object per line"
            ) from None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().split("\n", 1)[0]
