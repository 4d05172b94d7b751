"""The layering rules of docs/design.md §2, over every module under rlasync/ (walked from the file tree, not a list):
no module imports ray (at module level or inside a function), the only imports of `actors` are the launch call
inside the trainers' train(), and in fresh interpreters the pure core loads without torch / ray / transformers
while the tensor core never loads ray or vllm."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rlasync"

# the one sanctioned way from the core to Ray: `from actors.cluster import launch` inside a trainer's train()
LAUNCH_SITES = {("rlasync.trainers.base", "AsyncTrainerBase.train")}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> list[tuple[str, Path]]:
    return sorted((module_name(p), p) for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith("TYPE_CHECKING")


def imports(tree: ast.AST):
    """(imported module, enclosing `Class.function` or "" at module level) for every import in `tree`; imports
    under `if TYPE_CHECKING:` have the scope "TYPE_CHECKING"."""
    found = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking_block(child):  # typing only: never runs, but still no ray there
                scope_here = [*scope, "TYPE_CHECKING"]
                visit(child, scope_here)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, ".".join(scope)) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module, ".".join(scope)))
            inner = (
                [*scope, child.name]
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                else scope
            )
            visit(child, inner)

    visit(tree, [])
    return found


MODULES = all_modules()
IMPORTS = {name: imports(ast.parse(path.read_text(), str(path))) for name, path in MODULES}


def test_the_walk_finds_the_whole_package():
    names = {name for name, _ in MODULES}
    assert {"rlasync", "rlasync.cli", "rlasync.trainers.grpo", "rlasync.driver.step_loop", "rlasync.pipeline"} <= names
    assert len(names) > 60


def test_no_module_under_rlasync_imports_ray():
    offenders = [
        (name, module, scope or "<module>")
        for name, found in IMPORTS.items()
        for module, scope in found
        if module == "ray" or module.startswith("ray.")
    ]
    assert offenders == []


def test_the_only_imports_of_actors_are_the_launch_call_in_train():
    sites = {
        (name, scope)
        for name, found in IMPORTS.items()
        for module, scope in found
        if module == "actors" or module.startswith("actors.")
    }
    assert sites == LAUNCH_SITES


def test_the_ast_scan_sees_imports_inside_functions():
    found = imports(
        ast.parse("def f():\n    import ray.util\n\nclass C:\n    def g(self):\n        from ray import get\n")
    )
    assert found == [("ray.util", "f"), ("ray", "C.g")]


def _loaded_after_import(modules: list[str], watched: tuple[str, ...]) -> list[str]:
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(','.join(w for w in {watched!r} if w in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, text=True)
    return [name for name in out.stdout.strip().split(",") if name]


HEAVY = ("torch", "transformers", "datasets", "vllm")


def _internal_deps(name: str) -> set[str]:
    """The rlasync modules `name` loads when imported: its module-level imports and their parent packages."""
    names = {n for n, _ in MODULES}
    deps = set()
    for module, scope in IMPORTS[name]:
        if scope or not module.startswith("rlasync"):
            continue
        parts = module.split(".")
        deps.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in names)
    return deps


def _loads_heavy(name: str, seen: dict[str, bool]) -> bool:
    """Whether importing `name` imports a tensor library at module level, directly or through rlasync modules."""
    if name not in seen:
        seen[name] = False  # a cycle adds nothing
        direct = any(not scope and module.split(".")[0] in HEAVY for module, scope in IMPORTS[name])
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        seen[name] = direct or any(_loads_heavy(dep, seen) for dep in _internal_deps(name) | parents)
    return seen[name]


_SEEN: dict[str, bool] = {}
RUNNABLE = [name for name, _ in MODULES if not name.endswith("__main__")]  # importing __main__ runs the CLI
PURE = [name for name in RUNNABLE if not _loads_heavy(name, _SEEN)]
TENSOR = [name for name in RUNNABLE if _loads_heavy(name, _SEEN)]


def test_the_pure_core_is_most_of_the_package():
    for name in (
        "rlasync",
        "rlasync.cli",
        "rlasync.trainers",
        "rlasync.driver.step_loop",
        "rlasync.pipeline",
        "rlasync.algorithms.grpo.loop",
        "rlasync.config",
    ):
        assert name in PURE, name
    assert TENSOR, "no module imports torch at all?"


def test_pure_core_loads_without_torch_ray_or_transformers():
    """Every module that imports no tensor library at module level (by the scan), all in one interpreter: it must
    not load one (nor ray) at run time either, e.g. through an import the scan cannot see."""
    assert _loaded_after_import(PURE, ("torch", "ray", "transformers", "datasets", "vllm")) == []


def test_tensor_core_never_loads_ray_or_vllm():
    """Every other module, all in one interpreter (engines import vllm lazily, when built)."""
    assert _loaded_after_import(TENSOR, ("ray", "vllm")) == []


def test_the_checks_before_ray_import_no_torch():
    """A bad model alias or a config error is reported in about a second: the CLI, the config, the trainers and
    their preflight (model aliases included) import neither torch nor peft until a run really starts."""
    import subprocess
    import sys

    code = (
        "import sys, rlasync.cli, rlasync.trainers.preflight, rlasync.model.registry, rlasync.config; "
        "from rlasync import AsyncGRPOTrainer; "
        "print(sorted(m for m in ('torch', 'peft', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
