"""rlasync.algorithms.distill's rollout side is pure core: it loads without torch, ray, transformers or vllm (docs/design.md §2)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]  # the checkout (rlasync importable from it without an install)


def test_distill_loads_without_heavy_dependencies():
    code = (
        "import sys, rlasync.algorithms.distill.spec, rlasync.algorithms.distill.loop\n"
        "print(','.join(m for m in ('torch', 'ray', 'transformers', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == ""
