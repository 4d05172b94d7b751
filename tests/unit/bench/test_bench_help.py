"""Every bench script answers `--help` and importing a bench module runs nothing.

One process imports every bench module (torch and rlasync load once, so the whole file stays well under a minute on
two cores) and calls each script's `main` with `--help`: argparse prints the usage and exits 0 before any work. The
shell scripts answer `--help` in a subprocess. No script is skipped: none needs CUDA to import.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "bench"
# modules that other benches import and that have no command of their own
HELPERS = {"learner_shapes", "tree_profile", "vllm_common"}
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in HELPERS)


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test)


def _runs_something(node: ast.stmt) -> bool:
    """A module-level statement that does work on import (anything but imports, definitions, constants, the
    docstring, `sys.path.insert(...)` and the `__main__` guard)."""
    if isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return False
    if isinstance(node, ast.Assign | ast.AnnAssign):
        return False
    if isinstance(node, ast.Expr):
        if isinstance(node.value, ast.Constant):
            return False
        return not ast.unparse(node.value).startswith("sys.path.insert(")
    return not _is_main_guard(node)


def test_every_bench_file_is_a_script_or_a_named_helper():
    assert SCRIPTS, "no bench scripts found"
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = any(_is_main_guard(node) for node in tree.body)
        if path.stem in HELPERS:
            assert not guarded, f"{path.name} is a helper module: move its command into a script of its own"
        else:
            assert guarded, f"{path.name}: add `if __name__ == '__main__': main()` (or list it in HELPERS)"
        doing = [ast.unparse(node).splitlines()[0] for node in tree.body if _runs_something(node)]
        assert not doing, f"importing {path.name} runs {doing}: put it under main()"


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_answers_help(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module(name)
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py", "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 0, name
    text = out.getvalue()
    assert text.startswith(f"usage: {name}.py"), text[:200]
    description = text.split("\n\n")[1] if "\n\n" in text else ""
    assert description and not description.startswith("options:"), f"{name}: give its ArgumentParser a description"


@pytest.mark.parametrize("script", ["device_runs.sh", "profile_system.sh"])
def test_shell_script_answers_help(script):
    done = subprocess.run(["bash", str(BENCH / script), "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), script
    if script == "device_runs.sh":
        stages = re.findall(r"^([a-z_0-9]+)\)  # ", (BENCH / script).read_text(), re.MULTILINE)
        assert len(stages) > 20
        listed = re.findall(r"^  ([a-z_0-9]+): ", done.stdout, re.MULTILINE)
        assert listed == stages
