"""The algorithms have a home (docs/design.md §2.2): outside `rlasync/algorithms/`, the trainers and the run-file
loader, no module of rlasync/ or actors/ names an algorithm as a mode string ("grpo", "distill", "distillation") or
tests an algorithm's config type with `isinstance`; and a learner rank imports no rollout code: nothing the learner
core (`rlasync/learner/`) or an algorithm's learner objective imports, transitively over the file-level import graph
(every import: module level, lazy, under TYPE_CHECKING), is the rollout runtime (`rlasync/rollout/`) or an
algorithm's rollout side (its loop, policy, spec, the registry).

Parsed with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODE_STRINGS = {"grpo", "distill", "distillation"}
CONFIG_CLASSES = {"AsyncGRPOConfig", "AsyncDistillationConfig", "TrainerConfig"}
ALLOWED = ("rlasync/algorithms/", "rlasync/trainers/", "rlasync/runfile.py")


def python_files(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py") if "__pycache__" not in p.parts)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (a module's, a class's, a function's)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def algorithm_tests(source: str) -> list[str]:
    """Where `source` names an algorithm as a mode string or tests a config type with isinstance."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value.strip().lower() in MODE_STRINGS:
                found.append((node.lineno, f"line {node.lineno}: mode string {node.value!r}"))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
        ):
            if len(node.args) == 2:
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if names & CONFIG_CLASSES:
                    found.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
    return [text for _, text in sorted(found)]


def test_the_scan_finds_mode_strings_and_config_type_tests():
    source = (
        '"""A docstring may say grpo."""\n'
        'kind = "distill"\n'
        'if objective == "grpo": pass\n'
        "ok = isinstance(config, AsyncDistillationConfig)\n"
        "ok = isinstance(config, (config_module.AsyncGRPOConfig, int))\n"
        'name = "grpo_loss"\n'
    )
    assert algorithm_tests(source) == [
        "line 2: mode string 'distill'",
        "line 3: mode string 'grpo'",
        "line 4: isinstance(config, AsyncDistillationConfig)",
        "line 5: isinstance(config, (config_module.AsyncGRPOConfig, int))",
    ]


def test_the_algorithm_folders_exist():
    for name in ("grpo", "distill"):
        folder = REPO / "rlasync" / "algorithms" / name
        assert (folder / "__init__.py").is_file() and (folder / "spec.py").is_file(), folder
        assert (folder / "objective.py").is_file() and (folder / "loop.py").is_file(), folder


def test_no_module_outside_the_algorithms_names_an_algorithm():
    offenders = {}
    for path in python_files("rlasync", "actors"):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith(ALLOWED):
            continue
        found = algorithm_tests(path.read_text())
        if found:
            offenders[relative] = found
    assert offenders == {}, f"ask the Algorithm spec (rlasync.algorithms.registry) instead: {offenders}"


# ---- the learner rank imports no rollout code -----------------------------------------------------------------


def _module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _loaded_files(module: str) -> dict[Path, bool]:
    """The files importing `module` runs: the module itself (True: named) and its parent packages' `__init__`s
    (False: entered on the way)."""
    parts = module.split(".")
    files = {_module_file(".".join(parts[:i])): i == len(parts) for i in range(1, len(parts) + 1)}
    return {f: named for f, named in files.items() if f is not None}


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def _import_nodes(tree: ast.Module, module_level_only: bool) -> list[ast.AST]:
    """Every import statement of `tree`, or only those that run when the module is entered (its top level and
    TYPE_CHECKING blocks; not the bodies of its functions, e.g. a package's lazy `__getattr__`)."""
    if not module_level_only:
        return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    found: list[ast.AST] = []
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If | ast.Try) or _is_type_checking(node):
            pending += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
    return found


