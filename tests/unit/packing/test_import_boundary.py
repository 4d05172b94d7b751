"""rlasync.packing is pure numpy: importing it must not load torch or ray (DESIGN §2)."""

import subprocess
import sys


def test_importing_packing_does_not_load_torch_or_ray():
    code = "import sys, rlasync.packing; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
