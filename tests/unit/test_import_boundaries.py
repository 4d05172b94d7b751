"""The layering rules of DESIGN.md §2, checked in fresh interpreters: the pure core loads without torch,
and nothing under rlasync/ loads ray or vllm."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PURE = [
    "rlasync.config", "rlasync.packing", "rlasync.rollout", "rlasync.rewards", "rlasync.advantages", "rlasync.metrics",
    "rlasync.engine", "rlasync.data", "rlasync.pipeline", "rlasync.rollout.loop", "rlasync.rollout.concurrency",
]
TENSOR = ["rlasync.losses", "rlasync.model", "rlasync.cli"]


def _loaded_after_import(modules: list[str], watched: tuple[str, ...]) -> list[str]:
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(','.join(w for w in {watched!r} if w in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, text=True)
    return [name for name in out.stdout.strip().split(",") if name]


def test_pure_core_loads_without_torch_ray_or_transformers():
    assert _loaded_after_import(PURE, ("torch", "ray", "transformers", "datasets", "vllm")) == []


@pytest.mark.parametrize("module", TENSOR)
def test_tensor_core_never_loads_ray_or_vllm(module):
    assert _loaded_after_import([module], ("ray", "vllm")) == []
