"""bench/startup.py reads the start-up phases of a run's first training record and takes medians over repeats."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import startup  # noqa: E402


def test_the_first_training_record_gives_the_phases(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [
        {"eval/reward": 0.5},  # an evaluation record has no step
        {"step": 1, "time": 100.0, "perf/startup/ray_s": 2.5, "perf/startup/cold_sync_s": 0.25, "loss": 1.0},
        {"step": 2, "time": 101.0, "perf/startup/ray_s": 9.0},
    ]
    metrics.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    record = startup.first_record(metrics)
    assert record["step"] == 1
    assert startup.phases(record) == {"ray": 2.5, "cold_sync": 0.25}
    metrics.write_text(json.dumps({"eval/reward": 0.5}) + "\n")
    with pytest.raises(ValueError, match="no training record"):
        startup.first_record(metrics)


def test_medians_over_repeats_keep_a_phase_missing_from_some():
    runs = [
        {"phases_s": {"ray": 1.0, "learners": 10.0}, "command_to_first_step_s": 30.0, "command_s": 40.0},
        {
            "phases_s": {"ray": 3.0, "learners": 14.0, "engines": 2.0},
            "command_to_first_step_s": 20.0,
            "command_s": 35.0,
        },
        {"phases_s": {"ray": 2.0, "learners": 12.0}, "command_to_first_step_s": 25.0, "command_s": 50.0},
    ]
    summary = startup.summarize(runs)
    assert summary["phases_s_median"] == {"engines": 2.0, "learners": 12.0, "ray": 2.0}
    assert summary["command_to_first_step_s_median"] == 25.0 and summary["command_s_median"] == 40.0
