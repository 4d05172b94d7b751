"""The user-facing examples and deploy manifests stay runnable: scripts compile and answer `--help` fast (they
parse arguments before importing torch or starting Ray), the tools-and-environment example's tool and
environment turn into JSON schemas (the deploy manifests: tests/unit/test_deploy_manifests.py)."""

from __future__ import annotations

import importlib.util
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_there_are_examples():
    names = {path.name for path in EXAMPLES}
    assert {"grpo_arithmetic.py", "grpo_tools_env.py", "distill.py"} <= names, names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_compiles_and_answers_help_without_heavy_imports(path):
    py_compile.compile(str(path), doraise=True)
    result = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=20, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "--max-steps" in result.stdout and "--output-dir" in result.stdout, result.stdout


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_importing_an_example_loads_neither_torch_nor_ray(path):
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ex', {str(path)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "heavy = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_tools_and_environment_produce_json_schemas():
    from transformers.utils import get_json_schema

    from rlasync.rollout.environments import probe_environments

    module = _load(ROOT / "examples" / "grpo_tools_env.py")
    schema = get_json_schema(module.multiply)
    assert schema["function"]["name"] == "multiply"
    assert set(schema["function"]["parameters"]["properties"]) == {"a", "b"}
    assert schema["function"]["parameters"]["properties"]["a"]["type"] == "integer"

    spec = probe_environments(module.Calculator)[None]  # what the rollout actors do with the factory
    assert spec.tool_names == ("add",) and spec.owns_reward and spec.name == "Calculator"
    env = spec.acquire()
    (tool,) = spec.tools(env)
    schema = get_json_schema(tool)
    assert schema["function"]["name"] == "add"
    assert set(schema["function"]["parameters"]["properties"]) == {"a", "b"}  # `self` is not a parameter

    # the episode: reset from a dataset row, the tool, the reward
    observation = env.reset(prompt=[{"role": "user", "content": "What is 3 + 4?"}], answer="7", solution="7")
    assert isinstance(observation, str)
    assert env.get_reward() == 0.0
    assert env.add(3, 4) == 7
    assert env.get_reward() == 1.0
    env.reset(answer="9")
    assert env.get_reward() == 0.0  # reset starts a fresh episode


def test_tools_env_example_passes_the_trainers_checks():
    from rlasync.trainers.grpo import _checked_environment_factory, _checked_tools

    module = _load(ROOT / "examples" / "grpo_tools_env.py")
    assert _checked_tools([module.multiply]) == [module.multiply]
    assert _checked_environment_factory(module.Calculator) is module.Calculator
