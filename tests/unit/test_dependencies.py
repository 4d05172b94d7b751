"""Dependencies as used: every third-party import under rlasync/ and actors/ (an AST scan, function-level imports
included) is a declared dependency or an extra, and every declared dependency is imported (or named below with
the reason it is needed without an import)."""

import ast
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

IMPORT_TO_DIST = {"yaml": "pyyaml", "math_verify": "math-verify", "mlflow": "mlflow-skinny"}
"""Import names that differ from their distribution's name."""
PROVIDED_BY = {"triton": "torch"}
"""Imported modules that come with a declared distribution (triton ships in torch's CUDA wheels)."""
USED_WITHOUT_IMPORT = {
    "gguf": "transformers reads the SmolLM2 alias's GGUF file with it (rlasync.model.registry)",
    "tensorboard": "torch.utils.tensorboard's SummaryWriter (rlasync.metrics.sinks) needs it",
}
ONLY_IN_TESTS_OR_TOOLS = {"nbclient", "nbformat", "ipykernel", "pytest", "hypothesis", "ruff", "jsonschema", "trl"}
"""Extras for the notebook run and the dev tools: imported by tests, .ci/run and examples, not by the package."""


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def declared() -> dict[str, str]:
    """distribution name -> where it is declared ("core" or the extra's name)."""
    found = {_name(r): "core" for r in PYPROJECT["project"]["dependencies"]}
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items():
        for requirement in requirements:
            if _name(requirement) != "rlasync":
                found.setdefault(_name(requirement), extra)
    return found


def third_party_imports() -> dict[str, set[str]]:
    """top-level import name -> the files importing it (stdlib, rlasync and actors left out)."""
    found: dict[str, set[str]] = {}
    for root in ("rlasync", "actors"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ("rlasync", "actors", "__future__"):
                        found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def _dist(module: str) -> str:
    return IMPORT_TO_DIST.get(module, module).lower().replace("_", "-")


def test_every_third_party_import_is_declared():
    deps = declared()
    undeclared = {
        module: sorted(files)[:3]
        for module, files in third_party_imports().items()
        if _dist(PROVIDED_BY.get(module, module)) not in deps
    }
    assert not undeclared, f"imported but not in pyproject.toml (dependencies or an extra): {undeclared}"


def test_every_declared_dependency_is_used():
    imported = {_dist(PROVIDED_BY.get(m, m)) for m in third_party_imports()} | {_dist(m) for m in third_party_imports()}
    unused = sorted(
        dist
        for dist in declared()
        if dist not in imported and dist not in USED_WITHOUT_IMPORT and dist not in ONLY_IN_TESTS_OR_TOOLS
    )
    assert not unused, f"declared in pyproject.toml but imported nowhere under rlasync/ or actors/: {unused}"


def test_optional_imports_are_extras_not_core():
    """vllm, wandb, matplotlib, tensorboard are extras: the package imports and runs without them."""
    deps = declared()
    assert deps["vllm"] == "vllm" and deps["wandb"] == "wandb" and deps["matplotlib"] == "plot"
    assert deps["tensorboard"] == "tensorboard" and deps["gguf"] == "demo"
    assert "accelerate" not in deps and "kernels" not in deps  # declared once, imported nowhere: dropped


def test_the_scan_sees_function_level_imports():
    imports = third_party_imports()
    assert "rlasync/engine/vllm_engine.py" in imports["vllm"] and "rlasync/plot.py" in imports["matplotlib"]
    assert "ray" in imports and "numpy" in imports


def test_the_demo_alias_without_gguf_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    import pytest

    from rlasync.model import registry

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(registry, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(registry, "_gguf_path", lambda spec: tmp_path / "model.gguf")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a)
    )
    with pytest.raises(ValueError, match=r"needs the gguf package: pip install 'rlasync\[demo\]'"):
        registry.prepare_model("smollm2-135m-instruct", force=True)
