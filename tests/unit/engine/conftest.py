import os
import subprocess
import sys

import pytest
import torch


@pytest.fixture
def triton_check():
    """`triton_check(check, file, *args)`: run a Triton kernel's check natively on CUDA, or on CPU under Triton's
    interpreter in a subprocess (`python file *args`, whose `__main__` calls the check): TRITON_INTERPRET must be
    set before Triton is imported. Skips without Triton (it ships with CUDA builds of torch)."""
    pytest.importorskip("triton", reason="Triton is not installed (it ships with CUDA builds of torch)")

    def run(check, file, *args):
        if torch.cuda.is_available():
            check(*args)
            return
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
        result = subprocess.run([sys.executable, file, *map(str, args)], env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]

    return run
