"""The README's measured figures agree with the device runs in bench/results/, and bench/README.md's map from headline
to command names scripts, stages, files and keys that exist.

README.md's "Measured" table names, in its last column, a results file (`name.json`, under bench/results/) followed
by one key per **bold** figure of the row's number column, in order. A key is a dotted path into the JSON; a part may
itself hold dots (`0.6B`): the longest key that matches is taken. A figure is compared at the precision it is written
with: `65.0k` is the value / 1000, `36.2%` the value x 100, `57 ms` the value x 1000 when the key ends in `_s`
(seconds) and the value itself otherwise, a bare or `×` figure the value.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
RESULTS = REPO / "bench" / "results"
FIGURE = re.compile(r"^([0-9][0-9,]*(?:\.[0-9]+)?)\s*(k|%|×|x|ms|s)?$")


def resolve(data: Any, key: str) -> Any:
    """`a.b.c` into nested dicts, where a part may itself contain dots (longest match first)."""
    if key == "":
        return data
    if not isinstance(data, dict):
        raise KeyError(key)
    for name in sorted(data, key=len, reverse=True):
        if key == name:
            return data[name]
        if key.startswith(name + "."):
            try:
                return resolve(data[name], key[len(name) + 1 :])
            except KeyError:
                continue
    raise KeyError(key)


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first table after `heading` (header and separator rows dropped; `\\|` is a literal bar)."""
    section = text.split(heading, 1)[1]
    lines = section.split("\n\n|", 1)[1] if not section.lstrip("\n").startswith("|") else section.lstrip("\n")[1:]
    rows = []
    for line in ("|" + lines).splitlines():
        if not line.startswith("|"):
            break
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append(cells)
    return rows[2:]


def sources(cell: str) -> list[tuple[str, str]]:
    """(`file`, `key`) pairs from a results cell: a `*.json` token sets the file for the keys after it."""
    pairs, current = [], None
    for token in re.findall(r"`([^`]+)`", cell):
        if token.endswith(".json"):
            current = token
        else:
            assert current, f"key {token!r} before any results file in {cell!r}"
            pairs.append((current, token))
    return pairs


def shown_matches(shown: str, value: float, key: str) -> tuple[bool, float]:
    match = FIGURE.match(shown)
    assert match, f"cannot read the figure {shown!r}"
    number, unit = match.group(1).replace(",", ""), match.group(2)
    decimals = len(number.split(".")[1]) if "." in number else 0
    scale = {"k": 1e-3, "%": 100.0}.get(unit, 1.0)
    if unit == "ms" and key.endswith("_s"):
        scale = 1e3
    converted = float(value) * scale
    return abs(converted - float(number)) <= 0.5 * 10**-decimals + 1e-9, converted


def load(name: str) -> Any:
    path = RESULTS / name
    assert path.is_file(), f"bench/results/{name} does not exist"
    return json.loads(path.read_text())


def measured_rows() -> list[list[str]]:
    rows = table_rows((REPO / "README.md").read_text(), "## Measured")
    assert len(rows) >= 8, "README.md's Measured table not found"
    return rows


def test_resolve_takes_keys_that_hold_dots():
    data = {"a": {"weight (0.6B)": {"x": 1}, "weight (0": {"6B)": 2}}, "b.c": 3}
    assert resolve(data, "a.weight (0.6B).x") == 1
    assert resolve(data, "b.c") == 3
    with pytest.raises(KeyError):
        resolve(data, "a.missing")


def test_figures_are_read_at_their_precision():
    assert shown_matches("65.0k", 64960.5, "tok_s")[0] and not shown_matches("65.1k", 64960.5, "tok_s")[0]
    assert shown_matches("3.79×", 3.7895, "speedup")[0] and not shown_matches("3.7×", 3.7895, "speedup")[0]
    assert shown_matches("36.2%", 0.36248, "mfu")[0] and not shown_matches("35%", 0.36248, "mfu")[0]
    assert shown_matches("57 ms", 0.05675, "perf/weight_sync_s")[0]
    assert shown_matches("139 ms", 139.03, "CUDA IPC (first run)")[0]


@pytest.mark.parametrize("row", measured_rows(), ids=lambda row: row[0][:40])
def test_readme_measured_figures_match_bench_results(row):
    assert len(row) == 4, f"a Measured row needs 4 cells (what, number, hardware/command, results): {row[0]!r}"
    figures = re.findall(r"\*\*([^*]+)\*\*", row[1])
    keys = sources(row[3])
    assert figures, f"{row[0]!r}: no bold figure"
    assert len(figures) == len(keys), f"{row[0]!r}: {len(figures)} bold figures but {len(keys)} keys"
    for shown, (name, key) in zip(figures, keys):
        value = resolve(load(name), key)
        ok, converted = shown_matches(shown, value, key)
        assert ok, f"README says {shown} but bench/results/{name} {key} = {value} ({converted:.4g})"


def stage_names() -> set[str]:
    text = (REPO / "bench" / "device_runs.sh").read_text()
    return set(re.findall(r"^([a-z_0-9]+)\)  # ", text, re.MULTILINE))


def test_bench_readme_names_scripts_stages_files_and_keys_that_exist():
    rows = table_rows((REPO / "bench" / "README.md").read_text(), "## Which command reproduces which headline")
    assert len(rows) >= 20
    stages = stage_names()
    for headline, command, stage, results, key in rows:
        script = re.search(r"`(bench/[a-z_0-9]+\.py)", command)
        assert script and (REPO / script.group(1)).is_file(), f"{headline!r}: no bench script in {command!r}"
        named = re.findall(r"`([a-z_0-9]+)`", stage)
        assert stage == "—" or named, f"{headline!r}: stage {stage!r}"
        assert set(named) <= stages, f"{headline!r}: no stage {set(named) - stages} in bench/device_runs.sh"
        (name,) = re.findall(r"`([^`]+\.json)`", results)
        (path,) = re.findall(r"`([^`]+)`", key)
        resolve(load(name), path)
