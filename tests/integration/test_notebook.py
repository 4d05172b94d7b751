"""examples/notebook.ipynb end to end (nbclient) against a Ray head started here (`ray start --head --block`, token
auth, a Ray Client server on a free port), with a tiny random model: connect through `ray://`, train in a thread,
watch, stop, resume, load the checkpoint and sample. Each step is written once to metrics.jsonl.

Marked `standalone_cluster` (its own Ray head): `.ci/run` runs it in the standalone step,
`python -m pytest -q -m standalone_cluster tests/integration/test_notebook.py`. The head is stopped by ending the
`ray start --block` process this test started (not `ray stop`, which would end every Ray process on the machine).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "examples" / "notebook.ipynb"

pytestmark = pytest.mark.standalone_cluster
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, head: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"nothing listens on port {port} after {timeout_s} s")


@pytest.fixture
def ray_head(tmp_path):
    """A Ray head with token auth and a Ray Client server: yields (gcs port, client port); ended afterwards."""
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    gcs, client = _free_port(), _free_port()
    ray_cli = str(Path(sys.executable).with_name("ray"))
    log = (tmp_path / "ray_start.log").open("w")
    temp_dir = tempfile.mkdtemp(prefix="rlnb", dir="/tmp")  # a short path: Ray's sockets must fit 107 bytes
    head = subprocess.Popen(
        [
            ray_cli,
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            f"--ray-client-server-port={client}",
            "--num-cpus=2",
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_for_port(client, head)
        yield gcs, client
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _execute(client, cell, index) -> None:
    """Run one cell. The connect cell gets a second try: Ray's client proxier, starting the server for a new
    client, at times hits a `psutil.ZombieProcess` of its own and drops that connection (a Ray flake, seen once in
    CI); the cell is written to be re-run (`ray.is_initialized()`), and a failure of any other cell stands."""
    try:
        client.execute_cell(cell, index)
    except nbclient.exceptions.CellExecutionError:
        if cell.cell_type != "code" or "ray.init(" not in cell.source:
            raise
        time.sleep(5.0)
        cell.outputs = []
        client.execute_cell(cell, index)


def test_the_notebook_runs_end_to_end_through_ray_client(ray_head, tmp_path, monkeypatch):
    gcs, client = ray_head
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, str(REPO / ".ci" / "tiny_model.py"), str(model)], check=True, timeout=300)
    out = tmp_path / "out"
    for key, value in {
        "RAY_AUTH_MODE": "token",
        "NOTEBOOK_RAY_ADDRESS": f"ray://127.0.0.1:{client}",
        "NOTEBOOK_MODEL": str(model),
        "NOTEBOOK_TINY": "1",
        "NOTEBOOK_OUTPUT_DIR": str(out),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    executed = nbclient.NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    executed.reset_execution_trackers()
    with executed.setup_kernel():  # NotebookClient.execute, one cell at a time (see `_execute`)
        for index, cell in enumerate(notebook.cells):
            _execute(executed, cell, index)
    text = "\n".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "connected: ray://127.0.0.1:" in text and "resumed from step" in text
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] >= 3, steps
    checkpoints = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert checkpoints and checkpoints[-1] == steps[-1]
    assert "checkpoint-" in text and "->" in text  # sampled from the loaded checkpoint
