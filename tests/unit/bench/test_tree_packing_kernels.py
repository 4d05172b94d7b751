"""bench/tree_packing.py hands the learner's kernel settings (`--kernel KEY=VALUE`, the config's `kernels.*`) to the
tree modes as the learner does, instead of setting environment variables around the calls."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import tree_packing  # noqa: E402

from rlasync.config import KernelSettings  # noqa: E402


def test_kernel_flags_become_settings_and_a_mode_keeps_its_own_head_choice():
    kernels = tree_packing.kernel_settings(['flex_kernel_options={"USE_TMA": true}', "head_keep=probs"])
    assert kernels == KernelSettings(flex_kernel_options={"USE_TMA": True}, head_keep="probs")
    mode = tree_packing.TreeMode([], "cpu", backend="dense", kernels=kernels)
    assert mode.kwargs["kernels"] is kernels and mode.head_keep == "probs"
    logits = tree_packing.TreeMode([], "cpu", backend="dense", head_keep="logits", kernels=kernels)
    assert logits.kwargs["kernels"] == KernelSettings(flex_kernel_options={"USE_TMA": True}, head_keep="logits")
    assert tree_packing.build_parser().parse_args(["--kernel", "head_dynamic=all"]).kernel == ["head_dynamic=all"]


def test_a_bad_kernel_flag_names_the_setting():
    with pytest.raises(SystemExit, match="--kernel: kernels.head_keep='softmax': use one of 'logits', 'probs'"):
        tree_packing.kernel_settings(["head_keep=softmax"])
