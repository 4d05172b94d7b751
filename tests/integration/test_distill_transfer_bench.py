"""bench/distill_transfer.py end to end on the shared Ray local cluster (CPU, tiny random models): the distillation
run and the MOPD run (two teachers routed by `teacher_id`) each train 2 steps, every student checkpoint is scored
on held-out questions, and the JSON carries the keys the device run must produce."""

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import distill_transfer  # noqa: E402


def test_distill_and_mopd_runs_write_curves_and_keys(ray_cluster, tiny_model_dir, tmp_path):
    out = tmp_path / "distill_transfer.json"
    argv = ["--device", "cpu", "--runs", "distill,mopd", "--student", tiny_model_dir, "--teacher", tiny_model_dir]
    argv += ["--teacher2", tiny_model_dir, "--steps", "2", "--eval-every", "1", "--eval-prompts", "4"]
    argv += ["--max-tokens", "4", "--train-rows", "64", "--run-root", str(tmp_path / "runs"), "--out", str(out)]
    distill_transfer.main(argv)
    data = json.loads(out.read_text())
    for key in ("student_accuracy_start", "student_accuracy_final"):
        assert 0.0 <= data[key] <= 1.0, key
    assert 0 < data["minutes"] < 10
    assert [point[0] for point in data["student_accuracy_curve"]] == [0, 1, 2]
    assert all(point[1] is not None and point[1] >= 0 for point in data["student_accuracy_curve"])
    assert data["distill"]["steps"] == 2 and [s for s, _ in data["distill"]["jsd"]] == [1, 2]
    assert len(data["distill"]["jsd_first5_last5"]) == 2 and set(data["distill"]["reached_0_8"]) == {"sums"}
    assert set(data["mopd_curves"]) == {"sums", "diffs"}
    assert all([p[0] for p in curve] == [0, 1, 2] for curve in data["mopd_curves"].values())
    assert set(data["mopd"]["teacher_jsd"]) == {"sums", "diffs"}
    assert all(v is not None for _, v in data["mopd"]["teacher_jsd"]["diffs"])  # both teachers scored rows
    teacher = data["teachers"]["sums"]
    assert teacher["checkpoint"] == tiny_model_dir and teacher["trained_here"] is False
    assert 0.0 <= teacher["accuracy"] <= 1.0 and set(data["student_base"]) == {"sums", "diffs"}
    assert not distill_transfer.checkpoints(tmp_path / "runs" / "distill")  # scored, then removed
