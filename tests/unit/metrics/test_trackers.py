"""report_to: trackio and mlflow sinks log each record at its step (the real packages, local stores under
tmp_path); "all" is the installed sinks; a sink whose package is missing is refused by the check the preflight runs
before Ray starts, with the install command."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlasync.metrics import sinks as sinks_module
from rlasync.metrics.sinks import build_sinks, check_report_to

REPO = Path(__file__).resolve().parents[3]


def test_mlflow_sink_logs_params_and_metrics_per_step(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    built = build_sinks(tmp_path, ["mlflow"], console=False, run_name="exp", config={"lr": 1e-6, "cluster": {"n": 2}})
    for step in (1, 2):
        for sink in built:
            sink.write(step, {"reward": 0.25 * step, "loss": math.nan, "entropy": None})
    for sink in built:
        sink.close()
    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.run_name == "exp" and run.data.params == {"lr": "1e-06", "cluster.n": "2"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward")] == [(1, 0.25), (2, 0.5)]
    assert "loss" not in run.data.metrics


def test_trackio_sink_writes_its_local_store(tmp_path):
    pytest.importorskip("trackio")
    code = (
        "from rlasync.metrics.sinks import build_sinks\n"
        f"s = build_sinks({str(tmp_path / 'out')!r}, ['trackio'], console=False, run_name='r1', config={{'a': 1}})\n"
        "[k.write(t, {'reward': 0.5 * t}) for t in (1, 2) for k in s]\n[k.close() for k in s]\n"
        "import trackio\nprint(trackio.__version__)\n"
    )
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "TRACKIO_PROJECT": "unit", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "trackio" / "unit.db").is_file()
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in records] == [0.5, 1.0]


def test_check_report_to_before_ray(monkeypatch):
    monkeypatch.setattr(sinks_module, "_importable", lambda module: module in ("mlflow", "tensorboard"))
    assert check_report_to("all") == ["tensorboard", "mlflow"]
    assert check_report_to(["mlflow", "tensorboard", "mlflow"]) == ["mlflow", "tensorboard"]
    with pytest.raises(
        ValueError, match=r"report_to includes 'trackio' but trackio is not installed: pip install 'rlasync\[trackio\]'"
    ):
        check_report_to(["trackio"])
    with pytest.raises(ValueError, match=r"unsupported sink\(s\) \['comet_ml'\]"):
        check_report_to("comet_ml")


def test_the_preflight_refuses_a_missing_tracker(tmp_path, monkeypatch):
    from rlasync.config import AsyncGRPOConfig
    from rlasync.trainers import preflight

    monkeypatch.setattr(sinks_module, "_importable", lambda module: False)
    config = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="mlflow")
    with pytest.raises(ValueError, match=r"pip install 'rlasync\[mlflow\]'"):
        preflight.run_preflight(SimpleNamespace(args=config, model="unused: report_to fails first"))
