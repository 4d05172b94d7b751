"""Layout rules that measure seams (docs/design.md §2.1), parsed with `ast` (nothing is imported):

- no import circle between files of `rlasync/`, `actors/` and `bench/`: two files that import each other are one
  module cut in two (every import counts: module level, inside functions, under `if TYPE_CHECKING:`);
- no reading another class's `_private` members across modules in `rlasync/` and `actors/`: `x._name` (or
  `getattr(x, "_name")`) where `x` is not `self` / `cls` is allowed only when `_name` is defined in the same module
  (assigned as an attribute, a method or a class attribute). Ray's `ActorHandle._actor_id` is read by one named
  helper (`actors.fanout.actor_id`); a few private names of third-party libraries are listed with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.test_package_cycles import _module_name, find_cycle

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("rlasync", "actors", "bench")


# Ray's only way to a handle's id: read in actors/fanout.py `actor_id` and nowhere else.
RAY_ACTOR_ID = ("_actor_id", "actors/fanout.py", "actor_id")
# Private names of third-party libraries, each with why it is read (not a class of this project).
THIRD_PARTY_PRIVATES = {
    "_dynamo": "torch._dynamo: maybe_mark_dynamic and its exception types have no public alias",
    "_inductor": "torch._inductor.exc: the compile error types, to fall back to eager",
    "_foreach_mul": "torch._foreach_*: the fused multi-tensor ops (public in all but name)",
    "_foreach_copy_": "torch._foreach_*: the fused multi-tensor ops (public in all but name)",
    "_schema": "an aten op's schema (torch's documented way to read its mutable arguments)",
    "_attn_implementation": "transformers' config field for the attention implementation in use",
    "_replace": "NamedTuple._replace (public API of named tuples)",
    "_exit": "os._exit: the documented way to leave at once (a second signal, the shutdown grace period)",
    "_current_frames": "sys._current_frames: the documented way to read another thread's stack (a stall watchdog)",
}


# ---- file-level import graph ----------------------------------------------------------------------------------


def _module_files(roots: tuple[str, ...] = ROOTS, repo: Path = REPO) -> dict[str, Path]:
    """Module name -> file, for every Python file under `roots`."""
    return {_module_name(path, repo): path for root in roots for path in sorted((repo / root).rglob("*.py"))}


def _imported_files(path: Path, files: dict[str, Path], repo: Path) -> set[str]:
    """The modules of `files` that `path` imports, wherever the statement is: `import a.b` -> a.b; `from a import
    b` -> a.b when that is a module, else a (the name is defined in, or re-exported by, a's `__init__`); in a folder
    of scripts (no `__init__.py`, e.g. bench/) `import x` is its sibling x.py."""
    module = _module_name(path, repo)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
    if not (path.parent / "__init__.py").exists():  # a folder of scripts (bench/): siblings import as top level
        found |= {f"{package}.{name}" for name in found if f"{package}.{name}" in files}
    return {name for name in found if name in files and name != module}


def file_graph(roots: tuple[str, ...] = ROOTS, repo: Path = REPO) -> dict[str, set[str]]:
    """Edges `module -> module` between the files under `roots` (every import statement counts)."""
    files = _module_files(roots, repo)
    return {module: _imported_files(path, files, repo) for module, path in files.items()}


def test_file_graph_finds_imports_in_functions_and_type_checking(tmp_path):
    (tmp_path / "rlasync").mkdir()
    (tmp_path / "rlasync" / "__init__.py").write_text("")
    (tmp_path / "rlasync" / "a.py").write_text("def f():\n    from rlasync.b import x\n")
    (tmp_path / "rlasync" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
    )
    (tmp_path / "rlasync" / "c.py").write_text("import rlasync.b\nfrom rlasync import VERSION\n")
    graph = file_graph(("rlasync",), tmp_path)
    assert graph["rlasync.a"] == {"rlasync.b"} and graph["rlasync.b"] == {"rlasync.a"}
    assert graph["rlasync.c"] == {"rlasync.b", "rlasync"}
    assert find_cycle(graph) == ["rlasync.a", "rlasync.b", "rlasync.a"]
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "one.py").write_text("def f():\n    from two import g\n")
    (tmp_path / "bench" / "two.py").write_text("import one\n")
    assert find_cycle(file_graph(("bench",), tmp_path)) == ["bench.one", "bench.two", "bench.one"]


def test_no_import_circle_between_files():
    graph = file_graph()
    assert {"rlasync.engine.torch_engine", "actors.cluster", "bench.tree_packing"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "files that import each other (merge them or move what both need): " + " -> ".join(cycle)


# ---- reads of another module's privates -----------------------------------------------------------------------


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_names(tree: ast.Module) -> set[str]:
    """Names this module defines on objects: attributes it assigns, functions / methods, classes, class attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and len(node.args) >= 2:
            if isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                names.add(node.args[1].value)
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                targets = statement.targets if isinstance(statement, ast.Assign) else []
                if isinstance(statement, ast.AnnAssign):
                    targets = [statement.target]
                names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


def _private_reads(tree: ast.Module) -> list[tuple[int, str, str, str]]:
    """(line, the expression's base, the private name, the enclosing function) of every `x._name` and
    `getattr(x, "_name", ...)` / `hasattr(x, "_name")` where x is not `self` / `cls`."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        base = name = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _is_private(node.attr):
            base, name = node.value, node.attr
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr") and len(node.args) >= 2:
            key = node.args[1]
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and _is_private(key.value):
                base, name = node.args[0], key.value
        if name is not None and not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
            found.append((node.lineno, ast.unparse(base), name, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "")
    return found


def cross_module_private_reads(path: Path, repo: Path = REPO) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    own = _defined_names(tree)
    where = path.relative_to(repo).as_posix()
    bad = []
    for line, base, name, function in _private_reads(tree):
        if name in own or name in THIRD_PARTY_PRIVATES:
            continue
        if (name, where, function) == RAY_ACTOR_ID:
            continue
        bad.append(f"{where}:{line}: {base}.{name} (in {function or 'module level'})")
    return bad


def test_private_reads_are_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "class A:\n"
        "    _kept = 1\n"
        "    def f(self, other):\n"
        "        self._own = other._own\n"  # defined here: allowed
        "        return other._scheduler, getattr(other, '_runner', None), self._anything, other._kept\n"
    )
    assert cross_module_private_reads(path, tmp_path) == [
        "m.py:5: other._scheduler (in f)",
        "m.py:5: other._runner (in f)",
    ]
    path.write_text("def g(handle):\n    return handle._actor_id.hex()\n")
    assert cross_module_private_reads(path, tmp_path) == ["m.py:2: handle._actor_id (in g)"]


@pytest.mark.parametrize("root", ["rlasync", "actors"])
def test_no_module_reads_another_modules_privates(root):
    bad = [hit for path in sorted((REPO / root).rglob("*.py")) for hit in cross_module_private_reads(path)]
    assert not bad, "reads of privates defined in another module (add a public name or move the code):\n" + "\n".join(
        bad
    )


def test_ray_actor_id_is_read_in_one_helper():
    path = REPO / RAY_ACTOR_ID[1]
    reads = [hit for hit in _private_reads(ast.parse(path.read_text())) if hit[2] == "_actor_id"]
    assert [function for _, _, _, function in reads] == [RAY_ACTOR_ID[2]]