def file_imports(path: Path, module_level_only: bool = False) -> dict[Path, bool]:
    """Project files `path` imports -> whether the import names the file (True) or only enters it as a parent
    package (False). Every import statement counts (lazy ones inside functions and TYPE_CHECKING ones included),
    unless `module_level_only`."""
    relative = path.relative_to(REPO).with_suffix("")
    package = ".".join(relative.parts[:-1])
    found: dict[Path, bool] = {}

    def add(files: dict[Path, bool]) -> None:
        for file, named in files.items():
            found[file] = found.get(file, False) or named

    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path)), module_level_only):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_loaded_files(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [_module_file(f"{target}.{alias.name}") for alias in node.names]
            loaded = _loaded_files(target)
            if all(submodules):  # `from package import submodule`: the package is only entered on the way
                loaded = {file: False for file in loaded}
            add(loaded)
            add({submodule: True for submodule in submodules if submodule is not None})
    project = (REPO / "rlasync", REPO / "actors")
    return {f: named for f, named in found.items() if any(f.is_relative_to(root) for root in project)}


def reachable(roots: list[Path]) -> dict[Path, Path | None]:
    """Every file the roots import transitively, with the file that imported it first (for the error's chain). A
    file named by an import contributes all its imports; a package `__init__` only entered on the way to a
    submodule contributes the imports that run on entering it (a lazy `__getattr__` runs only when a name is asked
    of the package itself)."""
    parent: dict[Path, Path | None] = {root: None for root in roots}
    full, entered = set(roots), set()
    stack = [(root, True) for root in roots]
    while stack:
        current, named = stack.pop()
        for imported, imported_named in file_imports(current, module_level_only=not named).items():
            parent.setdefault(imported, current)
            if imported_named and imported not in full:
                full.add(imported)
                stack.append((imported, True))
            elif not imported_named and imported not in full | entered:
                entered.add(imported)
                stack.append((imported, False))
    return parent


def _chain(parent: dict[Path, Path | None], path: Path) -> str:
    chain = []
    node: Path | None = path
    while node is not None:
        chain.append(node.relative_to(REPO).as_posix())
        node = parent[node]
    return " <- ".join(chain)


def is_rollout_code(path: Path) -> bool:
    relative = path.relative_to(REPO).as_posix()
    if relative.startswith("rlasync/rollout/") or relative == "rlasync/algorithms/registry.py":
        return True
    return relative.startswith("rlasync/algorithms/") and path.name in ("loop.py", "policy.py", "spec.py")


def learner_side() -> list[Path]:
    """The learner core and every algorithm's learner objective (what a learner rank unpickles)."""
    return python_files("rlasync/learner") + sorted((REPO / "rlasync" / "algorithms").glob("*/objective.py"))


def test_the_import_graph_sees_lazy_and_relative_imports(tmp_path):
    learner = REPO / "rlasync" / "learner" / "learner.py"
    assert file_imports(learner)[REPO / "rlasync" / "learner" / "objectives.py"] is True
    assert file_imports(learner)[REPO / "rlasync" / "__init__.py"] is False  # entered on the way to rlasync.learner
    registry = file_imports(REPO / "rlasync" / "model" / "registry.py")  # `from rlasync import envs`: a submodule
    assert registry[REPO / "rlasync" / "envs.py"] is True and registry[REPO / "rlasync" / "__init__.py"] is False
    assert is_rollout_code(REPO / "rlasync" / "rollout" / "scheduler.py")
    assert is_rollout_code(REPO / "rlasync" / "algorithms" / "distill" / "loop.py")
    assert not is_rollout_code(REPO / "rlasync" / "algorithms" / "distill" / "objective.py")
    # the distillation loop reaches the rollout scheduler: the walk finds such a chain when it exists
    loop = REPO / "rlasync" / "algorithms" / "distill" / "loop.py"
    assert REPO / "rlasync" / "rollout" / "scheduler.py" in reachable([loop])


def test_the_learner_side_imports_no_rollout_code():
    roots = learner_side()
    assert len(roots) > 8 and any(p.name == "objective.py" for p in roots)
    parent = reachable(roots)
    offenders = [_chain(parent, path) for path in sorted(parent) if is_rollout_code(path)]
    assert offenders == [], "a learner rank would import rollout code:\n" + "\n".join(offenders)
