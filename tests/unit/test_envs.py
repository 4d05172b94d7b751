"""Environment variables: every `RLASYNC_*` variable rlasync reads is declared once in `rlasync/envs.py` (name,
type, default, meaning, a typed accessor); no module of rlasync/, actors/, bench/, tests/ or .ci/, nor a code cell of
examples/' notebooks, reads one itself (an example's own parameters carry its own prefix, `NOTEBOOK_*`; parsed
with `ast`: `os.environ.get(...)`, `os.environ[...]`, `os.getenv(...)`, `... in os.environ`, with the name written
out or held in a module constant). Tests may set variables (monkeypatch) for the code under test and subprocesses; a
test's own parameter is a pytest option (tests/gpu/conftest.py's `--fake-pg-out`)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from rlasync import envs

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("rlasync", "actors", "bench", "tests", ".ci")
DECLARING = REPO / "rlasync" / "envs.py"


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ`."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _rlasync_name(node: ast.AST, constants: dict[str, str]) -> str | None:
    value = node.value if isinstance(node, ast.Constant) else constants.get(getattr(node, "id", ""))
    return value if isinstance(value, str) and value.startswith("RLASYNC_") else None


def environment_reads(source: str) -> list[tuple[int, str]]:
    """(line, variable) of every read of an `RLASYNC_*` variable in `source`."""
    tree = ast.parse(source)
    constants = {
        target.id: node.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        keys: list[ast.AST] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if (func.attr in ("get", "pop", "setdefault") and _is_environ(func.value)) or func.attr == "getenv":
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            keys.append(node.left)
        for key in keys:
            name = _rlasync_name(key, constants)
            if name:
                found.append((node.lineno, name))
    return found


def test_the_scan_finds_every_way_of_reading_a_variable():
    source = (
        "import os\nfrom os import environ\nKEEP = 'RLASYNC_HEAD_KEEP'\n"
        "a = os.environ.get('RLASYNC_A', '1')\nb = os.environ['RLASYNC_B']\nc = os.getenv('RLASYNC_C')\n"
        "d = environ.get(KEEP)\ne = 'RLASYNC_E' in os.environ\n"
        "os.environ['RLASYNC_SET'] = '1'\nf = os.environ.get('HOME')\n"
    )
    names = [name for _, name in environment_reads(source)]
    assert names == ["RLASYNC_A", "RLASYNC_B", "RLASYNC_C", "RLASYNC_HEAD_KEEP", "RLASYNC_E"]


def notebook_code(path: Path) -> str:
    """The code cells of a notebook, one module's source."""
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")


def test_no_module_reads_an_rlasync_variable_outside_envs():
    sources = [
        (path, path.read_text())
        for folder in SCANNED
        for path in sorted((REPO / folder).rglob("*.py"))
        if path != DECLARING
    ]
    sources += [(path, notebook_code(path)) for path in sorted((REPO / "examples").rglob("*.ipynb"))]
    assert any(path.suffix == ".ipynb" for path, _ in sources), "the scan reads examples/' notebooks"
    reads = []
    for path, source in sources:
        reads += [f"{path.relative_to(REPO)}:{line} reads ${name}" for line, name in environment_reads(source)]
    assert not reads, "declare the variable in rlasync/envs.py and read it there (or make it a config field):\n" + (
        "\n".join(reads)
    )


def test_declared_variables_are_typed_documented_and_read_now(monkeypatch, tmp_path):
    design = (REPO / "docs" / "design.md").read_text()
    for name, variable in envs.VARIABLES.items():
        assert name.startswith("RLASYNC_") and variable.meaning and variable.default
        assert isinstance(envs.read(name), variable.type)
        assert name in design, f"docs/design.md lists the declared variables; {name} is missing"
    monkeypatch.setenv("RLASYNC_CACHE", str(tmp_path))
    assert envs.RLASYNC_CACHE == tmp_path
    monkeypatch.delenv("RLASYNC_CACHE")
    assert envs.RLASYNC_CACHE == Path.home() / ".cache" / "rlasync"
    with pytest.raises(KeyError, match="not a declared rlasync variable"):
        envs.read("RLASYNC_TREE_ATTENTION")  # a config field now: kernels.tree_attention
