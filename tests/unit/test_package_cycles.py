"""No import cycle among rlasync packages: the graph between sub-packages (`rlasync.X`, X the first component
after `rlasync`; a top-level module such as `rlasync/advantages.py` is a node of its own) is acyclic.

Every import counts: at module level, inside functions and under `if TYPE_CHECKING:` (a lazy import only hides a
cycle). Parsed with `ast`, nothing is imported. Also checked: `rlasync.records` is a leaf and `rlasync.config`
imports no other rlasync package (both are what every component may depend on).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rlasync"


def _module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported_modules(path: Path, root: Path = REPO) -> set[str]:
    """Absolute names of every module `path` imports, wherever the import statement is."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return found


def _node(module: str, package: Path = PACKAGE) -> str | None:
    """`rlasync.X` for any module under rlasync (X a sub-package or a top-level module), else None."""
    parts = module.split(".")
    if parts[0] != "rlasync" or len(parts) < 2:
        return None
    candidate = package / parts[1]
    if candidate.is_dir() or candidate.with_suffix(".py").is_file():
        return f"rlasync.{parts[1]}"
    return None


def package_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Edges `rlasync.X -> rlasync.Y` (X != Y) of every import under `package` (rlasync/)."""
    root = package.parent
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sorted(package.rglob("*.py")):
        source = _node(_module_name(path, root), package)
        if source is None:
            continue
        graph[source]
        for imported in _imported_modules(path, root):
            target = _node(imported, package)
            if target is not None and target != source:
                graph[source].add(target)
    return dict(graph)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as `[a, b, ..., a]`, or None when the graph is acyclic (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    for root in sorted(graph):
        if state.get(root):
            continue
        stack: list[tuple[str, list[str]]] = [(root, sorted(graph.get(root, ())))]
        path = [root]
        state[root] = 1
        while stack:
            node, pending = stack[-1]
            if not pending:
                stack.pop()
                path.pop()
                state[node] = 2
                continue
            child = pending.pop(0)
            if state.get(child) == 1:
                return path[path.index(child) :] + [child]
            if not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, sorted(graph.get(child, ()))))
    return None


def test_find_cycle_reports_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_imports_inside_functions_and_relative_imports_are_found(tmp_path):
    package = tmp_path / "rlasync"
    (package / "a").mkdir(parents=True)
    (package / "b").mkdir()
    (package / "a" / "__init__.py").write_text("def f():\n    from rlasync.b import x\n")
    (package / "b" / "__init__.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import y\n"
    )
    graph = package_graph(package)
    assert graph == {"rlasync.a": {"rlasync.b"}, "rlasync.b": {"rlasync.a"}}
    assert find_cycle(graph) == ["rlasync.a", "rlasync.b", "rlasync.a"]


def test_rlasync_packages_form_no_import_cycle():
    graph = package_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among rlasync packages: " + " -> ".join(cycle)


def test_records_is_a_leaf():
    imported = {_node(name) for name in _imported_modules(PACKAGE / "records.py")}
    assert imported <= {None}, f"rlasync/records.py imports {sorted(n for n in imported if n)}"


def test_config_imports_no_other_rlasync_package():
    extra = package_graph().get("rlasync.config", set())
    assert extra == set(), f"rlasync.config must not import other rlasync packages, imports {sorted(extra)}"
