"""bench/ reads no library private and its modules import each other without a circle."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "bench"
# private members of other projects that a bench reaches on purpose, by the expression they hang off:
# torch's ops and Dynamo config, TRL's planner rule and flash-attention hook (bench/trl_tree_anchor.py mirrors TRL)
FOREIGN = {"torch", "torch.ops.aten", "trl_packing", "batcher"}


def _modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text()) for path in sorted(BENCH.glob("*.py"))}


def test_no_bench_reads_a_library_private():
    found = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = ast.unparse(node.value)
                if base not in {"self", "cls"} and base not in FOREIGN:
                    found.append(f"bench/{name}.py:{node.lineno} {base}.{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlasync"):
                found += [
                    f"bench/{name}.py:{node.lineno} from {node.module} import {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                ]
    assert not found, "benches reading private members (add a public hook in the library):\n" + "\n".join(found)


def test_bench_modules_import_no_circle():
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, tree in modules.items():
        for node in ast.walk(tree):  # imports inside functions count too
            if isinstance(node, ast.Import):
                graph[name] |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module in modules and not node.level:
                graph[name].add(node.module)
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph[name]):
            assert state.get(other) != 1, "import circle: " + " -> ".join([*path, name, other])
            if other not in state:
                visit(other, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert graph["tree_packing"] >= {"learner_shapes", "trl_tree_anchor"}  # the graph sees function-level imports
